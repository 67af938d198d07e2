//! Measurements: for one tuning problem (a layer's [`ConvProblem`] and a [`ConvOp`]), the time
//! and workspace of every algorithm at every micro-batch size that was measured.
//!
//! A [`Profile`] is what the profiler produces, the cache stores and the solver reads. It holds
//! raw measurements, never decisions, so that any workspace limit can be solved from it later.
//! [`OpProfile::validate`] is checked by every solver entry point, so a hand-built profile is
//! held to the same rules as one read from a file.

use crate::algo::{Algo, AlgoNames, CandidateSet};
use crate::device::{BackendKind, DeviceFingerprint};
use crate::indexing::IndexLimit;
use crate::problem::{ConvOp, ConvProblem, DType, Layout, ShapeError};
use crate::spatial::SplitDim;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;

/// One algorithm timed at one micro-batch size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// Micro-batch size, `1..=problem.n`; for a spatial entry ([`OpProfile::split`]) a chunk's
    /// rows along the split axis, `1..=` the op's extent there ([`SplitDim::extent`]).
    pub micro: i64,
    /// The candidate: cuDNN's legacy algorithm number for the op (or the CPU backend's own
    /// number), or a graph-API engine configuration.
    pub algo: Algo,
    /// Time of one call at this micro-batch size, in milliseconds.
    pub time_ms: f64,
    /// Workspace the call needs, in bytes.
    pub workspace_bytes: u64,
    /// How its output compared with the reference candidate's on the same operands, when it
    /// was compared (absent: measured without verification, or no reference output there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Verification>,
}

impl Measurement {
    /// A measurement that was not compared with a reference.
    pub fn new(micro: i64, algo: Algo, time_ms: f64, workspace_bytes: u64) -> Measurement {
        Measurement {
            micro,
            algo,
            time_ms,
            workspace_bytes,
            verification: None,
        }
    }

    /// Whether its output was compared with the reference's and found over its tolerance.
    pub fn is_rejected(&self) -> bool {
        self.verification.is_some_and(|v| !v.passed())
    }
}

/// How one candidate's output compared with the reference candidate's output on the same
/// operands at one size: the largest absolute difference relative to the largest magnitude of
/// the reference, against the tolerance of the candidate's arithmetic (its precision and the
/// reduction length). A candidate over its tolerance computes wrong numbers: it is rejected,
/// kept apart from the measurements a solver reads ([`OpProfile::rejected`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    /// `max |out - reference| / max |reference|`; infinite when the output is not finite
    /// where the reference is (NaN, infinity). Written as JSON `null` then, as JSON has no
    /// infinity.
    #[serde(with = "non_finite_as_null")]
    pub max_rel_error: f64,
    /// The largest error a correct candidate of this arithmetic may have here.
    pub tolerance: f64,
}

impl Verification {
    /// Within the tolerance (an infinite or NaN error never is).
    pub fn passed(&self) -> bool {
        self.max_rel_error <= self.tolerance
    }

    /// A tolerance that is positive and finite and an error that is not negative (infinite
    /// allowed): what a comparison can produce.
    pub fn is_well_formed(&self) -> bool {
        self.tolerance.is_finite()
            && self.tolerance > 0.0
            && !self.max_rel_error.is_nan()
            && self.max_rel_error >= 0.0
    }
}

/// `max_rel_error` in JSON: a number, or `null` for an infinite error (JSON has no infinity).
mod non_finite_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        if value.is_finite() {
            serializer.serialize_f64(*value)
        } else {
            serializer.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::INFINITY))
    }
}

/// Whether the candidates measured at one size were verified (their outputs compared with the
/// reference candidate's), as the cache records it per size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SizeVerification {
    /// Measured with verification: every candidate that could be compared carries its
    /// [`Verification`], and those over their tolerance are rejected.
    Verified,
    /// Measured without verification (turned off, or before mucudnn verified): a tune that
    /// verifies measures the size again.
    #[default]
    Unverified,
    /// Imported (`cache import`) from a profile that does not carry every record's error: used
    /// as it is, reported unverified; measuring it again is the user's choice (`cache clear`).
    Imported,
}

impl SizeVerification {
    pub const ALL: [SizeVerification; 3] = [
        SizeVerification::Verified,
        SizeVerification::Unverified,
        SizeVerification::Imported,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SizeVerification::Verified => "verified",
            SizeVerification::Unverified => "unverified",
            SizeVerification::Imported => "imported",
        }
    }

    /// Whether a tune that verifies must measure a size in this state again.
    pub fn needs_measuring(self, verify: bool) -> bool {
        verify && self == SizeVerification::Unverified
    }

    /// The state of a size measured in two parts (a smaller limit's run, then the candidates
    /// it skipped): verified only when both were.
    pub fn and(self, other: SizeVerification) -> SizeVerification {
        match (self, other) {
            (SizeVerification::Verified, SizeVerification::Verified) => SizeVerification::Verified,
            (SizeVerification::Unverified, _) | (_, SizeVerification::Unverified) => {
                SizeVerification::Unverified
            }
            _ => SizeVerification::Imported,
        }
    }
}

impl fmt::Display for SizeVerification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SizeVerification {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SizeVerification::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown verification state `{s}`"))
    }
}

