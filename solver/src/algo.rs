//! Candidates: what a measurement times and a micro-batch runs. Either one of cuDNN's legacy
//! algorithms (or the CPU backend's own), by number, or an engine configuration of cuDNN's
//! graph (backend) API, by its stable name: engine id plus knob values, as cuDNN's frontend
//! spells it (`eng38_k2=8_k13=1_k14=4`).
//!
//! An [`Algo`] is `Copy`, so measurements and plans stay plain data: engine names are interned
//! once per process (a profile holds a few hundred distinct ones) and compared by content.

use crate::device::BackendKind;
use crate::problem::ConvOp;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, OnceLock};

/// A candidate kernel for one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algo {
    /// cuDNN's legacy algorithm number for the op (`cudnnConvolutionFwdAlgo_t`, ...), or the
    /// CPU backend's own number.
    Legacy(u32),
    /// A graph-API engine configuration.
    Engine(EngineName),
}

/// Which kind of candidate, for `--candidates` and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AlgoKind {
    Legacy,
    Engine,
}

impl AlgoKind {
    pub fn name(self) -> &'static str {
        match self {
            AlgoKind::Legacy => "legacy",
            AlgoKind::Engine => "engine",
        }
    }
}

impl fmt::Display for AlgoKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which candidates tuning measures: `--candidates legacy|engines|all`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CandidateSet {
    /// cuDNN's legacy algorithms (the CPU backend's algorithms on the CPU).
    Legacy,
    /// cuDNN's graph-API engine configurations only.
    Engines,
    /// Both; the solver takes the best of either at every micro-batch size.
    #[default]
    All,
}

impl CandidateSet {
    pub const ALL: [CandidateSet; 3] = [
        CandidateSet::Legacy,
        CandidateSet::Engines,
        CandidateSet::All,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CandidateSet::Legacy => "legacy",
            CandidateSet::Engines => "engines",
            CandidateSet::All => "all",
        }
    }

    /// The kinds of candidate in the set.
    pub fn kinds(self) -> &'static [AlgoKind] {
        match self {
            CandidateSet::Legacy => &[AlgoKind::Legacy],
            CandidateSet::Engines => &[AlgoKind::Engine],
            CandidateSet::All => &[AlgoKind::Legacy, AlgoKind::Engine],
        }
    }

    pub fn contains(self, kind: AlgoKind) -> bool {
        self.kinds().contains(&kind)
    }

    /// The set made of `kinds` (none: `None`).
    pub fn from_kinds(kinds: &[AlgoKind]) -> Option<CandidateSet> {
        match (
            kinds.contains(&AlgoKind::Legacy),
            kinds.contains(&AlgoKind::Engine),
        ) {
            (true, true) => Some(CandidateSet::All),
            (true, false) => Some(CandidateSet::Legacy),
            (false, true) => Some(CandidateSet::Engines),
            (false, false) => None,
        }
    }
}

impl fmt::Display for CandidateSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CandidateSet {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CandidateSet::ALL
            .into_iter()
            .find(|c| c.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown candidate set `{s}` (expected legacy, engines or all)"))
    }
}

impl AlgoKind {
    /// The cache's and reports' spelling: `legacy` or `engine`.
    pub fn parse(s: &str) -> Option<AlgoKind> {
        match s {
            "legacy" => Some(AlgoKind::Legacy),
            "engine" => Some(AlgoKind::Engine),
            _ => None,
        }
    }
}

impl Algo {
    pub fn kind(self) -> AlgoKind {
        match self {
            Algo::Legacy(_) => AlgoKind::Legacy,
            Algo::Engine(_) => AlgoKind::Engine,
        }
    }

    /// The legacy algorithm number, if this is one.
    pub fn legacy(self) -> Option<u32> {
        match self {
            Algo::Legacy(n) => Some(n),
            Algo::Engine(_) => None,
        }
    }

    /// The engine configuration, if this is one.
    pub fn engine(self) -> Option<EngineName> {
        match self {
            Algo::Legacy(_) => None,
            Algo::Engine(name) => Some(name),
        }
    }

