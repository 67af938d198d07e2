//! A profiling run: its settings ([`ProfileRun`], [`EngineOptions`]), what it reports
//! ([`CacheStats`]) and how it fails ([`TuneError`]). The run decides, per size, how to
//! measure ([`MeasureSettings`]: the engine search and the candidates selected).

use crate::backend::{
    BackendError, EngineSearch, MeasureSettings, MemoryUse, Selection, TimingSettings,
};
use crate::profiler::prune;
use crate::profiler::Job;
use crate::solver::{
    Algo, AlgoKind, CandidateSet, IndexError, IndexLimit, Measured, Measurement, Policy, SolveError,
};
use mucudnn_cache::Cache;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

/// Why tuning failed.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Solve(#[from] SolveError),
    #[error("interrupted: {measured} micro-batch size(s) measured this run are kept in the cache")]
    Interrupted { measured: usize },
    /// The cache path names a file that is not a mucudnn cache (left untouched), or the
    /// process cannot open files now.
    #[error(transparent)]
    Cache(#[from] mucudnn_cache::OpenFailure),
    /// No size of the split fits 32-bit indexing (one sample's rows, the filter): no plan can
    /// run `layer` (see [`crate::solver::indexing`]).
    #[error("{layer}: {source}")]
    Indexing {
        layer: String,
        #[source]
        source: IndexError,
    },
}

/// Where a profile's measurements came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// (job, micro-batch size, candidate kind) triples read from the cache.
    pub cached: usize,
    /// (job, micro-batch size, candidate kind) triples measured by the backend in this run.
    pub measured: usize,
    /// Engine configurations (size, configuration) not timed because pruning dropped them.
    pub pruned: usize,
    /// Candidates (size, candidate) not timed because their workspace exceeded the measuring
    /// limit (recorded as skipped; a tune under a larger limit times them).
    pub skipped: usize,
    /// Candidates (size, candidate) measured in this run whose output was compared with the
    /// reference candidate's.
    pub verified: usize,
    /// Of those, the candidates rejected for wrong results (over their tolerance).
    pub rejected: usize,
    /// The memory measuring held (operands and workspace; device memory on a GPU) in this run.
    pub memory: MemoryUse,
}

impl CacheStats {
    /// Counts what measuring one size found: its skipped, verified and rejected candidates.
    pub(crate) fn count(&mut self, found: &Measured) {
        self.skipped += found.skipped.len();
        self.verified += found
            .measurements
            .iter()
            .chain(&found.rejected)
            .filter(|m| m.verification.is_some())
            .count();
        self.rejected += found.rejected.len();
    }

    /// Two runs' statistics together (the larger memory of the two).
    pub fn and(self, other: CacheStats) -> CacheStats {
        CacheStats {
            cached: self.cached + other.cached,
            measured: self.measured + other.measured,
            pruned: self.pruned + other.pruned,
            skipped: self.skipped + other.skipped,
            verified: self.verified + other.verified,
            rejected: self.rejected + other.rejected,
            memory: self.memory.max(other.memory),
        }
    }
}

/// How engine configurations are searched: a bound and pruning (see [`prune`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineOptions {
    /// At most this many configurations per (op, micro-batch size); `None`: all found.
    pub max_candidates: Option<usize>,
    /// Drop a configuration at larger sizes once a candidate needing no more workspace is
    /// faster by more than this factor; `None`: time every configuration at every size.
    pub prune_margin: Option<f64>,
    /// Solve plans from deterministic candidates only ([`Backend::is_deterministic`], of
    /// either kind), as PyTorch's `torch.backends.cudnn.deterministic` asks. Measuring is
    /// unchanged (the cache keeps every candidate); the plans are cached under their own key.
    pub deterministic: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_candidates: None,
            prune_margin: Some(prune::DEFAULT_MARGIN),
            deterministic: false,
        }
    }
}