/// What one size of one kind holds once measured: the candidates timed (verified or not), those
/// skipped for their workspace, those rejected for wrong results, and whether the size was
/// verified. What a backend returns, the cache stores and returns, and a task shares.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Timed candidates a plan may use (none over its tolerance).
    pub measurements: Vec<Measurement>,
    /// Candidates not timed because their workspace exceeded the measuring limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
    /// Timed candidates whose output was over their tolerance: never offered to a solver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<Measurement>,
    #[serde(default)]
    pub verification: SizeVerification,
}

/// A candidate that was not timed at one micro-batch size because its workspace exceeded the
/// limit measuring ran under (no plan under that limit could use it there). Its workspace is
/// known, its time is not: it is never a [`Measurement`], and the solver never reads it. A
/// later tune under a larger limit times exactly these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub micro: i64,
    pub algo: Algo,
    /// Workspace the call would need, in bytes (above the measuring limit).
    pub workspace_bytes: u64,
}

/// All measurements of one tuning problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpProfile {
    /// Layer name, e.g. `alexnet.conv2`.
    pub layer: String,
    /// The convolution at the full mini-batch size (`problem.n`).
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// What the sizes split: micro-batches of samples, or chunks of rows along the op's
    /// output's outermost spatial axis. Absent in data written before spatial splits: batch.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub measurements: Vec<Measurement>,
    /// Candidates not timed because their workspace exceeded the measuring limit: known
    /// workspace, no time. Only a record of what is left to measure; solving ignores it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
    /// Candidates timed whose output was over their tolerance against the reference
    /// ([`Measurement::is_rejected`]): kept with their time and error for reports, never read
    /// by a solver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<Measurement>,
}

/// A whole profile: the measurements of every tuning problem, plus where they were taken.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Device name, e.g. `NVIDIA H100 80GB HBM3` or `cpu`.
    pub device: String,
    /// cuDNN version as cuDNN reports it (e.g. 91900), when measured with cuDNN.
    pub cudnn_version: Option<u64>,
    /// Free text: math mode used.
    pub math: Option<String>,
    /// Free text: how times were taken.
    pub timing: Option<String>,
    /// The full device fingerprint, when known (written as the extension key `fingerprint`).
    pub fingerprint: Option<crate::device::DeviceFingerprint>,
    pub entries: Vec<OpProfile>,
}

/// Which micro-batch sizes a plan may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Only the whole mini-batch: the best single algorithm.
    Undivided,
    /// 1, 2, 4, ... and the mini-batch size itself.
    #[default]
    PowerOfTwo,
    /// Every size 1..=N.
    All,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Undivided, Policy::PowerOfTwo, Policy::All];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Undivided => "undivided",
            Policy::PowerOfTwo => "power-of-two",
            Policy::All => "all",
        }
    }

    /// Whether a micro-batch of `size` is allowed for a mini-batch of `n`.
    pub fn allows(self, size: i64, n: i64) -> bool {
        match self {
            Policy::Undivided => size == n,
            Policy::PowerOfTwo => {
                size == n || (size > 0 && size < n && (size as u64).is_power_of_two())
            }
            Policy::All => size >= 1 && size <= n,
        }
    }

    /// The sizes the policy allows for a mini-batch of `n`, ascending.
    pub fn sizes(self, n: i64) -> Vec<i64> {
        match self {
            Policy::Undivided => vec![n],
            Policy::PowerOfTwo => {
                let mut sizes: Vec<i64> =
                    (0..63).map(|e| 1i64 << e).take_while(|&s| s < n).collect();
                sizes.push(n);
                sizes
            }
            Policy::All => (1..=n).collect(),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown policy `{s}` (expected undivided, power-of-two or all)")
            })
    }
}

/// The identity of a tuning problem in messages: `alexnet.conv2 fp32 nchw fwd`, with
/// ` spatial` appended for a spatial split (measurements of one op split two ways are two
/// entries).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProblemName {
    pub layer: String,
    pub dtype: DType,
    pub layout: Layout,
    pub op: ConvOp,
    pub split: SplitDim,
}

impl fmt::Display for ProblemName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {}",
            self.layer, self.dtype, self.layout, self.op
        )?;
        if self.split == SplitDim::Spatial {
            f.write_str(" spatial")?;
        }
        Ok(())
    }
}

