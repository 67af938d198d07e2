//! The C ABI's JSON documents: the settings documents (a tuner's options and settings, the
//! solver's options) read through serde, each a `#[serde(deny_unknown_fields)]` struct, with
//! serde's messages put in the C ABI's words, naming the document and the key; and the other
//! JSON arguments ([`parse_argument`]). In every one a key given twice is an error (serde_json
//! would keep the last one silently), an enumerated value is one of its names exactly as
//! documented ([`choice`]), and a message shows a caller's value bounded ([`echo`]).

use super::error::{bounded, echo, invalid, FfiError, ECHO_CHARS};
use crate::solver::units::parse_size;
use serde::de::{DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashSet;

/// How messages name a document.
pub(super) struct Document {
    /// The prefix of a message about one key (`settings`).
    pub name: &'static str,
    /// What text that is not JSON is told (`settings are not JSON`).
    pub not_json: &'static str,
    /// What JSON that is not an object is told, before the value (`settings must be a JSON
    /// object, not`).
    pub not_object: &'static str,
}

/// Reads `text`, a JSON object, as the document `T`. An unknown key is
/// `<name>: unknown key `k` (expected one of: a, b)`; a value of the wrong kind is
/// `<name>: <key> is <value>; give <what serde expected>`, and any other message about a key's
/// value is `<name>: <key>: <message>`.
pub(super) fn parse_document<T: DeserializeOwned>(
    text: &str,
    document: &Document,
) -> Result<T, FfiError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| invalid(format!("{}: {}", document.not_json, serde_message(&e))))?;
    let Value::Object(fields) = &value else {
        return Err(invalid(format!(
            "{} {}",
            document.not_object,
            echo(&value.to_string())
        )));
    };
    unique_keys(text).map_err(|e| invalid(format!("{}: {e}", document.name)))?;
    T::deserialize(&value).map_err(|e| {
        let message = e.to_string();
        if let Some((key, expected)) = unknown_key(&message) {
            return invalid(format!(
                "{}: unknown key `{}` (expected one of: {expected})",
                document.name,
                echo(key)
            ));
        }
        // serde does not say which key it was reading: the one that fails alone.
        let failing = fields.iter().find_map(|(key, field)| {
            let alone = Value::Object([(key.clone(), field.clone())].into_iter().collect());
            T::deserialize(&alone).err().map(|e| (key, e))
        });
        match failing {
            Some((key, e)) => {
                let message = e.to_string();
                match what_was_expected(&message) {
                    Some(expected) => invalid(format!(
                        "{}: {key} is {}; give {expected}",
                        document.name,
                        echo(&fields[key].to_string())
                    )),
                    None => invalid(format!(
                        "{}: {key}: {}",
                        document.name,
                        bounded(&message, 4 * ECHO_CHARS)
                    )),
                }
            }
            None => invalid(format!(
                "{}: {}",
                document.name,
                bounded(&message, 4 * ECHO_CHARS)
            )),
        }
    })
}

/// Reads the JSON argument `name` (a problem, plans, tasks, ...) as `T`: a key given twice
/// anywhere in it is an error, and serde's message is bounded (it may quote a value).
pub(super) fn parse_argument<T: DeserializeOwned>(text: &str, name: &str) -> Result<T, FfiError> {
    let value = serde_json::from_str(text)
        .map_err(|e| invalid(format!("{name}: {}", serde_message(&e))))?;
    unique_keys(text).map_err(|e| invalid(format!("{name}: {e}")))?;
    Ok(value)
}

/// serde_json's message, which may quote a caller's value whole, bounded.
fn serde_message(error: &serde_json::Error) -> String {
    bounded(&error.to_string(), 4 * ECHO_CHARS)
}

/// Checks that no object in the JSON `text` (valid JSON) names a key twice, at any depth:
/// serde_json keeps the last one silently, so `{"no_cache": true, "no_cache": false}` would
/// mean whatever came last.
fn unique_keys(text: &str) -> Result<(), String> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    UniqueKeys
        .deserialize(&mut deserializer)
        .map_err(|e| bounded(&e.to_string(), 4 * ECHO_CHARS))
}

/// Walks a JSON value, refusing an object with a key given twice.
struct UniqueKeys;

impl<'de> DeserializeSeed<'de> for UniqueKeys {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueKeys {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(UniqueKeys)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if seen.contains(&key) {
                return Err(serde::de::Error::custom(format!(
                    "key `{}` is given twice",
                    echo(&key)
                )));
            }
            map.next_value_seed(UniqueKeys)?;
            seen.insert(key);
        }
        Ok(())
    }
}

/// The value among `all` whose `name` is `given`, exactly as written: the one case rule of
/// every enumerated value in a document (lowercase, as documented; `POWER-OF-TWO` is as
/// unknown as `pow2`). The error starts with `at` (the document and key), calls the value a
/// `what` and lists the names.
pub(super) fn choice<T: Copy>(
    at: &str,
    what: &str,
    given: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<T, FfiError> {
    all.iter()
        .copied()
        .find(|&value| name(value) == given)
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|&value| name(value)).collect();
            invalid(format!(
                "{at}: unknown {what} `{}` (expected one of: {}, written exactly so)",
                echo(given),
                names.join(", ")
            ))
        })
}

/// What serde expected, in its message about a value of the wrong kind or range (`a boolean`
/// of `invalid type: string "yes", expected a boolean`); `None` for other messages.
fn what_was_expected(message: &str) -> Option<&str> {
    if !(message.starts_with("invalid type: ") || message.starts_with("invalid value: ")) {
        return None;
    }
    message
        .find(", expected ")
        .map(|at| &message[at + ", expected ".len()..])
}

