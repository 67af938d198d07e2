//! One in-process tuner: a key to prepared plans, tuned on a miss.
//!
//! Every integration that tunes "on first sight, then executes" keeps one of these: the CPU
//! layer ([`crate::layer::Conv2d`], keyed by input shape), candle's layers (by input shape,
//! on the host), the C handle (`mucudnnHandle_t`, by problem and op) and the C tuner
//! (`mucudnnTuner_t`, its prepared sets by id). A lookup that misses runs the caller's tune
//! step once, usually [`LayerTuning`](crate::tune::LayerTuning) through the SQLite cache, and
//! keeps what it prepared from the plans; a failed tune keeps nothing, so the next call tries
//! again. The tuner also remembers the order keys were first tuned in and where each one's
//! measurements came from ([`CacheStats`]).
//!
//! [`HostPlans`] is the tuner of a layer that runs on the host: three plans per key, the CPU
//! backend they are measured with, and the one workspace they share.
//!
//! What comes in is a key and, on a miss, a closure that tunes; what goes out is a reference to
//! the prepared value. It holds no lock: a caller shared by threads puts it behind its own.

use crate::backend::cpu::AlignedWorkspace;
use crate::backend::CpuBackend;
use crate::exec::cpu_workspace_bytes;
use crate::solver::Plan;
use crate::tune::CacheStats;
use std::collections::HashMap;
use std::hash::Hash;

/// Prepared values `P` by key `K`, and the keys in the order they were tuned with their
/// cache statistics.
pub struct LocalTuner<K, P> {
    prepared: HashMap<K, P>,
    tuned: Vec<(K, CacheStats)>,
}

impl<K, P> Default for LocalTuner<K, P> {
    fn default() -> Self {
        LocalTuner {
            prepared: HashMap::new(),
            tuned: Vec::new(),
        }
    }
}

impl<K: Clone + Eq + Hash, P> LocalTuner<K, P> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The value prepared for `key`, if it has been tuned.
    pub fn get(&self, key: &K) -> Option<&P> {
        self.prepared.get(key)
    }

    pub fn contains(&self, key: &K) -> bool {
        self.prepared.contains_key(key)
    }

    /// The value prepared for `key`; on a miss, `tune` makes it (and says where its
    /// measurements came from) and it is kept. Also returns the statistics of a tune made by
    /// this call (`None`: it was prepared before). An error keeps nothing.
    pub fn get_or_tune<E>(
        &mut self,
        key: &K,
        tune: impl FnOnce() -> Result<(P, CacheStats), E>,
    ) -> Result<(&mut P, Option<CacheStats>), E> {
        let mut tuned_now = None;
        if !self.prepared.contains_key(key) {
            let (prepared, stats) = tune()?;
            self.insert(key.clone(), prepared, stats);
            tuned_now = Some(stats);
        }
        let prepared = self
            .prepared
            .get_mut(key)
            .expect("a value is kept for every key tuned");
        Ok((prepared, tuned_now))
    }

    /// Keeps `prepared` for `key` (tuned elsewhere, with `stats`), replacing any value there.
    pub fn insert(&mut self, key: K, prepared: P, stats: CacheStats) {
        if self.prepared.insert(key.clone(), prepared).is_none() {
            self.tuned.push((key, stats));
        }
    }

    /// Drops the value of `key`; `None` when there was none.
    pub fn remove(&mut self, key: &K) -> Option<P> {
        let removed = self.prepared.remove(key)?;
        self.tuned.retain(|(k, _)| k != key);
        Some(removed)
    }

    /// The keys in the order they were tuned, with where their measurements came from.
    pub fn tunings(&self) -> &[(K, CacheStats)] {
        &self.tuned
    }

    /// The prepared values in the order their keys were tuned.
    pub fn in_order(&self) -> impl Iterator<Item = &P> {
        self.tuned
            .iter()
            .filter_map(|(key, _)| self.prepared.get(key))
    }

    pub fn len(&self) -> usize {
        self.prepared.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prepared.is_empty()
    }

    /// Forgets everything (the settings the values were tuned under changed).
    pub fn clear(&mut self) {
        self.prepared.clear();
        self.tuned.clear();
    }
}