    /// Whether `backend` has this candidate for `op`: a legacy number it names (the CPU's
    /// three algorithms, cuDNN's `CUDNN_CONVOLUTION_*_ALGO_COUNT` per op), or an engine
    /// configuration on cuDNN.
    pub fn belongs_to(self, backend: BackendKind, op: ConvOp) -> bool {
        match self {
            Algo::Legacy(n) => legacy_name(backend, op, n).is_some(),
            Algo::Engine(_) => backend == BackendKind::Cuda,
        }
    }
}

/// The CPU backend's algorithms by number (the same for every op).
const CPU_ALGOS: [&str; 3] = ["direct", "im2col-batched", "im2col-per-image"];
/// cuDNN's `cudnnConvolutionFwdAlgo_t`, without the `CUDNN_CONVOLUTION_FWD_ALGO_` prefix.
const CUDNN_FWD_ALGOS: [&str; 8] = [
    "IMPLICIT_GEMM",
    "IMPLICIT_PRECOMP_GEMM",
    "GEMM",
    "DIRECT",
    "FFT",
    "FFT_TILING",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
];
/// `cudnnConvolutionBwdDataAlgo_t`, without `CUDNN_CONVOLUTION_BWD_DATA_ALGO_`.
const CUDNN_BWD_DATA_ALGOS: [&str; 6] = [
    "ALGO_0",
    "ALGO_1",
    "FFT",
    "FFT_TILING",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
];
/// `cudnnConvolutionBwdFilterAlgo_t`, without `CUDNN_CONVOLUTION_BWD_FILTER_ALGO_`.
const CUDNN_BWD_FILTER_ALGOS: [&str; 7] = [
    "ALGO_0",
    "ALGO_1",
    "FFT",
    "ALGO_3",
    "WINOGRAD",
    "WINOGRAD_NONFUSED",
    "FFT_TILING",
];

/// The name people know legacy algorithm `number` of `op` by on `backend`: `direct`,
/// `im2col-batched`, `im2col-per-image` on the CPU; cuDNN's enum name without its prefix
/// (`IMPLICIT_PRECOMP_GEMM`, `ALGO_1`) on cuDNN. `None` for a number the backend does not have.
pub fn legacy_name(backend: BackendKind, op: ConvOp, number: u32) -> Option<&'static str> {
    let table: &[&str] = match (backend, op) {
        (BackendKind::Cpu, _) => &CPU_ALGOS,
        (BackendKind::Cuda, ConvOp::Forward) => &CUDNN_FWD_ALGOS,
        (BackendKind::Cuda, ConvOp::BackwardData) => &CUDNN_BWD_DATA_ALGOS,
        (BackendKind::Cuda, ConvOp::BackwardFilter) => &CUDNN_BWD_FILTER_ALGOS,
    };
    table.get(usize::try_from(number).ok()?).copied()
}

/// How candidates are named for people: by the backend that measured them. Plans, profiles and
/// the cache keep numbers (programs read them); tables, reports and split strings use names.
/// Without a known backend a legacy algorithm reads `algo<N>`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AlgoNames {
    pub backend: Option<BackendKind>,
}

impl AlgoNames {
    pub fn new(backend: BackendKind) -> Self {
        AlgoNames {
            backend: Some(backend),
        }
    }

    /// `IMPLICIT_PRECOMP_GEMM`, `im2col-batched`, the engine configuration's name, or
    /// `algo<N>` for a number the backend does not name.
    pub fn name(self, op: ConvOp, algo: Algo) -> Cow<'static, str> {
        match algo {
            Algo::Legacy(n) => match self.backend.and_then(|b| legacy_name(b, op, n)) {
                Some(name) => Cow::Borrowed(name),
                None => Cow::Owned(format!("algo{n}")),
            },
            Algo::Engine(name) => Cow::Borrowed(name.as_str()),
        }
    }
}

impl From<u32> for Algo {
    fn from(n: u32) -> Self {
        Algo::Legacy(n)
    }
}

/// `1` for a legacy algorithm, the name for an engine configuration.
impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algo::Legacy(n) => write!(f, "{n}"),
            Algo::Engine(name) => f.write_str(name.as_str()),
        }
    }
}

/// Serialised as a JSON number (legacy) or string (engine), so plans and reports read
/// `"algo": 1` or `"algo": "eng38_k2=8"`.
impl Serialize for Algo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Algo::Legacy(n) => serializer.serialize_u32(*n),
            Algo::Engine(name) => serializer.serialize_str(name.as_str()),
        }
    }
}

