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
/// knob, knobs sorted by type (the cuDNN frontend's plan names). Interned: copying is free and
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
    pub reason: &'static str,
}

impl EngineName {
    /// Checks the syntax and interns the name.
    pub fn new(name: &str) -> Result<Self, EngineNameError> {
        let error = |reason| EngineNameError {
            name: name.chars().take(200).collect(),
            reason,
        };
        let mut parts = name.split('_');
        let head = parts.next().unwrap_or_default();
        let id = head
            .strip_prefix("eng")
            .ok_or_else(|| error("no `eng` prefix"))?;
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(error("the engine id is not a number"));
        }
        let mut last_type: Option<u64> = None;
        for knob in parts {
            let (ty, value) = knob
                .strip_prefix('k')
                .and_then(|k| k.split_once('='))
                .ok_or_else(|| error("a knob is not `k<type>=<value>`"))?;
            let ty: u64 = ty
                .parse()
                .map_err(|_| error("a knob type is not a number"))?;
            let value = value.strip_prefix('-').unwrap_or(value);
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(error("a knob value is not an integer"));
            }
            if last_type.is_some_and(|last| last >= ty) {
                return Err(error("knobs are not sorted by type"));
            }
            last_type = Some(ty);
        }
        Ok(EngineName(intern(name)))
    }

    pub fn as_str(self) -> &'static str {
        self.0
    }

    /// The engine id (`38` in `eng38_k2=8`).
    pub fn engine_id(self) -> i64 {
        let head = self.0.split('_').next().unwrap_or_default();
        head[3..].parse().unwrap_or(-1)
    }

    /// `(knob type, value)` pairs, sorted by type.
    pub fn knobs(self) -> Vec<(i64, i64)> {
        self.0
            .split('_')
            .skip(1)
            .filter_map(|knob| {
                let (ty, value) = knob[1..].split_once('=')?;
                Some((ty.parse().ok()?, value.parse().ok()?))
            })
            .collect()
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
}