/// Everything a profiling run needs besides the backend and the jobs.
pub struct ProfileRun<'a> {
    pub policy: Policy,
    pub timing: TimingSettings,
    pub cache: &'a Cache,
    /// Set (e.g. by Ctrl-C) to stop after the current micro-batch size.
    pub interrupt: Option<&'a AtomicBool>,
    /// Which candidates to measure. Kinds the backend lacks are left out when the set has
    /// another kind (`all` on the CPU measures its algorithms); a set of only those is an error.
    pub candidates: CandidateSet,
    pub engines: EngineOptions,
    /// The largest workspace any plan solved from this run may use (a per-layer limit, or a
    /// total budget): a candidate needing more at a size is not timed, only recorded as
    /// skipped. `None`: time every candidate.
    pub workspace_limit_bytes: Option<u64>,
    /// What one call's operand may reach ([`IndexLimit::CUDNN`] but in tests): a size whose
    /// calls exceed it is neither measured nor solved with.
    pub index_limit: IndexLimit,
    /// Verify what is measured: compare every candidate's output with the reference
    /// candidate's and reject those over their tolerance (the default). A cached size measured
    /// without verification is then measured again.
    pub verify: bool,
}

impl ProfileRun<'_> {
    /// The candidate kinds of the run that a backend offering `offered` has, in set order.
    pub(crate) fn offered_kinds(&self, offered: &[AlgoKind]) -> Vec<AlgoKind> {
        self.candidates
            .kinds()
            .iter()
            .copied()
            .filter(|kind| offered.contains(kind))
            .collect()
    }

    /// The kinds to measure on a backend that offers `offered`.
    pub(crate) fn kinds(
        &self,
        offered: &[AlgoKind],
        backend: &str,
    ) -> Result<Vec<AlgoKind>, BackendError> {
        let kinds = self.offered_kinds(offered);
        if kinds.is_empty() {
            return Err(BackendError::NoEngines {
                backend: backend.to_string(),
            });
        }
        Ok(kinds)
    }

    pub(crate) fn interrupted(&self) -> bool {
        self.interrupt
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }

    /// The engine search at one step: the bound, and for a size between two anchors the
    /// configurations dominated at both (from what `by_size` holds for them).
    pub(crate) fn engine_search(
        &self,
        kind: AlgoKind,
        step: prune::Step,
        by_size: &BTreeMap<i64, Vec<Measurement>>,
    ) -> EngineSearch {
        let skip = match (kind, step.between, self.engines.prune_margin) {
            (AlgoKind::Engine, Some((lower, upper)), Some(margin)) => {
                match (by_size.get(&lower), by_size.get(&upper)) {
                    (Some(lower), Some(upper)) => prune::skip_between(lower, upper, margin),
                    _ => BTreeSet::new(),
                }
            }
            _ => BTreeSet::new(),
        };
        EngineSearch {
            max_candidates: self.engines.max_candidates,
            skip,
        }
    }

    /// The candidates to time at one size: every one (also when a verifying run finds the
    /// size measured without verification), or, when `cached` holds what a smaller limit
    /// measured there, only those it skipped that fit this run's limit. `None`: the cached
    /// measurements serve this run as they are.
    pub(crate) fn selection(&self, cached: Option<&Measured>) -> Option<Selection> {
        let limit = self.workspace_limit_bytes;
        let every = Selection {
            workspace_limit_bytes: limit,
            only: None,
        };
        match cached {
            None => Some(every),
            Some(cached) if cached.verification.needs_measuring(self.verify) => Some(every),
            Some(Measured { skipped, .. }) => {
                let only: BTreeSet<Algo> = skipped
                    .iter()
                    .filter(|s| limit.is_none_or(|l| s.workspace_bytes <= l))
                    .map(|s| s.algo)
                    .collect();
                (!only.is_empty()).then_some(Selection {
                    workspace_limit_bytes: limit,
                    only: Some(only),
                })
            }
        }
    }

    /// The sizes of `job` this run measures: its policy's, whose calls fit the run's index
    /// limit ([`Job::sizes`]); [`TuneError::Indexing`] when none does.
    pub fn sizes(&self, job: &Job) -> Result<Vec<i64>, TuneError> {
        job.sizes(self.policy, self.index_limit)
            .map_err(|source| TuneError::Indexing {
                layer: job.layer.clone(),
                source,
            })
    }

    /// How to measure one size: this run's timing and verification, with `search` and
    /// `select` for the size.
    pub(crate) fn how(&self, search: EngineSearch, select: Selection) -> MeasureSettings {
        MeasureSettings {
            timing: self.timing,
            search,
            select,
            verify: self.verify,
        }
    }

    /// The candidate set actually measured on a backend that offers `offered` (the plan key).
    pub fn effective_candidates(&self, offered: &[AlgoKind]) -> CandidateSet {
        CandidateSet::from_kinds(&self.offered_kinds(offered)).unwrap_or(self.candidates)
    }
}
