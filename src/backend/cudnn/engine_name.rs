//! [`EngineConfig`]: one engine configuration of cuDNN's graph (backend) API, identified the
//! way NVIDIA's cuDNN frontend names execution plans, e.g. `eng38_k2=8_k13=1_k14=4_k18=0`.
//!
//! A configuration is an engine's global index (`CUDNN_ATTR_ENGINE_GLOBAL_INDEX`) plus a value
//! for some of its knobs (`CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE` = value); knobs left out take the
//! engine's defaults, so `eng0` (no knobs) is a configuration too. The name is the candidate's
//! stable identity between the profiler, the tuning cache and the plan executor: it is enough
//! to rebuild the configuration on the same cuDNN version (the version belongs in the cache
//! key, because engine numbering and knobs change between releases).
//!
//! Pure: no cuDNN. The FFI wall (`ffi/graph.rs`) turns a config into descriptors.
//!
//! # Format
//!
//! `eng<engine>` followed by `_k<knob type>=<value>` per knob, knobs in ascending knob-type
//! order: exactly what the frontend prints (and what `h100-engines-3layers.json` records).
//! Engine ids and knob types are non-negative decimal integers, values may be negative
//! (`k12=-1`); no leading zeros, no `+`, no spaces. Parsing accepts knobs in any order and
//! sorts them, so the printed form of a parsed name is canonical.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// An engine global index plus knob choices, sorted by knob type (at most one value per type).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct EngineConfig {
    engine: i64,
    knobs: Vec<(i64, i64)>,
}

/// Why a string is not an engine configuration name, or knob choices do not make one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid engine configuration `{name}`: {reason} (expected `eng<id>` then `_k<type>=<value>` \
     per knob, e.g. `eng38_k2=8_k13=1` or `eng0`)"
)]
pub struct EngineNameError {
    /// The text (or, for [`EngineConfig::new`], the configuration as far as it is printable).
    pub name: String,
    pub reason: String,
}

impl EngineConfig {
    /// The configuration a candidate's name stands for.
    pub fn from_name(name: crate::solver::EngineName) -> Result<Self, EngineNameError> {
        name.as_str().parse()
    }

    /// The candidate's name (interned; what profiles, plans and the cache hold).
    pub fn name(&self) -> crate::solver::EngineName {
        // The printed form is canonical and always parses.
        crate::solver::EngineName::new(&self.to_string())
            .expect("an EngineConfig prints a valid engine name")
    }

    /// Engine `engine` with `knobs` as (knob type, value) pairs in any order. Errors when the
    /// engine id or a knob type is negative, or a knob type appears twice.
    pub fn new(
        engine: i64,
        knobs: impl IntoIterator<Item = (i64, i64)>,
    ) -> Result<Self, EngineNameError> {
        let mut knobs: Vec<(i64, i64)> = knobs.into_iter().collect();
        knobs.sort_unstable();
        let printable = || {
            let mut name = format!("eng{engine}");
            for (knob, value) in &knobs {
                name += &format!("_k{knob}={value}");
            }
            name
        };
        let error = |reason: String| EngineNameError {
            name: printable(),
            reason,
        };
        if engine < 0 {
            return Err(error(format!("engine id {engine} is negative")));
        }
        if let Some((knob, _)) = knobs.iter().find(|(knob, _)| *knob < 0) {
            return Err(error(format!("knob type {knob} is negative")));
        }
        if let Some(pair) = knobs.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(error(format!(
                "knob type {} has two values ({} and {})",
                pair[0].0, pair[0].1, pair[1].1
            )));
        }
        Ok(EngineConfig { engine, knobs })
    }

    /// The engine with its default knobs (`eng<engine>`).
    pub fn default_knobs(engine: i64) -> Result<Self, EngineNameError> {
        Self::new(engine, [])
    }

    /// The engine's global index (`CUDNN_ATTR_ENGINE_GLOBAL_INDEX`).
    pub fn engine(&self) -> i64 {
        self.engine
    }

    /// The knob choices as (knob type, value), ascending by knob type.
    pub fn knobs(&self) -> &[(i64, i64)] {
        &self.knobs
    }

    /// The value chosen for `knob_type`, if any.
    pub fn knob(&self, knob_type: i64) -> Option<i64> {
        self.knobs
            .binary_search_by_key(&knob_type, |&(knob, _)| knob)
            .ok()
            .map(|i| self.knobs[i].1)
    }
}

