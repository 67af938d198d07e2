//! One in-process tuner: a key to prepared plans, tuned on a miss, holding at most a bounded
//! number of keys.
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
//! A process that sees ever new shapes (a server, variable-length inputs) must not grow
//! without bound: a tuner keeps at most [`LocalTuner::capacity`] keys ([`DEFAULT_CAPACITY`]
//! unless set), and tuning one more drops the least recently used. An evicted key that comes
//! back is tuned again, which through the cache reads its plans (or its measurements) and
//! measures nothing. A tuner whose values the caller keeps by id and releases itself (the C
//! tuner's plan sets) is made [`unbounded`](LocalTuner::unbounded).
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
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::num::NonZeroUsize;

/// How many keys a tuner keeps unless told otherwise: far more input shapes than a layer of
/// a fixed-shape model sees, and a bounded amount of memory (a host key holds three plans, a
/// few hundred bytes each; a GPU key their cuDNN descriptors and execution plans).
pub const DEFAULT_CAPACITY: usize = 256;

/// Prepared values `P` by key `K`, at most [`LocalTuner::capacity`] of them (the least
/// recently used dropped first), and the keys in the order they were tuned with their cache
/// statistics.
pub struct LocalTuner<K, P> {
    entries: HashMap<K, Entry<P>>,
    /// The keys by their last use (a tick), least recent first.
    by_use: BTreeMap<u64, K>,
    /// The keys by when they were tuned (a tick), first first.
    by_tuning: BTreeMap<u64, K>,
    tick: u64,
    capacity: Option<NonZeroUsize>,
    evicted: u64,
}

struct Entry<P> {
    value: P,
    stats: CacheStats,
    tuned_at: u64,
    used_at: u64,
}

impl<K, P> Default for LocalTuner<K, P> {
    fn default() -> Self {
        LocalTuner {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            by_tuning: BTreeMap::new(),
            tick: 0,
            capacity: NonZeroUsize::new(DEFAULT_CAPACITY),
            evicted: 0,
        }
    }
}

impl<K: Clone + Eq + Hash, P> LocalTuner<K, P> {
    /// A tuner of [`DEFAULT_CAPACITY`] keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// A tuner of at most `capacity` keys.
    pub fn with_capacity(capacity: NonZeroUsize) -> Self {
        LocalTuner {
            capacity: Some(capacity),
            ..Self::default()
        }
    }

    /// A tuner that never drops a key (its caller removes them).
    pub fn unbounded() -> Self {
        LocalTuner {
            capacity: None,
            ..Self::default()
        }
    }

    /// The most keys kept (`None`: no bound).
    pub fn capacity(&self) -> Option<NonZeroUsize> {
        self.capacity
    }

    /// Sets the bound (`None`: none), dropping the least recently used keys over it now.
    pub fn set_capacity(&mut self, capacity: Option<NonZeroUsize>) {
        self.capacity = capacity;
        if let Some(capacity) = capacity {
            while self.entries.len() > capacity.get() {
                self.evict_one();
            }
        }
    }

    /// How many keys were dropped for the bound so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Marks `key` used now.
    fn touch(&mut self, key: &K) {
        let now = self.tick + 1;
        if let Some(entry) = self.entries.get_mut(key) {
            self.tick = now;
            let key = self
                .by_use
                .remove(&entry.used_at)
                .expect("every entry is in by_use");
            entry.used_at = now;
            self.by_use.insert(now, key);
        }
    }

    /// Drops the least recently used key.
    fn evict_one(&mut self) {
        if let Some((_, key)) = self.by_use.pop_first() {
            if let Some(entry) = self.entries.remove(&key) {
                self.by_tuning.remove(&entry.tuned_at);
                self.evicted += 1;
            }
        }
    }

    /// The value prepared for `key`, if it has been tuned (and not dropped), marked used.
    pub fn get(&mut self, key: &K) -> Option<&mut P> {
        self.touch(key);
        self.entries.get_mut(key).map(|entry| &mut entry.value)
    }

