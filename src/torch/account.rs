//! The account of what ran: per name (a converted layer's module path, or a problem's name
//! under the switch) and op, the calls mucudnn's plans executed and the calls left to
//! PyTorch's own kernel, by reason. A call adds to counters its layer holds (atomics, no lock),
//! so keeping the account costs nothing measurable; a fallback, rarer and slower anyway, takes
//! a lock to count its reason.

use crate::solver::ConvOp;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

fn op_index(op: ConvOp) -> usize {
    match op {
        ConvOp::Forward => 0,
        ConvOp::BackwardData => 1,
        ConvOp::BackwardFilter => 2,
    }
}

/// One name's counters.
#[derive(Default)]
pub struct Counters {
    executed: [AtomicU64; 3],
    fallbacks: Mutex<BTreeMap<String, [u64; 3]>>,
    /// The fallback reasons said on stderr for this name (kept by `reset`: said once for the
    /// name's life, as a layer's warning is).
    warned: Mutex<HashSet<String>>,
}

impl Counters {
    pub fn executed(&self, op: ConvOp) {
        self.executed[op_index(op)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn fell_back(&self, op: ConvOp, reason: &str) {
        let mut map = self
            .fallbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        map.entry(reason.to_string()).or_default()[op_index(op)] += 1;
    }

    /// Whether `reason` is new to this name's warnings (then it is one of them).
    pub fn first_warning(&self, reason: &str) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        warned.insert(reason.to_string())
    }

    fn reset(&self) {
        for counter in &self.executed {
            counter.store(0, Ordering::Relaxed);
        }
        self.fallbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

/// What the account says of one name and op.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpCount {
    /// Calls mucudnn's plans executed.
    pub mucudnn: u64,
    /// Calls PyTorch's kernel ran, by reason.
    pub pytorch: BTreeMap<String, u64>,
}

/// Every name's counters.
#[derive(Default)]
pub struct Account {
    by_name: Mutex<HashMap<Arc<str>, Arc<Counters>>>,
}

impl Account {
    /// The counters of `name` (made on first use; the same ones for every holder of the name).
    pub fn counters(&self, name: &Arc<str>) -> Arc<Counters> {
        let mut map = self.by_name.lock().unwrap_or_else(PoisonError::into_inner);
        map.entry(name.clone()).or_default().clone()
    }

    /// Name -> op -> counts, for the names and ops that counted anything.
    pub fn read(&self) -> BTreeMap<String, BTreeMap<&'static str, OpCount>> {
        let map = self.by_name.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = BTreeMap::new();
        for (name, counters) in map.iter() {
            let fallbacks = counters
                .fallbacks
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut ops = BTreeMap::new();
            for (index, op_name) in ConvOp::NAMES.iter().enumerate() {
                let mut count = OpCount {
                    mucudnn: counters.executed[index].load(Ordering::Relaxed),
                    ..OpCount::default()
                };
                for (reason, by_op) in fallbacks.iter() {
                    if by_op[index] > 0 {
                        count.pytorch.insert(reason.clone(), by_op[index]);
                    }
                }
                if count.mucudnn > 0 || !count.pytorch.is_empty() {
                    ops.insert(*op_name, count);
                }
            }
            if !ops.is_empty() {
                out.insert(name.to_string(), ops);
            }
        }
        out
    }

    /// Zeroes every count; names nobody holds any more are forgotten.
    pub fn reset(&self) {
        let mut map = self.by_name.lock().unwrap_or_else(PoisonError::into_inner);
        map.retain(|_, counters| Arc::strong_count(counters) > 1);
        for counters in map.values() {
            counters.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_name_op_and_reason_and_resets() {
        let account = Account::default();
        let a: Arc<str> = Arc::from("layer1.conv");
        let counters = account.counters(&a);
        counters.executed(ConvOp::Forward);
        counters.executed(ConvOp::Forward);
        counters.fell_back(ConvOp::BackwardData, "dtype");
        assert!(Arc::ptr_eq(&counters, &account.counters(&a)));
        let read = account.read();
        let ops = &read["layer1.conv"];
        assert_eq!(ops["fwd"].mucudnn, 2);
        assert_eq!(ops["bwd_data"].pytorch["dtype"], 1);
        assert!(!ops.contains_key("bwd_filter"));
        assert!(counters.first_warning("dtype") && !counters.first_warning("dtype"));
        account.reset();
        assert!(account.read().is_empty());
        assert!(
            !counters.first_warning("dtype"),
            "said once for the name's life"
        );
        // Held names stay (and count again); unheld ones are forgotten.
        let other: Arc<str> = Arc::from("gone");
        account.counters(&other).executed(ConvOp::Forward);
        account.reset();
        counters.executed(ConvOp::Forward);
        assert_eq!(account.read().len(), 1);
    }
}