impl fmt::Display for EngineConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "eng{}", self.engine)?;
        for (knob, value) in &self.knobs {
            write!(f, "_k{knob}={value}")?;
        }
        Ok(())
    }
}

/// A canonical decimal: digits only (a `-` first where `signed`), no leading zeros, no `-0`.
fn parse_decimal(text: &str, signed: bool) -> Result<i64, String> {
    let digits = match text.strip_prefix('-') {
        Some(rest) if signed => rest,
        Some(_) => return Err(format!("`{text}` must not be negative")),
        None => text,
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("`{text}` is not a decimal integer"));
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(format!("`{text}` has a leading zero"));
    }
    if digits == "0" && text.starts_with('-') {
        return Err("`-0` is not canonical (write 0)".to_string());
    }
    text.parse::<i64>()
        .map_err(|_| format!("`{text}` does not fit a 64-bit integer"))
}

impl FromStr for EngineConfig {
    type Err = EngineNameError;

    fn from_str(name: &str) -> Result<Self, EngineNameError> {
        let error = |reason: String| EngineNameError {
            name: name.to_string(),
            reason,
        };
        let rest = name
            .strip_prefix("eng")
            .ok_or_else(|| error("it does not start with `eng`".into()))?;
        let mut parts = rest.split('_');
        let engine_text = parts.next().unwrap_or_default();
        let engine = parse_decimal(engine_text, false)
            .map_err(|reason| error(format!("engine id: {reason}")))?;
        let mut knobs = Vec::new();
        for part in parts {
            let knob = part
                .strip_prefix('k')
                .ok_or_else(|| error(format!("knob `{part}` does not start with `k`")))?;
            let (knob_type, value) = knob
                .split_once('=')
                .ok_or_else(|| error(format!("knob `{part}` has no `=`")))?;
            let knob_type = parse_decimal(knob_type, false)
                .map_err(|reason| error(format!("knob `{part}`: type {reason}")))?;
            let value = parse_decimal(value, true)
                .map_err(|reason| error(format!("knob `{part}`: value {reason}")))?;
            knobs.push((knob_type, value));
        }
        EngineConfig::new(engine, knobs).map_err(|e| error(e.reason))
    }
}

impl From<EngineConfig> for String {
    fn from(config: EngineConfig) -> String {
        config.to_string()
    }
}

impl TryFrom<String> for EngineConfig {
    type Error = EngineNameError;