/// Why measurements cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ProfileError {
    #[error("profile has no measurements")]
    Empty,
    #[error("{name}: no measurements")]
    NoMeasurements { name: ProblemName },
    #[error("{name}: invalid shape: {source}")]
    Shape {
        name: ProblemName,
        source: ShapeError,
    },
    /// `n` is the entry's extent ([`OpProfile::extent`]).
    #[error("{name}: micro-batch size {micro} is outside 1..={n}")]
    MicroOutOfRange {
        name: ProblemName,
        micro: i64,
        n: i64,
    },
    #[error("{name}: algo {algo} at micro-batch {micro}: time_ms must be a positive finite number, got {time_ms}")]
    BadTime {
        name: ProblemName,
        micro: i64,
        algo: Algo,
        time_ms: f64,
    },
    #[error("{name}: algo {algo} at micro-batch {micro} is measured twice")]
    Duplicate {
        name: ProblemName,
        micro: i64,
        algo: Algo,
    },
    /// A verification no comparison produces (a tolerance that is not positive and finite,
    /// a negative or NaN error).
    #[error("{name}: algo {algo} at micro-batch {micro}: a verification needs a positive finite tolerance and an error that is not negative")]
    BadVerification {
        name: ProblemName,
        micro: i64,
        algo: Algo,
    },
    /// A measurement over its tolerance: it belongs among the rejected candidates.
    #[error("{name}: algo {algo} at micro-batch {micro} has a relative error of {max_rel_error:e} over its tolerance {tolerance:e}: it is a rejected candidate, not a measurement")]
    OverTolerance {
        name: ProblemName,
        micro: i64,
        algo: Algo,
        max_rel_error: f64,
        tolerance: f64,
    },
    /// A rejected candidate without an error over its tolerance.
    #[error("{name}: algo {algo} at micro-batch {micro} is listed as rejected, but its output was not found over its tolerance")]
    NotRejected {
        name: ProblemName,
        micro: i64,
        algo: Algo,
    },
    #[error("{name}: appears twice in the profile")]
    DuplicateProblem { name: ProblemName },
    #[error("cannot merge profiles of different devices: {first} and {other}")]
    MergeDevices { first: String, other: String },
    #[error("{name}: the merged profiles disagree on its shape")]
    MergeShapes { name: ProblemName },
}

impl OpProfile {
    pub fn name(&self) -> ProblemName {
        ProblemName {
            layer: self.layer.clone(),
            dtype: self.problem.dtype,
            layout: self.problem.layout,
            op: self.op,
            split: self.split,
        }
    }

    /// Mini-batch size.
    pub fn n(&self) -> i64 {
        self.problem.n
    }

    /// What the sizes of a plan for this entry sum to: [`OpProfile::n`] for a batch entry, the
    /// op's rows along the split axis for a spatial one ([`SplitDim::extent`]). The solvers
    /// split this as they split a mini-batch.
    pub fn extent(&self) -> i64 {
        self.split.extent(&self.problem, self.op)
    }

    /// Checks the shape and every measurement.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let name = || self.name();
        self.problem
            .validate()
            .map_err(|source| ProfileError::Shape {
                name: name(),
                source,
            })?;
        if self.measurements.is_empty() {
            return Err(ProfileError::NoMeasurements { name: name() });
        }
        let extent = self.extent();
        let mut seen = HashSet::with_capacity(self.measurements.len());
        for m in &self.measurements {
            if m.micro < 1 || m.micro > extent {
                return Err(ProfileError::MicroOutOfRange {
                    name: name(),
                    micro: m.micro,
                    n: extent,
                });
            }
            if !(m.time_ms.is_finite() && m.time_ms > 0.0) {
                return Err(ProfileError::BadTime {
                    name: name(),
                    micro: m.micro,
                    algo: m.algo,
                    time_ms: m.time_ms,
                });
            }
            if !seen.insert((m.micro, m.algo)) {
                return Err(ProfileError::Duplicate {
                    name: name(),
                    micro: m.micro,
                    algo: m.algo,
                });
            }
            if let Some(v) = m.verification {
                if !v.is_well_formed() {
                    return Err(ProfileError::BadVerification {
                        name: name(),
                        micro: m.micro,
                        algo: m.algo,
                    });
                }
                if !v.passed() {
                    return Err(ProfileError::OverTolerance {
                        name: name(),
                        micro: m.micro,
                        algo: m.algo,
                        max_rel_error: v.max_rel_error,
                        tolerance: v.tolerance,
                    });
                }
            }
        }
        // A rejected candidate was timed and found wrong: never also a measurement.
        for r in &self.rejected {
            if r.micro < 1 || r.micro > extent {
                return Err(ProfileError::MicroOutOfRange {
                    name: name(),
                    micro: r.micro,
                    n: extent,
                });
            }
            match r.verification {
                Some(v) if !v.is_well_formed() => {
                    return Err(ProfileError::BadVerification {
                        name: name(),
                        micro: r.micro,
                        algo: r.algo,
                    })
                }
                Some(v) if !v.passed() => {}
                _ => {
                    return Err(ProfileError::NotRejected {
                        name: name(),
                        micro: r.micro,
                        algo: r.algo,
                    })
                }
            }
            if !seen.insert((r.micro, r.algo)) {
                return Err(ProfileError::Duplicate {
                    name: name(),
                    micro: r.micro,
                    algo: r.algo,
                });
            }
        }
        // A skipped candidate is one not timed: never also a measurement, never twice.
        for skipped in &self.skipped {
            if skipped.micro < 1 || skipped.micro > extent {
                return Err(ProfileError::MicroOutOfRange {
                    name: name(),
                    micro: skipped.micro,
                    n: extent,
                });
            }
            if !seen.insert((skipped.micro, skipped.algo)) {
                return Err(ProfileError::Duplicate {
                    name: name(),
                    micro: skipped.micro,
                    algo: skipped.algo,
                });
            }
        }
        Ok(())
    }

    /// The largest size of this entry whose calls fit 32-bit indexing
    /// ([`IndexLimit::CUDNN`]): its extent for a problem within it, 0 when not even a size of
    /// 1 fits. Sizes above it are never offered to the solver (a profile measured by mucudnn
    /// has none). An invalid entry is not bounded here (its validation refuses it).
    pub fn largest_indexable(&self) -> i64 {
        if self.problem.validate().is_err() {
            return i64::MAX;
        }
        IndexLimit::CUDNN
            .largest_size(&self.problem, self.op, self.split)
            .unwrap_or(0)
    }

    /// The measurements a policy may use, at sizes that are in the profile and whose calls
    /// fit 32-bit indexing ([`OpProfile::largest_indexable`]).
    pub fn allowed(&self, policy: Policy) -> impl Iterator<Item = &Measurement> + '_ {
        let n = self.extent();
        let largest = self.largest_indexable();
        self.measurements
            .iter()
            .filter(move |m| policy.allows(m.micro, n) && m.micro <= largest)
    }
}