    /// The value prepared for `key`, without marking it used.
    pub fn peek(&self, key: &K) -> Option<&P> {
        self.entries.get(key).map(|entry| &entry.value)
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// The value prepared for `key`; on a miss, `tune` makes it (and says where its
    /// measurements came from) and it is kept, dropping the least recently used key when the
    /// tuner is full. Also returns the statistics of a tune made by this call (`None`: it was
    /// prepared before). An error keeps nothing.
    pub fn get_or_tune<E>(
        &mut self,
        key: &K,
        tune: impl FnOnce() -> Result<(P, CacheStats), E>,
    ) -> Result<(&mut P, Option<CacheStats>), E> {
        let mut tuned_now = None;
        if self.entries.contains_key(key) {
            self.touch(key);
        } else {
            let (prepared, stats) = tune()?;
            self.insert(key.clone(), prepared, stats);
            tuned_now = Some(stats);
        }
        let prepared = &mut self
            .entries
            .get_mut(key)
            .expect("a value is kept for every key tuned")
            .value;
        Ok((prepared, tuned_now))
    }

    /// Keeps `prepared` for `key` (tuned elsewhere, with `stats`), replacing any value there
    /// (which keeps its place in the tuning order), marked used; a new key over the bound
    /// drops the least recently used one.
    pub fn insert(&mut self, key: K, prepared: P, stats: CacheStats) {
        if self.entries.contains_key(&key) {
            self.touch(&key);
            let entry = self.entries.get_mut(&key).expect("present");
            entry.value = prepared;
            return;
        }
        if let Some(capacity) = self.capacity {
            while self.entries.len() >= capacity.get() {
                self.evict_one();
            }
        }
        let now = self.next_tick();
        self.by_use.insert(now, key.clone());
        self.by_tuning.insert(now, key.clone());
        self.entries.insert(
            key,
            Entry {
                value: prepared,
                stats,
                tuned_at: now,
                used_at: now,
            },
        );
    }

    /// Drops the value of `key`; `None` when there was none.
    pub fn remove(&mut self, key: &K) -> Option<P> {
        let entry = self.entries.remove(key)?;
        self.by_use.remove(&entry.used_at);
        self.by_tuning.remove(&entry.tuned_at);
        Some(entry.value)
    }

    /// The keys kept, in the order they were tuned, with where their measurements came from.
    pub fn tunings(&self) -> impl Iterator<Item = (&K, CacheStats)> + '_ {
        self.by_tuning
            .values()
            .map(|key| (key, self.entries[key].stats))
    }

    /// The prepared values in the order their keys were tuned.
    pub fn in_order(&self) -> impl Iterator<Item = &P> {
        self.by_tuning.values().map(|key| &self.entries[key].value)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Forgets everything (the settings the values were tuned under changed).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.by_use.clear();
        self.by_tuning.clear();
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

    /// The plans of `key`, if it has been tuned (and not dropped for the bound).
    pub fn get(&self, key: &K) -> Option<&[Plan; 3]> {
        self.tuner.peek(key)
    }

    /// The most keys kept (see [`LocalTuner::set_capacity`]); the workspace is shared by all.
    pub fn set_capacity(&mut self, capacity: Option<NonZeroUsize>) {
        self.tuner.set_capacity(capacity);
    }

    /// How many keys are kept now.
    pub fn len(&self) -> usize {
        self.tuner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tuner.is_empty()
    }

    /// The shared workspace's bytes (the largest plan's that was ever kept).
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.len()
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
        let order: Vec<i64> = tuner.tunings().map(|(k, _)| *k).collect();
        assert_eq!(order, [2, 1, 3]);
        assert_eq!(tuner.tunings().nth(2).unwrap().1.measured, 3);
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
        assert!(tuner.is_empty() && tuner.tunings().next().is_none());
        let (value, now) = tuner
            .get_or_tune(&1, || Ok::<_, ()>((7, stats(1))))
            .unwrap();
        assert_eq!((*value, now.map(|s| s.measured)), (7, Some(1)));
        let (_, now) = tuner
            .get_or_tune(&1, || -> Result<_, ()> { panic!("tuned twice") })
            .unwrap();
        assert!(now.is_none());
        assert_eq!(tuner.remove(&1), Some(7));
        assert!(tuner.tunings().next().is_none());
    }