    fn try_from(name: String) -> Result<Self, EngineNameError> {
        name.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            "eng0",
            "eng78",
            "eng38_k2=8_k13=1_k14=4_k18=0_k22=0_k23=0",
            "eng41_k2=8_k12=-1_k13=1_k14=4_k15=0_k17=20_k18=0_k22=0_k23=0",
            "eng67_k2=5_k13=0_k18=0_k25=1_k27=2_k28=1",
        ] {
            let config: EngineConfig = name.parse().unwrap();
            assert_eq!(config.to_string(), name);
            let back: EngineConfig = config.to_string().parse().unwrap();
            assert_eq!(back, config);
        }
        let config: EngineConfig = "eng41_k2=8_k12=-1_k13=1".parse().unwrap();
        assert_eq!(config.engine(), 41);
        assert_eq!(config.knobs(), &[(2, 8), (12, -1), (13, 1)]);
        assert_eq!(config.knob(12), Some(-1));
        assert_eq!(config.knob(3), None);
        let bare: EngineConfig = "eng0".parse().unwrap();
        assert_eq!(bare, EngineConfig::default_knobs(0).unwrap());
        assert!(bare.knobs().is_empty());
    }

    #[test]
    fn every_name_in_the_shipped_probe_round_trips() {
        // Plan names as the cuDNN frontend printed them on an H100 (cuDNN 9.19), a sample of the
        // shapes in `h100-engines-3layers.json`.
        let names = [
            "eng10_k2=5_k12=-1_k13=1_k14=3_k15=1_k17=8_k18=1_k23=0",
            "eng30_k2=5_k12=-1_k13=1_k14=3_k15=0_k17=5_k18=1_k23=0",
            "eng33_k0=10_k2=1_k5=4_k14=2",
            "eng37_k2=14_k6=1_k13=1_k14=0_k22=3",
            "eng1_k2=3_k3=0",
            "eng18_k11=0",
            "eng1",
        ];
        for name in names {
            assert_eq!(name.parse::<EngineConfig>().unwrap().to_string(), name);
        }
    }

    #[test]
    fn construction_sorts_and_rejects_duplicates() {
        let config = EngineConfig::new(38, [(14, 4), (2, 8), (13, 1)]).unwrap();
        assert_eq!(config.to_string(), "eng38_k2=8_k13=1_k14=4");
        // Parsing normalises the knob order.
        let unsorted: EngineConfig = "eng38_k14=4_k2=8_k13=1".parse().unwrap();
        assert_eq!(unsorted, config);
        let e = EngineConfig::new(3, [(2, 1), (2, 4)]).unwrap_err();
        assert!(e.reason.contains("knob type 2 has two values"), "{e}");
        assert!(EngineConfig::new(-1, []).is_err());
        assert!(EngineConfig::new(1, [(-2, 0)]).is_err());
        // Ordering is by engine, then knobs: stable candidate order.
        let mut configs: Vec<EngineConfig> = ["eng2", "eng10", "eng2_k1=0", "eng1_k5=3"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        configs.sort();
        let sorted: Vec<String> = configs.iter().map(|c| c.to_string()).collect();
        assert_eq!(sorted, ["eng1_k5=3", "eng2", "eng2_k1=0", "eng10"]);
    }

    #[test]
    fn malformed_names_are_clear_errors() {
        let cases = [
            ("", "does not start with `eng`"),
            ("plan38", "does not start with `eng`"),
            ("eng", "engine id: `` is not a decimal integer"),
            ("eng-1", "engine id: `-1` must not be negative"),
            ("eng038", "leading zero"),
            ("eng38_", "knob `` does not start with `k`"),
            ("eng38_k2", "knob `k2` has no `=`"),
            ("eng38_k2=", "value `` is not a decimal integer"),
            ("eng38_k=3", "type `` is not a decimal integer"),
            ("eng38_k2=x", "value `x` is not a decimal integer"),
            ("eng38_k2=-0", "`-0` is not canonical"),
            ("eng38_k2=08", "leading zero"),
            ("eng38_k2=+8", "value `+8` is not a decimal integer"),
            ("eng38_k2=1_k2=3", "knob type 2 has two values"),
            ("eng38 _k2=1", "engine id: `38 ` is not a decimal integer"),
            ("eng38_k2=1=2", "value `1=2` is not a decimal integer"),
            ("eng99999999999999999999", "does not fit a 64-bit integer"),
            ("ENG38", "does not start with `eng`"),
        ];
        for (name, expected) in cases {
            let e = name.parse::<EngineConfig>().unwrap_err();
            let message = e.to_string();
            assert!(
                message.contains(expected),
                "{name:?}: {message:?} lacks {expected:?}"
            );
            assert!(message.contains(&format!("`{name}`")), "{message}");
            assert!(message.contains("eng38_k2=8_k13=1"), "{message}");
        }
    }

    #[test]
    fn serde_uses_the_name() {
        let config: EngineConfig = "eng38_k2=8_k13=1".parse().unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(json, "\"eng38_k2=8_k13=1\"");
        assert_eq!(serde_json::from_str::<EngineConfig>(&json).unwrap(), config);
        assert!(serde_json::from_str::<EngineConfig>("\"eng38_k2\"").is_err());
    }
}