impl Profile {
    /// Adds `other`'s measurements: entries of the same (layer, dtype, layout, op) are joined
    /// (their shapes must agree), others appended. Both must come from one device and cuDNN
    /// version. The result is validated (a candidate measured in both at one size is refused).
    pub fn merge(&mut self, other: &Profile) -> Result<(), ProfileError> {
        if self.device != other.device || self.cudnn_version != other.cudnn_version {
            let describe = |p: &Profile| match p.cudnn_version {
                Some(v) => format!("{} (cuDNN {v})", p.device),
                None => p.device.clone(),
            };
            return Err(ProfileError::MergeDevices {
                first: describe(self),
                other: describe(other),
            });
        }
        for entry in &other.entries {
            match self.entries.iter_mut().find(|e| e.name() == entry.name()) {
                Some(mine) if mine.problem != entry.problem => {
                    return Err(ProfileError::MergeShapes { name: entry.name() })
                }
                Some(mine) => {
                    mine.measurements.extend_from_slice(&entry.measurements);
                    // What one side timed is no longer left to measure.
                    let timed: HashSet<(i64, Algo)> = mine
                        .measurements
                        .iter()
                        .map(|m| (m.micro, m.algo))
                        .collect();
                    mine.skipped.extend_from_slice(&entry.skipped);
                    mine.skipped.retain(|s| !timed.contains(&(s.micro, s.algo)));
                    mine.skipped.sort_by_key(|s| (s.micro, s.algo));
                    mine.skipped.dedup_by_key(|s| (s.micro, s.algo));
                    mine.rejected.extend_from_slice(&entry.rejected);
                }
                None => self.entries.push(entry.clone()),
            }
        }
        if self.fingerprint.is_none() {
            self.fingerprint.clone_from(&other.fingerprint);
        }
        self.validate()
    }

    /// The profile restricted to one set of candidates; entries left without measurements
    /// are dropped.
    pub fn only(&self, candidates: CandidateSet) -> Profile {
        let entries = self
            .entries
            .iter()
            .map(|e| OpProfile {
                measurements: e
                    .measurements
                    .iter()
                    .filter(|m| candidates.contains(m.algo.kind()))
                    .copied()
                    .collect(),
                skipped: e
                    .skipped
                    .iter()
                    .filter(|s| candidates.contains(s.algo.kind()))
                    .copied()
                    .collect(),
                rejected: e
                    .rejected
                    .iter()
                    .filter(|r| candidates.contains(r.algo.kind()))
                    .copied()
                    .collect(),
                ..e.clone()
            })
            .filter(|e| !e.measurements.is_empty())
            .collect();
        Profile {
            entries,
            ..self.clone()
        }
    }

    /// How its candidates are named for people: by its fingerprint's backend, else cuDNN when
    /// it names a cuDNN version (profiles written before fingerprints), else by number.
    pub fn algo_names(&self) -> AlgoNames {
        match (&self.fingerprint, self.cudnn_version) {
            (Some(fingerprint), _) => AlgoNames::new(fingerprint.backend),
            (None, Some(_)) => AlgoNames::new(BackendKind::Cuda),
            (None, None) => AlgoNames::default(),
        }
    }

    /// Checks every entry, and that no tuning problem appears twice.
    pub fn validate(&self) -> Result<(), ProfileError> {
        if self.entries.is_empty() {
            return Err(ProfileError::Empty);
        }
        let mut names = HashSet::with_capacity(self.entries.len());
        for entry in &self.entries {
            entry.validate()?;
            if !names.insert(entry.name()) {
                return Err(ProfileError::DuplicateProblem { name: entry.name() });
            }
        }
        Ok(())
    }
}

/// Why one measurement may not enter the cache (see [`RecordCheck`]).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RecordError {
    #[error(
        "the measurements were taken on {theirs}, this device is {ours}: measurements are shared only between devices of one fingerprint"
    )]
    Fingerprint { theirs: String, ours: String },
    #[error("invalid shape: {0}")]
    Shape(#[from] ShapeError),
    #[error("{} {algo} is not a {op} candidate of the {backend} backend", match .algo {
        Algo::Legacy(_) => "algorithm",
        Algo::Engine(_) => "engine configuration",
    })]
    UnknownCandidate {
        op: ConvOp,
        algo: Algo,
        backend: BackendKind,
    },
    #[error("micro-batch size {micro} is outside 1..={n}")]
    Micro { micro: i64, n: i64 },
    #[error("algo {algo}: time_ms must be a positive finite number, got {time_ms}")]
    BadTime { algo: Algo, time_ms: f64 },
    #[error("algo {algo}: a workspace of {workspace_bytes} bytes is more than the device's {memory_bytes} bytes of memory")]
    Workspace {
        algo: Algo,
        workspace_bytes: u64,
        memory_bytes: u64,
    },
    #[error("algo {algo}: {what}")]
    Verification { algo: Algo, what: &'static str },
}