    /// Ever new keys keep at most `capacity` values: the least recently used one goes, a key
    /// used since it was tuned stays, and an evicted key that comes back is tuned again.
    #[test]
    fn holds_at_most_its_capacity_least_recently_used_first() {
        let capacity = NonZeroUsize::new(3).unwrap();
        let mut tuner: LocalTuner<i64, String> = LocalTuner::with_capacity(capacity);
        let tunes = std::cell::RefCell::new(Vec::new());
        let call = |tuner: &mut LocalTuner<i64, String>, key: i64| {
            tuner
                .get_or_tune(&key, || {
                    tunes.borrow_mut().push(key);
                    Ok::<_, ()>((format!("plans {key}"), stats(1)))
                })
                .unwrap()
                .0
                .clone()
        };
        for key in [1, 2, 3] {
            call(&mut tuner, key);
        }
        // 1 is used again, so 2 is the least recently used when 4 comes.
        assert_eq!(call(&mut tuner, 1), "plans 1");
        call(&mut tuner, 4);
        assert_eq!(tuner.len(), 3);
        assert!(!tuner.contains(&2) && tuner.contains(&1));
        assert_eq!(tuner.evicted(), 1);
        let order: Vec<i64> = tuner.tunings().map(|(k, _)| *k).collect();
        assert_eq!(order, [1, 3, 4]);
        // `get` counts as a use, `peek` does not.
        assert!(tuner.get(&3).is_some());
        assert!(tuner.peek(&1).is_some());
        call(&mut tuner, 5);
        assert!(!tuner.contains(&1) && tuner.contains(&3));
        // 2 comes back: tuned again.
        call(&mut tuner, 2);
        assert_eq!(*tunes.borrow(), [1, 2, 3, 4, 5, 2]);
        // 10,000 new keys: never more than the bound.
        for key in 100..10_100 {
            call(&mut tuner, key);
            assert!(tuner.len() <= 3);
        }
        assert_eq!(tuner.evicted(), 3 + 10_000);
        assert_eq!(tuner.tunings().count(), 3);
        // Lowering the bound drops the least recent now; an unbounded tuner keeps all.
        tuner.set_capacity(NonZeroUsize::new(1));
        assert_eq!(tuner.len(), 1);
        assert!(tuner.contains(&10_099));
        let mut all: LocalTuner<i64, i64> = LocalTuner::unbounded();
        for key in 0..(DEFAULT_CAPACITY as i64 + 10) {
            all.insert(key, key, stats(0));
        }
        assert_eq!(all.len(), DEFAULT_CAPACITY + 10);
        assert_eq!(
            LocalTuner::<i64, i64>::new()
                .capacity()
                .map(NonZeroUsize::get),
            Some(DEFAULT_CAPACITY)
        );
    }

    /// A host layer's shapes through the cache: a shape dropped for the bound and seen again
    /// is prepared from the cache, measuring nothing, and the workspace stays one buffer.
    #[test]
    fn evicted_host_shapes_come_back_from_the_cache_without_measuring() {
        use crate::backend::TimingSettings;
        use crate::solver::ConvProblem;
        use crate::tune::LayerTuning;
        let cache = mucudnn_cache::Cache::in_memory().quiet();
        let tuning = LayerTuning::new(TimingSettings::CPU);
        let mut plans: HostPlans<i64> = HostPlans::new();
        plans.set_capacity(NonZeroUsize::new(2));
        let measured_at = |plans: &mut HostPlans<i64>, width: i64| {
            let problem = ConvProblem::new(2, 2, 4, width, 2, 3, 3);
            let (_, _, stats) = plans
                .get_or_tune(&width, |backend| {
                    tuning.tune_counted(backend, &cache, "bounded", &problem)
                })
                .unwrap();
            stats.map(|s| s.measured)
        };
        for width in [5, 6, 7] {
            assert!(measured_at(&mut plans, width).unwrap() > 0);
        }
        assert_eq!(plans.len(), 2);
        assert!(plans.get(&5).is_none());
        // Width 5 was dropped: tuned again, from the cache.
        assert_eq!(measured_at(&mut plans, 5), Some(0));
        assert_eq!(measured_at(&mut plans, 5), None);
        assert_eq!(plans.len(), 2);
        assert!(plans.workspace_bytes() > 0);
    }
}
