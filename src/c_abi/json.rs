//! The C ABI's JSON settings documents (a tuner's options and settings, the solver's options)
//! read through serde: each document is a `#[serde(deny_unknown_fields)]` struct, and serde's
//! messages are put in the C ABI's words, naming the document and the key.

use super::error::{invalid, FfiError};
use crate::solver::units::parse_size;
use serde::de::{DeserializeOwned, Deserializer, Visitor};
use serde::Deserialize;
use serde_json::Value;

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
    let value: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("{}: {e}", document.not_json)))?;
    let Value::Object(fields) = &value else {
        return Err(invalid(format!("{} {value}", document.not_object)));
    };
    T::deserialize(&value).map_err(|e| {
        let message = e.to_string();
        if let Some((key, expected)) = unknown_key(&message) {
            return invalid(format!(
                "{}: unknown key `{key}` (expected one of: {expected})",
                document.name
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
                        document.name, fields[key]
                    )),
                    None => invalid(format!("{}: {key}: {message}", document.name)),
                }
            }
            None => invalid(format!("{}: {message}", document.name)),
        }
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
}