/// A batch refused because of one record: its index in the batch, and why. Nothing of the
/// batch was stored.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("record {index} ({layer} {op} micro-batch {micro}): {source}")]
pub struct RefusedRecord {
    pub index: usize,
    pub layer: String,
    pub op: ConvOp,
    pub micro: i64,
    pub source: RecordError,
}

/// The one check every measurement passes before the cache stores it (a rank's share through
/// `mucudnnTunerStore`, `cache import`, the trainer's exchange) and that rows read back from the
/// cache pass before tuning uses them: measured on the cache's device, a valid shape, a
/// candidate that device's backend has for the op ([`Algo::belongs_to`]), a micro-batch size
/// within the problem, a positive finite time, and a workspace within the device's memory when
/// that is known.
#[derive(Clone, Copy, Debug)]
pub struct RecordCheck<'a> {
    /// The device the records will be stored under.
    pub device: &'a DeviceFingerprint,
    /// The device's memory in bytes (a GPU's global memory; the CPU's physical memory), when
    /// known: no workspace can be larger.
    pub memory_bytes: Option<u64>,
}

impl RecordCheck<'_> {
    /// The records' device must be this one.
    pub fn fingerprint(&self, theirs: &DeviceFingerprint) -> Result<(), RecordError> {
        if theirs == self.device {
            Ok(())
        } else {
            Err(RecordError::Fingerprint {
                theirs: theirs.to_string(),
                ours: self.device.to_string(),
            })
        }
    }

    /// One measurement of `op` on `problem` (its full mini-batch), a batch measurement.
    pub fn record(
        &self,
        problem: &ConvProblem,
        op: ConvOp,
        m: &Measurement,
    ) -> Result<(), RecordError> {
        self.record_split(problem, op, SplitDim::Batch, m)
    }

    /// One measurement of `op` on `problem` split along `split`: its size is within
    /// [`SplitDim::extent`] (the mini-batch for a batch measurement).
    pub fn record_split(
        &self,
        problem: &ConvProblem,
        op: ConvOp,
        split: SplitDim,
        m: &Measurement,
    ) -> Result<(), RecordError> {
        let extent = split.extent(problem, op);
        if !m.algo.belongs_to(self.device.backend, op) {
            return Err(RecordError::UnknownCandidate {
                op,
                algo: m.algo,
                backend: self.device.backend,
            });
        }
        if m.micro < 1 || m.micro > extent {
            return Err(RecordError::Micro {
                micro: m.micro,
                n: extent,
            });
        }
        if !(m.time_ms.is_finite() && m.time_ms > 0.0) {
            return Err(RecordError::BadTime {
                algo: m.algo,
                time_ms: m.time_ms,
            });
        }
        if let Some(memory_bytes) = self.memory_bytes {
            if m.workspace_bytes > memory_bytes {
                return Err(RecordError::Workspace {
                    algo: m.algo,
                    workspace_bytes: m.workspace_bytes,
                    memory_bytes,
                });
            }
        }
        if m.verification.is_some_and(|v| !v.is_well_formed()) {
            return Err(RecordError::Verification {
                algo: m.algo,
                what: "a verification needs a positive finite tolerance and an error that is not negative",
            });
        }
        Ok(())
    }

    /// That `m`'s verification agrees with the list it is stored in: a rejected candidate
    /// (`rejected`) was found over its tolerance; a measurement a plan may use was not.
    pub fn verdict(&self, m: &Measurement, rejected: bool) -> Result<(), RecordError> {
        if m.verification.is_some_and(|v| !v.is_well_formed()) {
            return Err(RecordError::Verification {
                algo: m.algo,
                what: "a verification needs a positive finite tolerance and an error that is not negative",
            });
        }
        match (rejected, m.is_rejected()) {
            (true, false) => Err(RecordError::Verification {
                algo: m.algo,
                what: "listed as rejected, but its output was not found over its tolerance",
            }),
            (false, true) => Err(RecordError::Verification {
                algo: m.algo,
                what: "its output is over its tolerance: a rejected candidate, not a measurement",
            }),
            _ => Ok(()),
        }
    }

    /// A whole batch, all or nothing: `records` are (layer, problem, op, measurement) in batch
    /// order; the first bad one is returned with its index. The problems' shapes are validated
    /// too.
    pub fn batch<'r>(
        &self,
        records: impl IntoIterator<Item = (&'r str, &'r ConvProblem, ConvOp, &'r Measurement)>,
    ) -> Result<usize, RefusedRecord> {
        self.batch_split(
            records
                .into_iter()
                .map(|(layer, problem, op, m)| (layer, problem, op, SplitDim::Batch, m)),
        )
    }

    /// As [`RecordCheck::batch`], each record with its split ([`RecordCheck::record_split`]).
    pub fn batch_split<'r>(
        &self,
        records: impl IntoIterator<Item = (&'r str, &'r ConvProblem, ConvOp, SplitDim, &'r Measurement)>,
    ) -> Result<usize, RefusedRecord> {
        let mut count = 0;
        for (index, (layer, problem, op, split, m)) in records.into_iter().enumerate() {
            let checked = problem
                .validate()
                .map_err(RecordError::from)
                .and_then(|()| self.record_split(problem, op, split, m));
            if let Err(source) = checked {
                return Err(RefusedRecord {
                    index,
                    layer: layer.chars().take(200).collect(),
                    op,
                    micro: m.micro,
                    source,
                });
            }
            count += 1;
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_sizes() {
        assert_eq!(Policy::Undivided.sizes(6), vec![6]);
        assert_eq!(Policy::PowerOfTwo.sizes(6), vec![1, 2, 4, 6]);
        assert_eq!(Policy::PowerOfTwo.sizes(8), vec![1, 2, 4, 8]);
        assert_eq!(Policy::PowerOfTwo.sizes(1), vec![1]);
        assert_eq!(Policy::All.sizes(3), vec![1, 2, 3]);
        for policy in Policy::ALL {
            for n in 1..40 {
                for size in 1..=n {
                    assert_eq!(
                        policy.allows(size, n),
                        policy.sizes(n).contains(&size),
                        "{policy} {size} {n}"
                    );
                }
            }
        }
        assert!(!Policy::All.allows(0, 4));
        assert_eq!(
            "power-of-two".parse::<Policy>().unwrap(),
            Policy::PowerOfTwo
        );
        assert!("pow2".parse::<Policy>().is_err());
    }

    fn entry(measurements: Vec<Measurement>) -> OpProfile {
        OpProfile {
            layer: "l".into(),
            problem: ConvProblem::new(4, 2, 5, 5, 2, 3, 3),
            op: ConvOp::Forward,
            split: crate::SplitDim::Batch,
            measurements,
            skipped: Vec::new(),
            rejected: Vec::new(),
        }
    }

    /// A skipped candidate is never also a measurement, and a merge that times it drops it.
    #[test]
    fn skipped_candidates_are_not_measurements() {
        let skipped = |micro: i64, algo: u32| Skipped {
            micro,
            algo: Algo::Legacy(algo),
            workspace_bytes: 1 << 30,
        };
        let mut with_skipped = entry(vec![m(4, 0, 1.0)]);
        with_skipped.skipped = vec![skipped(4, 1)];
        with_skipped.validate().unwrap();
        let mut both = with_skipped.clone();
        both.skipped.push(skipped(4, 0));
        assert!(matches!(
            both.validate(),
            Err(ProfileError::Duplicate { micro: 4, .. })
        ));
        let mut outside = with_skipped.clone();
        outside.skipped = vec![skipped(5, 1)];
        assert!(matches!(
            outside.validate(),
            Err(ProfileError::MicroOutOfRange { .. })
        ));
        // Merging the timing of the skipped candidate leaves nothing skipped.
        let mut profile = Profile {
            entries: vec![with_skipped],
            ..Default::default()
        };
        let timed = Profile {
            entries: vec![entry(vec![m(4, 1, 0.5)])],
            ..Default::default()
        };
        profile.merge(&timed).unwrap();
        assert!(profile.entries[0].skipped.is_empty());
        assert_eq!(profile.entries[0].measurements.len(), 2);
    }

    /// A spatial entry's sizes are chunks along the split axis: validated against the op's
    /// extent there, solved like micro-batches, and the plan records the split. One op split
    /// both ways is two entries.
    #[test]
    fn spatial_entries_are_chunks_along_the_axis() {
        // Batch 1, 9 x 5 input, 3x3 filter: 7 output rows (forward), 9 input rows (bwd-data).
        let spatial = |op, measurements| OpProfile {
            layer: "l".into(),
            problem: ConvProblem::new(1, 1, 9, 5, 1, 3, 3),
            op,
            split: SplitDim::Spatial,
            measurements,
            skipped: Vec::new(),
            rejected: Vec::new(),
        };
        let forward = spatial(
            ConvOp::Forward,
            vec![m(7, 0, 3.0), m(4, 1, 1.0), m(3, 1, 0.5)],
        );
        assert_eq!(forward.extent(), 7);
        assert_eq!(forward.n(), 1);
        forward.validate().unwrap();
        assert!(matches!(
            spatial(ConvOp::Forward, vec![m(8, 0, 1.0)]).validate(),
            Err(ProfileError::MicroOutOfRange { micro: 8, n: 7, .. })
        ));
        spatial(ConvOp::BackwardData, vec![m(9, 0, 1.0)])
            .validate()
            .unwrap();
        let plan = crate::solve_wr(&forward, Policy::All, u64::MAX).unwrap();
        assert_eq!(plan.split, SplitDim::Spatial);
        assert_eq!(plan.batch(), 7);
        assert_eq!(plan.extent(), 7);
        assert_eq!(plan.time_ms(), 1.5);
        assert_eq!(forward.name().to_string(), "l fp32 nchw fwd spatial");

        let batch = OpProfile {
            split: SplitDim::Batch,
            measurements: vec![m(1, 0, 1.0)],
            ..forward.clone()
        };
        let plan = crate::solve_wr(&batch, Policy::All, u64::MAX).unwrap();
        assert_eq!(plan.split, SplitDim::Batch);
        let both = Profile {
            entries: vec![batch.clone(), forward.clone()],
            ..Default::default()
        };
        both.validate().unwrap();
        let twice = Profile {
            entries: vec![forward.clone(), forward],
            ..Default::default()
        };
        assert!(matches!(
            twice.validate(),
            Err(ProfileError::DuplicateProblem { .. })
        ));
    }

    fn verified(micro: i64, algo: u32, max_rel_error: f64) -> Measurement {
        Measurement {
            verification: Some(Verification {
                max_rel_error,
                tolerance: 1e-5,
            }),
            ..m(micro, algo, 1.0)
        }
    }

    /// A rejected candidate is timed and over its tolerance, kept apart from the
    /// measurements: never both, never a measurement over its tolerance.
    #[test]
    fn rejected_candidates_are_not_measurements() {
        let mut entry = entry(vec![verified(4, 0, 0.0), verified(4, 1, 2e-6)]);
        entry.rejected = vec![verified(4, 2, 0.31)];
        entry.validate().unwrap();
        assert!(entry.rejected[0].is_rejected());
        assert!(!entry.measurements[1].is_rejected() && !m(4, 0, 1.0).is_rejected());
        let mut over = entry.clone();
        over.measurements.push(verified(2, 2, 0.31));
        assert!(matches!(
            over.validate(),
            Err(ProfileError::OverTolerance { micro: 2, .. })
        ));
        let mut both = entry.clone();
        both.rejected.push(verified(4, 1, f64::INFINITY));
        assert!(matches!(
            both.validate(),
            Err(ProfileError::Duplicate { micro: 4, .. })
        ));
        for not_rejected in [verified(2, 2, 1e-6), m(2, 2, 1.0)] {
            let mut wrong = entry.clone();
            wrong.rejected.push(not_rejected);
            assert!(matches!(
                wrong.validate(),
                Err(ProfileError::NotRejected { .. })
            ));
        }
        for bad in [
            Verification {
                max_rel_error: f64::NAN,
                tolerance: 1e-5,
            },
            Verification {
                max_rel_error: -1.0,
                tolerance: 1e-5,
            },
            Verification {
                max_rel_error: 0.0,
                tolerance: 0.0,
            },
        ] {
            let mut wrong = entry.clone();
            wrong.measurements[0].verification = Some(bad);
            assert!(matches!(
                wrong.validate(),
                Err(ProfileError::BadVerification { .. })
            ));
        }
        // Only a candidate kind's rejections stay with it.
        let profile = Profile {
            entries: vec![entry],
            ..Default::default()
        };
        assert_eq!(
            profile.only(CandidateSet::Legacy).entries[0].rejected.len(),
            1
        );
        assert!(profile.only(CandidateSet::Engines).entries.is_empty());
    }

    /// An infinite error (an output with NaN where the reference has none) is `null` in JSON
    /// and reads back infinite; a size is verified only when all of it was.
    #[test]
    fn verification_in_json_and_per_size() {
        let nan_output = verified(1, 0, f64::INFINITY);
        let json = serde_json::to_string(&nan_output).unwrap();
        assert!(json.contains(r#""max_rel_error":null"#), "{json}");
        let back: Measurement = serde_json::from_str(&json).unwrap();
        assert_eq!(back, nan_output);
        assert!(back.is_rejected());
        let plain = serde_json::to_string(&m(1, 0, 1.0)).unwrap();
        assert!(!plain.contains("verification"), "{plain}");
        use SizeVerification::*;
        assert_eq!(Verified.and(Verified), Verified);
        assert_eq!(Verified.and(Unverified), Unverified);
        assert_eq!(Imported.and(Verified), Imported);
        assert_eq!(Imported.and(Unverified), Unverified);
        assert!(Unverified.needs_measuring(true));
        assert!(!Unverified.needs_measuring(false));
        assert!(!Imported.needs_measuring(true) && !Verified.needs_measuring(true));
        for state in SizeVerification::ALL {
            assert_eq!(state.name().parse::<SizeVerification>(), Ok(state));
        }
    }

    fn m(micro: i64, algo: u32, time_ms: f64) -> Measurement {
        Measurement {
            micro,
            algo: Algo::Legacy(algo),
            time_ms,
            workspace_bytes: 0,
            verification: None,
        }
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(entry(vec![m(4, 0, 1.0)]).validate().is_ok());
        let err = entry(vec![]).validate().unwrap_err();
        assert_eq!(err.to_string(), "l fp32 nchw fwd: no measurements");
        assert!(matches!(
            entry(vec![m(5, 0, 1.0)]).validate(),
            Err(ProfileError::MicroOutOfRange { .. })
        ));
        assert!(matches!(
            entry(vec![m(0, 0, 1.0)]).validate(),
            Err(ProfileError::MicroOutOfRange { .. })
        ));
        assert!(matches!(
            entry(vec![m(1, 0, f64::NAN)]).validate(),
            Err(ProfileError::BadTime { .. })
        ));
        assert!(matches!(
            entry(vec![m(1, 0, -1.0)]).validate(),
            Err(ProfileError::BadTime { .. })
        ));
        assert!(matches!(
            entry(vec![m(1, 0, 1.0), m(1, 0, 2.0)]).validate(),
            Err(ProfileError::Duplicate {
                micro: 1,
                algo: Algo::Legacy(0),
                ..
            })
        ));
        let mut bad_shape = entry(vec![m(1, 0, 1.0)]);
        bad_shape.problem.groups = 0;
        assert!(matches!(
            bad_shape.validate(),
            Err(ProfileError::Shape { .. })
        ));
        let twice = Profile {
            entries: vec![entry(vec![m(1, 0, 1.0)]), entry(vec![m(1, 0, 1.0)])],
            ..Default::default()
        };
        assert!(matches!(
            twice.validate(),
            Err(ProfileError::DuplicateProblem { .. })
        ));
        assert_eq!(Profile::default().validate(), Err(ProfileError::Empty));
    }

    #[test]
    fn records_are_checked_against_the_device() {
        let cpu = DeviceFingerprint {
            backend: BackendKind::Cpu,
            name: "a cpu".into(),
            compute_capability: None,
            driver_version: None,
            cudnn_version: None,
        };
        let gpu = DeviceFingerprint {
            backend: BackendKind::Cuda,
            name: "a gpu".into(),
            ..cpu.clone()
        };
        let on_cpu = RecordCheck {
            device: &cpu,
            memory_bytes: Some(1 << 20),
        };
        let problem = ConvProblem::new(4, 2, 5, 5, 2, 3, 3);
        let check = |check: &RecordCheck, op, m: Measurement| check.record(&problem, op, &m);
        let good = m(2, 2, 0.5);
        assert_eq!(check(&on_cpu, ConvOp::BackwardFilter, good), Ok(()));
        for (bad, want) in [
            (
                m(2, 3, 0.5),
                "algorithm 3 is not a fwd candidate of the cpu backend",
            ),
            (m(2, 999, 0.5), "algorithm 999 is not a fwd candidate"),
            (m(0, 0, 0.5), "outside 1..=4"),
            (m(5, 0, 0.5), "outside 1..=4"),
            (m(1, 0, 0.0), "positive finite"),
            (m(1, 0, -1.0), "positive finite"),
            (m(1, 0, f64::NAN), "positive finite"),
            (m(1, 0, f64::INFINITY), "positive finite"),
            (
                Measurement {
                    workspace_bytes: (1 << 20) + 1,
                    ..good
                },
                "more than the device's 1048576 bytes",
            ),
        ] {
            let error = check(&on_cpu, ConvOp::Forward, bad)
                .unwrap_err()
                .to_string();
            assert!(error.contains(want), "{error}");
        }
        // A verification no comparison produces is refused; the list a verified record is
        // stored in must agree with its verdict.
        let nan = Measurement {
            verification: Some(Verification {
                max_rel_error: f64::NAN,
                tolerance: 1e-5,
            }),
            ..good
        };
        let error = check(&on_cpu, ConvOp::Forward, nan)
            .unwrap_err()
            .to_string();
        assert!(error.contains("positive finite tolerance"), "{error}");
        let wrong = verified(2, 2, 0.5);
        assert_eq!(check(&on_cpu, ConvOp::Forward, wrong), Ok(()));
        assert!(on_cpu.verdict(&wrong, true).is_ok());
        assert!(on_cpu
            .verdict(&wrong, false)
            .unwrap_err()
            .to_string()
            .contains("a rejected candidate, not a measurement"));
        assert!(on_cpu.verdict(&good, true).is_err());
        assert!(on_cpu.verdict(&good, false).is_ok());
        // An engine configuration is a cuDNN candidate only; cuDNN's counts differ per op.
        let engine = Measurement {
            algo: Algo::Engine("eng3_k2=1".parse().unwrap()),
            ..good
        };
        assert!(check(&on_cpu, ConvOp::Forward, engine).is_err());
        let on_gpu = RecordCheck {
            device: &gpu,
            memory_bytes: None,
        };
        assert_eq!(check(&on_gpu, ConvOp::Forward, engine), Ok(()));
        assert_eq!(check(&on_gpu, ConvOp::Forward, m(1, 7, 1.0)), Ok(()));
        assert!(check(&on_gpu, ConvOp::BackwardData, m(1, 7, 1.0)).is_err());
        // Without a known memory size, any workspace passes.
        let big = Measurement {
            workspace_bytes: u64::MAX,
            ..good
        };
        assert_eq!(check(&on_gpu, ConvOp::Forward, big), Ok(()));
        assert!(on_gpu.fingerprint(&gpu).is_ok());
        assert!(on_gpu
            .fingerprint(&cpu)
            .unwrap_err()
            .to_string()
            .contains("taken on a cpu, this device is a gpu"));
        // A batch is refused at its first bad record, by index.
        let records = [m(1, 0, 1.0), m(2, 1, 1.0), m(4, 0, 0.0), m(1, 999, 1.0)];
        let refused = on_cpu
            .batch(records.iter().map(|r| ("l", &problem, ConvOp::Forward, r)))
            .unwrap_err();
        assert_eq!(refused.index, 2);
        assert!(refused
            .to_string()
            .starts_with("record 2 (l fwd micro-batch 4): "));
        assert_eq!(
            on_cpu.batch(
                records[..2]
                    .iter()
                    .map(|r| ("l", &problem, ConvOp::Forward, r))
            ),
            Ok(2)
        );
        let mut bad_shape = problem;
        bad_shape.groups = 0;
        assert!(matches!(
            on_cpu.batch([("l", &bad_shape, ConvOp::Forward, &records[0])]),
            Err(RefusedRecord {
                source: RecordError::Shape(_),
                ..
            })
        ));
    }
}