impl<'de> Deserialize<'de> for Algo {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u32),
            Name(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(n) => Ok(Algo::Legacy(n)),
            Raw::Name(name) => EngineName::new(&name)
                .map(Algo::Engine)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// The name of a graph-API engine configuration: `eng<id>` followed by `_k<type>=<value>` per
/// knob, knobs sorted by type (the cuDNN frontend's plan names; the grammar is
/// [`EngineConfig`]'s, with the knobs already in canonical order). Interned: copying is free and
/// equality, hashing and order are by content.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineName(&'static str);

/// Why a string is not an engine configuration name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{name}` is not an engine configuration name ({reason}; expected e.g. `eng38_k2=8_k13=1`)"
)]
pub struct EngineNameError {
    pub name: String,
    pub reason: String,
}

impl EngineName {
    /// Checks the syntax and interns the name.
    pub fn new(name: &str) -> Result<Self, EngineNameError> {
        let error = |reason| EngineNameError {
            name: name.chars().take(200).collect(),
            reason,
        };
        let (_, knobs) = parse_engine_name(name).map_err(error)?;
        if knobs.windows(2).any(|pair| pair[0].0 >= pair[1].0) {
            return Err(error("knobs are not sorted by type".to_string()));
        }
        Ok(EngineName(intern(name)))
    }

    pub fn as_str(self) -> &'static str {
        self.0
    }

    /// The engine id (`38` in `eng38_k2=8`).
    pub fn engine_id(self) -> i64 {
        parse_engine_name(self.0).map_or(-1, |(engine, _)| engine)
    }

    /// `(knob type, value)` pairs, sorted by type.
    pub fn knobs(self) -> Vec<(i64, i64)> {
        parse_engine_name(self.0)
            .map(|(_, knobs)| knobs)
            .unwrap_or_default()
    }
}

impl fmt::Debug for EngineName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EngineName({})", self.0)
    }
}

impl fmt::Display for EngineName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::str::FromStr for EngineName {
    type Err = EngineNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EngineName::new(s)
    }
}

/// Returns the one `'static` copy of `name`. Each distinct name is leaked once: a process
/// sees at most a few thousand engine configurations.
fn intern(name: &str) -> &'static str {
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(existing) = names.get(name) {
        return existing;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(leaked);
    leaked
}

// ---------------------------------------------------------------------------------------------
// Engine configurations and the grammar of their names

/// One engine configuration of cuDNN's graph (backend) API, identified the way NVIDIA's cuDNN
/// frontend names execution plans, e.g. `eng38_k2=8_k13=1_k14=4_k18=0`.
///
/// A configuration is an engine's global index (`CUDNN_ATTR_ENGINE_GLOBAL_INDEX`) plus a value
/// for some of its knobs (`CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE` = value); knobs left out take the
/// engine's defaults, so `eng0` (no knobs) is a configuration too. The name is the candidate's
/// stable identity between the profiler, the tuning cache and the plan executor: it is enough
/// to rebuild the configuration on the same cuDNN version (the version belongs in the cache
/// key, because engine numbering and knobs change between releases). The cuDNN wall turns a
/// config into descriptors.
///
/// # Format
///
/// `eng<engine>` followed by `_k<knob type>=<value>` per knob, knobs in ascending knob-type
/// order: exactly what the frontend prints (and what `h100-engines-3layers.json` records).
/// Engine ids and knob types are non-negative decimal integers, values may be negative
/// (`k12=-1`); no leading zeros, no `+`, no spaces. Parsing accepts knobs in any order and
/// sorts them, so the printed form of a parsed name is canonical. This is the one grammar of
/// engine names: [`EngineName`] accepts the names it parses whose knobs are already sorted.
///
/// Sorted by engine, then knobs: a stable candidate order.
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
pub struct EngineConfigError {
    /// The text (or, for [`EngineConfig::new`], the configuration as far as it is printable).
    pub name: String,
    pub reason: String,
}

impl EngineConfig {
    /// The configuration a candidate's name stands for.
    pub fn from_name(name: EngineName) -> Result<Self, EngineConfigError> {
        name.as_str().parse()
    }