/// What a host layer's call runs with: the three plans of its shape, the workspace, and the
/// statistics of a tune made by this call (`None`: tuned before).
pub type HostCall<'a> = (&'a [Plan; 3], &'a mut [u8], Option<CacheStats>);

/// The tuner of a layer that runs on the host: `[forward, backward-data, backward-filter]`
/// plans per key, measured with its own CPU backend, and one workspace that every plan fits.
pub struct HostPlans<K> {
    tuner: LocalTuner<K, [Plan; 3]>,
    backend: CpuBackend,
    workspace: AlignedWorkspace,
}

impl<K: Clone + Eq + Hash> Default for HostPlans<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Clone + Eq + Hash> HostPlans<K> {
    pub fn new() -> Self {
        HostPlans {
            tuner: LocalTuner::new(),
            backend: CpuBackend::new(),
            workspace: AlignedWorkspace::default(),
        }
    }

    /// The plans of `key` and the workspace to run them on ([`HostCall`]); on a miss `tune` makes them with
    /// the layer's backend, and the workspace grows to the largest plan's. Also the
    /// statistics of a tune made by this call.
    pub fn get_or_tune<E>(
        &mut self,
        key: &K,
        tune: impl FnOnce(&mut CpuBackend) -> Result<([Plan; 3], CacheStats), E>,
    ) -> Result<HostCall<'_>, E> {
        let HostPlans {
            tuner,
            backend,
            workspace,
        } = self;
        let (plans, stats) = tuner.get_or_tune(key, || tune(backend))?;
        if stats.is_some() {
            let needed = plans.iter().map(cpu_workspace_bytes).max().unwrap_or(0);
            if (workspace.len() as u64) < needed {
                *workspace = AlignedWorkspace::new(needed);
            }
        }
        Ok((plans, workspace.as_bytes_mut(), stats))
    }

    /// The plans of `key`, if it has been tuned.
    pub fn get(&self, key: &K) -> Option<&[Plan; 3]> {
        self.tuner.get(key)
    }

    /// Forgets the plans (the workspace stays for the next ones).
    pub fn clear(&mut self) {
        self.tuner.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(measured: usize) -> CacheStats {
        CacheStats {
            measured,
            ..CacheStats::default()
        }
    }

    #[test]
    fn tunes_once_per_key_and_keeps_the_order() {
        let mut tuner: LocalTuner<i64, String> = LocalTuner::new();
        let mut tunes = 0;
        for (key, first_sight) in [(2, true), (1, true), (2, false), (1, false), (3, true)] {
            let (value, now) = tuner
                .get_or_tune(&key, || {
                    tunes += 1;
                    Ok::<_, ()>((format!("plans {key}"), stats(key as usize)))
                })
                .unwrap();
            assert_eq!(*value, format!("plans {key}"));
            assert_eq!(now.is_some(), first_sight);
        }
        assert_eq!(tunes, 3);
        let order: Vec<i64> = tuner.tunings().iter().map(|(k, _)| *k).collect();
        assert_eq!(order, [2, 1, 3]);
        assert_eq!(tuner.tunings()[2].1.measured, 3);
        let values: Vec<&String> = tuner.in_order().collect();
        assert_eq!(values, ["plans 2", "plans 1", "plans 3"]);
    }

    #[test]
    fn a_failed_tune_keeps_nothing_and_is_tried_again() {
        let mut tuner: LocalTuner<i64, i64> = LocalTuner::new();
        assert_eq!(
            tuner.get_or_tune(&1, || Err("no GPU")).err(),
            Some("no GPU")
        );
        assert!(tuner.is_empty() && tuner.tunings().is_empty());
        let (value, now) = tuner
            .get_or_tune(&1, || Ok::<_, ()>((7, stats(1))))
            .unwrap();
        assert_eq!((*value, now.map(|s| s.measured)), (7, Some(1)));
        let (_, now) = tuner
            .get_or_tune(&1, || -> Result<_, ()> { panic!("tuned twice") })
            .unwrap();
        assert!(now.is_none());
        assert_eq!(tuner.remove(&1), Some(7));
        assert!(tuner.tunings().is_empty());
    }
}