/// The key and the expected keys of serde's `unknown field `k`, expected one of `a`, `b``.
fn unknown_key(message: &str) -> Option<(&str, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .strip_prefix(", expected one of ")
        .or_else(|| rest.strip_prefix(", expected "))?;
    Some((key, expected.replace('`', "")))
}

/// For a field that may be left out but not given as `null`: `Some` of its value.
pub(super) fn some<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(deserializer).map(Some)
}

/// For a field whose `null` means something else than leaving it out: `Some(None)` for
/// `null` (with `#[serde(default)]`, `None` when left out).
pub(super) fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(deserializer).map(Some)
}

/// A byte count given as a whole number or a string such as `"64MiB"` (binary suffixes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number of bytes or a string like \"64MiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, bytes: u64) -> Result<Size, E> {
                Ok(Size(bytes))
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Size, E> {
                parse_size(text).map(Size).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[serde(default, deserialize_with = "some")]
        name: Option<String>,
        #[serde(default, deserialize_with = "present")]
        limit: Option<Option<Size>>,
        flag: Option<bool>,
    }

    const DOC: Document = Document {
        name: "doc",
        not_json: "doc is not JSON",
        not_object: "doc must be an object, not",
    };

    fn error(text: &str) -> String {
        parse_document::<Doc>(text, &DOC).unwrap_err().to_string()
    }

    #[test]
    fn documents_read_as_before() {
        let doc: Doc = parse_document(r#"{"limit": "64MiB", "flag": null}"#, &DOC).unwrap();
        assert_eq!(doc.limit, Some(Some(Size(64 << 20))));
        assert_eq!((doc.name, doc.flag), (None, None));
        let doc: Doc = parse_document(r#"{"limit": null, "name": "x"}"#, &DOC).unwrap();
        assert_eq!((doc.limit, doc.name.as_deref()), (Some(None), Some("x")));
        assert!(error("{").starts_with("doc is not JSON: "));
        assert_eq!(error("[]"), "doc must be an object, not []");
        assert_eq!(
            error(r#"{"flag": true, "limits": 1}"#),
            "doc: unknown key `limits` (expected one of: name, limit, flag)"
        );
        assert_eq!(
            error(r#"{"flag": "yes"}"#),
            "doc: flag is \"yes\"; give a boolean"
        );
        assert_eq!(
            error(r#"{"name": null}"#),
            "doc: name is null; give a string"
        );
        assert!(error(r#"{"limit": "64MB"}"#).starts_with("doc: limit: "));
        assert!(error(r#"{"limit": "64MB"}"#).contains("ambiguous"));
        assert_eq!(
            error(r#"{"limit": -1}"#),
            "doc: limit is -1; give a whole number of bytes or a string like \"64MiB\""
        );
    }

    #[test]
    fn a_key_given_twice_is_an_error_at_any_depth() {
        let twice = error(r#"{"flag": true, "flag": false}"#);
        assert!(
            twice.starts_with("doc: key `flag` is given twice"),
            "{twice}"
        );
        // Also when the second is what a last-wins parser would keep, and when equal.
        assert!(
            error(r#"{"name": "a", "flag": true, "name": "a"}"#).contains("`name` is given twice")
        );
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Outer {
            inner: Value,
        }
        let nested = parse_argument::<Outer>(r#"{"inner": [{"a": 1, "a": 2}]}"#, "arg")
            .unwrap_err()
            .to_string();
        assert!(
            nested.starts_with("arg: key `a` is given twice"),
            "{nested}"
        );
        parse_argument::<Outer>(r#"{"inner": [{"a": 1}, {"a": 2}]}"#, "arg").unwrap();
    }

    #[test]
    fn echoed_values_are_bounded() {
        let huge = "x".repeat(100_000);
        for text in [
            format!(r#"{{"name": {}}}"#, "1".repeat(100_000)),
            format!(r#"{{"flag": "{huge}"}}"#),
            format!(r#"{{"{huge}": 1}}"#),
            format!(r#"{{"limit": "{huge}"}}"#),
            format!("[{}]", vec!["1"; 50_000].join(",")),
            format!(r#"{{"flag": true, "{huge}": 1, "{huge}": 2}}"#),
            format!("{{\"flag\": \"{huge}"),
        ] {
            let message = error(&text);
            assert!(
                message.len() < 2000,
                "{} bytes: {}",
                message.len(),
                &message[..300]
            );
        }
        let message = error(&format!(r#"{{"flag": "{huge}"}}"#));
        assert!(message.contains("(100002 characters)"), "{message}");
        let unknown = choice("settings: policy", "policy", &huge, &[1], |_| "all").unwrap_err();
        assert!(
            unknown.to_string().len() < 400,
            "{}",
            unknown.to_string().len()
        );
        let message = parse_argument::<Doc>(&format!(r#"{{"name": 1, "x": "{huge}"}}"#), "p")
            .unwrap_err()
            .to_string();
        assert!(message.len() < 2000, "{}", message.len());
    }

    #[test]
    fn choices_are_exact() {
        let name = |v: i32| if v == 1 { "power-of-two" } else { "all" };
        assert_eq!(
            choice("s: policy", "policy", "all", &[1, 2], name).unwrap(),
            2
        );
        for wrong in ["ALL", "All", " all", "pow2"] {
            let e = choice("s: policy", "policy", wrong, &[1, 2], name)
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!("s: policy: unknown policy `{wrong}` (expected one of: power-of-two, all, written exactly so)")
            );
        }
    }
}