    /// The candidate's name (interned; what profiles, plans and the cache hold).
    pub fn name(&self) -> EngineName {
        // The printed form is canonical and always parses.
        EngineName::new(&self.to_string()).expect("an EngineConfig prints a valid engine name")
    }

    /// Engine `engine` with `knobs` as (knob type, value) pairs in any order. Errors when the
    /// engine id or a knob type is negative, or a knob type appears twice.
    pub fn new(
        engine: i64,
        knobs: impl IntoIterator<Item = (i64, i64)>,
    ) -> Result<Self, EngineConfigError> {
        let mut knobs: Vec<(i64, i64)> = knobs.into_iter().collect();
        knobs.sort_unstable();
        let error = |reason: String| {
            let mut name = String::new();
            // (Writing to a String cannot fail.)
            let _ = write_engine_name(&mut name, engine, &knobs);
            EngineConfigError { name, reason }
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
    pub fn default_knobs(engine: i64) -> Result<Self, EngineConfigError> {
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
        write_engine_name(f, self.engine, &self.knobs)
    }
}

impl std::str::FromStr for EngineConfig {
    type Err = EngineConfigError;

    fn from_str(name: &str) -> Result<Self, EngineConfigError> {
        let error = |reason: String| EngineConfigError {
            name: name.to_string(),
            reason,
        };
        let (engine, knobs) = parse_engine_name(name).map_err(error)?;
        EngineConfig::new(engine, knobs).map_err(|e| error(e.reason))
    }
}

impl From<EngineConfig> for String {
    fn from(config: EngineConfig) -> String {
        config.to_string()
    }
}

impl TryFrom<String> for EngineConfig {
    type Error = EngineConfigError;

    fn try_from(name: String) -> Result<Self, EngineConfigError> {
        name.parse()
    }
}

/// Prints an engine configuration's name: `eng<engine>`, then `_k<type>=<value>` per knob in
/// the order given.
fn write_engine_name(out: &mut impl fmt::Write, engine: i64, knobs: &[(i64, i64)]) -> fmt::Result {
    write!(out, "eng{engine}")?;
    for (knob, value) in knobs {
        write!(out, "_k{knob}={value}")?;
    }
    Ok(())
}

/// Reads an engine configuration's name (see [`EngineConfig`]'s format) into the engine id and
/// the knobs in the order written; the error is the reason it is not one.
fn parse_engine_name(name: &str) -> Result<(i64, Vec<(i64, i64)>), String> {
    let rest = name
        .strip_prefix("eng")
        .ok_or_else(|| "it does not start with `eng`".to_string())?;
    let mut parts = rest.split('_');
    let engine_text = parts.next().unwrap_or_default();
    let engine =
        parse_decimal(engine_text, false).map_err(|reason| format!("engine id: {reason}"))?;
    let mut knobs = Vec::new();
    for part in parts {
        let knob = part
            .strip_prefix('k')
            .ok_or_else(|| format!("knob `{part}` does not start with `k`"))?;
        let (knob_type, value) = knob
            .split_once('=')
            .ok_or_else(|| format!("knob `{part}` has no `=`"))?;
        let knob_type = parse_decimal(knob_type, false)
            .map_err(|reason| format!("knob `{part}`: type {reason}"))?;
        let value = parse_decimal(value, true)
            .map_err(|reason| format!("knob `{part}`: value {reason}"))?;
        knobs.push((knob_type, value));
    }
    Ok((engine, knobs))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names_parse_and_intern() {
        let a = EngineName::new("eng38_k2=8_k13=1_k14=4_k18=0").unwrap();
        let b: EngineName = "eng38_k2=8_k13=1_k14=4_k18=0".parse().unwrap();
        assert_eq!(a, b);
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        assert_eq!(a.engine_id(), 38);
        assert_eq!(a.knobs(), vec![(2, 8), (13, 1), (14, 4), (18, 0)]);
        assert_eq!(EngineName::new("eng0").unwrap().knobs(), vec![]);
        assert_eq!(
            EngineName::new("eng1_k3=-1").unwrap().knobs(),
            vec![(3, -1)]
        );
        for bad in [
            "",
            "eng",
            "38",
            "engx",
            "eng3_",
            "eng3_k2",
            "eng3_k2=",
            "eng3_kx=1",
            "eng3_k2=a",
            "eng3_k13=1_k2=8",
            "eng3_k2=1_k2=1",
        ] {
            assert!(EngineName::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn algos_serialise_as_number_or_name() {
        let legacy = Algo::Legacy(6);
        let engine = Algo::Engine(EngineName::new("eng67_k2=5").unwrap());
        assert_eq!(serde_json::to_string(&legacy).unwrap(), "6");
        assert_eq!(serde_json::to_string(&engine).unwrap(), "\"eng67_k2=5\"");
        assert_eq!(serde_json::from_str::<Algo>("6").unwrap(), legacy);
        assert_eq!(
            serde_json::from_str::<Algo>("\"eng67_k2=5\"").unwrap(),
            engine
        );
        assert!(serde_json::from_str::<Algo>("\"nope\"").is_err());
        assert!(serde_json::from_str::<Algo>("-1").is_err());
        assert_eq!(engine.kind(), AlgoKind::Engine);
        assert_eq!(AlgoNames::default().name(ConvOp::Forward, legacy), "algo6");
        assert_eq!(engine.to_string(), "eng67_k2=5");
        assert!(legacy < engine);
    }

    #[test]
    fn names_by_backend_and_op() {
        let cuda = AlgoNames::new(BackendKind::Cuda);
        let cpu = AlgoNames::new(BackendKind::Cpu);
        let name = |names: AlgoNames, op, n| names.name(op, Algo::Legacy(n)).into_owned();
        assert_eq!(name(cuda, ConvOp::Forward, 1), "IMPLICIT_PRECOMP_GEMM");
        assert_eq!(name(cuda, ConvOp::Forward, 7), "WINOGRAD_NONFUSED");
        assert_eq!(name(cuda, ConvOp::BackwardData, 1), "ALGO_1");
        assert_eq!(name(cuda, ConvOp::BackwardFilter, 3), "ALGO_3");
        assert_eq!(name(cuda, ConvOp::BackwardFilter, 6), "FFT_TILING");
        assert_eq!(name(cpu, ConvOp::BackwardData, 0), "direct");
        assert_eq!(name(cpu, ConvOp::Forward, 1), "im2col-batched");
        assert_eq!(name(cpu, ConvOp::BackwardFilter, 2), "im2col-per-image");
        // Past the backend's last algorithm, or with no backend known: the number.
        assert_eq!(name(cpu, ConvOp::Forward, 3), "algo3");
        assert_eq!(name(cuda, ConvOp::BackwardData, 6), "algo6");
        assert_eq!(name(AlgoNames::default(), ConvOp::Forward, 1), "algo1");
        let engine = Algo::Engine(EngineName::new("eng38_k2=8").unwrap());
        assert_eq!(cuda.name(ConvOp::Forward, engine), "eng38_k2=8");
        // Membership follows the same tables.
        assert!(Algo::Legacy(7).belongs_to(BackendKind::Cuda, ConvOp::Forward));
        assert!(!Algo::Legacy(7).belongs_to(BackendKind::Cuda, ConvOp::BackwardFilter));
        assert!(Algo::Legacy(6).belongs_to(BackendKind::Cuda, ConvOp::BackwardFilter));
        assert!(!Algo::Legacy(3).belongs_to(BackendKind::Cpu, ConvOp::Forward));
        assert!(!Algo::Legacy(999).belongs_to(BackendKind::Cuda, ConvOp::Forward));
        assert!(engine.belongs_to(BackendKind::Cuda, ConvOp::Forward));
        assert!(!engine.belongs_to(BackendKind::Cpu, ConvOp::Forward));
    }

    #[test]
    fn candidate_sets() {
        for set in CandidateSet::ALL {
            assert_eq!(set.name().parse::<CandidateSet>().unwrap(), set);
            assert_eq!(CandidateSet::from_kinds(set.kinds()), Some(set));
        }
        assert!("engine".parse::<CandidateSet>().is_err());
        assert!(CandidateSet::All.contains(AlgoKind::Engine));
        assert!(!CandidateSet::Legacy.contains(AlgoKind::Engine));
        assert_eq!(CandidateSet::from_kinds(&[]), None);
        assert_eq!(AlgoKind::parse("engine"), Some(AlgoKind::Engine));
    }

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
