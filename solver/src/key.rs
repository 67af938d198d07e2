//! The tuning key: what one measurement is of, and what the cache finds it by (together with
//! the device fingerprint, which stays beside it: one backend measures one device).
//!
//! Three levels, each the one below less a field:
//!
//! - [`MeasureKey`]: one unit of measuring, `kind`'s candidates of `op` on a shape at one
//!   `size` along `split` (a micro-batch size, or a chunk's rows).
//! - [`SizesKey`]: the same at every size (which sizes are measured, which are missing).
//! - [`OpKey`]: a shape, op and split, every kind and size (an [`OpProfile`](crate::OpProfile)
//!   entry's subject).
//!
//! Each carries the whole [`ConvProblem`], whose `n` is the mini-batch the sizes divide (it
//! gives a batch split its extent), but `n` is not part of the key: two keys that differ only
//! in `n` are equal, as the cache answers one with the other's rows.

use crate::algo::AlgoKind;
use crate::problem::{ConvOp, ConvProblem};
use crate::spatial::SplitDim;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::{Hash, Hasher};

/// A shape, op and split: what an [`OpProfile`](crate::OpProfile) entry measures.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct OpKey {
    /// The problem at its full mini-batch (`n` is not part of the key).
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// Batch when absent.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
}

/// [`OpKey`] and one candidate kind, at every size.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct SizesKey {
    /// The problem at its full mini-batch (`n` is not part of the key).
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// Batch when absent.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub kind: AlgoKind,
}

/// One unit of measuring: `kind`'s candidates of `op` on `problem`'s shape at `size` along
/// `split` (a micro-batch size, or a chunk's rows along the split axis).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct MeasureKey {
    /// The problem at its full mini-batch (`n` is not part of the key).
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// Batch when absent.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub size: i64,
    pub kind: AlgoKind,
}

impl OpKey {
    pub fn new(problem: ConvProblem, op: ConvOp, split: SplitDim) -> OpKey {
        OpKey { problem, op, split }
    }

    /// The batch split's key.
    pub fn batch(problem: ConvProblem, op: ConvOp) -> OpKey {
        OpKey {
            problem,
            op,
            split: SplitDim::Batch,
        }
    }

    /// What the sizes sum to ([`SplitDim::extent`]).
    pub fn extent(&self) -> i64 {
        self.split.extent(&self.problem, self.op)
    }

    /// This key for one candidate kind.
    pub fn of_kind(&self, kind: AlgoKind) -> SizesKey {
        SizesKey {
            problem: self.problem,
            op: self.op,
            split: self.split,
            kind,
        }
    }
}

impl SizesKey {
    pub fn new(problem: ConvProblem, op: ConvOp, split: SplitDim, kind: AlgoKind) -> SizesKey {
        OpKey::new(problem, op, split).of_kind(kind)
    }

    /// The batch split's key.
    pub fn batch(problem: ConvProblem, op: ConvOp, kind: AlgoKind) -> SizesKey {
        OpKey::batch(problem, op).of_kind(kind)
    }

    /// This key at one size.
    pub fn at(&self, size: i64) -> MeasureKey {
        MeasureKey {
            problem: self.problem,
            op: self.op,
            split: self.split,
            size,
            kind: self.kind,
        }
    }

    /// The key without the kind.
    pub fn op_key(&self) -> OpKey {
        OpKey {
            problem: self.problem,
            op: self.op,
            split: self.split,
        }
    }
}

impl MeasureKey {
    pub fn new(
        problem: ConvProblem,
        op: ConvOp,
        split: SplitDim,
        size: i64,
        kind: AlgoKind,
    ) -> MeasureKey {
        SizesKey::new(problem, op, split, kind).at(size)
    }

    /// A micro-batch size's key.
    pub fn batch(problem: ConvProblem, op: ConvOp, micro: i64, kind: AlgoKind) -> MeasureKey {
        SizesKey::batch(problem, op, kind).at(micro)
    }

    /// The key without the size.
    pub fn sizes(&self) -> SizesKey {
        SizesKey {
            problem: self.problem,
            op: self.op,
            split: self.split,
            kind: self.kind,
        }
    }

    /// The key without the size and the kind.
    pub fn op_key(&self) -> OpKey {
        self.sizes().op_key()
    }

    /// What the sizes sum to ([`SplitDim::extent`]).
    pub fn extent(&self) -> i64 {
        self.split.extent(&self.problem, self.op)
    }
}

/// The shape the keys compare: the problem with `n` left out.
fn shape(problem: &ConvProblem) -> ConvProblem {
    problem.with_batch(0)
}

macro_rules! identity {
    ($ty:ty, $($field:ident),+) => {
        impl PartialEq for $ty {
            fn eq(&self, other: &Self) -> bool {
                shape(&self.problem) == shape(&other.problem) $( && self.$field == other.$field )+
            }
        }
        impl Eq for $ty {}
        impl Hash for $ty {
            fn hash<H: Hasher>(&self, state: &mut H) {
                shape(&self.problem).hash(state);
                $( self.$field.hash(state); )+
            }
        }
    };
}

identity!(OpKey, op, split);
identity!(SizesKey, op, split, kind);
identity!(MeasureKey, op, split, size, kind);

/// `fwd batch`.
impl fmt::Display for OpKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op, self.split)
    }
}

/// `fwd batch legacy`.
impl fmt::Display for SizesKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.op, self.split, self.kind)
    }
}

/// `fwd batch@8 legacy`: a message names the layer before it (the key has none: the cache
/// finds a shape's measurements whatever layer it was measured for).
impl fmt::Display for MeasureKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}@{} {}", self.op, self.split, self.size, self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn n_is_not_part_of_the_key() {
        let problem = ConvProblem::new(16, 8, 14, 14, 8, 3, 3);
        let key = MeasureKey::batch(problem, ConvOp::Forward, 4, AlgoKind::Legacy);
        let other = MeasureKey {
            problem: problem.with_batch(32),
            ..key
        };
        assert_eq!(key, other);
        assert_eq!(HashSet::from([key, other]).len(), 1);
        assert_ne!(key, MeasureKey { size: 8, ..key });
        assert_ne!(
            key,
            MeasureKey {
                split: SplitDim::Spatial,
                ..key
            }
        );
        assert_eq!(key.sizes().at(4), key);
        assert_eq!(key.op_key().of_kind(AlgoKind::Legacy), key.sizes());
        assert_eq!(key.extent(), 16);
    }

    #[test]
    fn display_and_serde() {
        let problem = ConvProblem::new(16, 8, 14, 14, 8, 3, 3);
        let key = MeasureKey::batch(problem, ConvOp::Forward, 8, AlgoKind::Legacy);
        assert_eq!(key.to_string(), "fwd batch@8 legacy");
        assert_eq!(key.sizes().to_string(), "fwd batch legacy");
        assert_eq!(key.op_key().to_string(), "fwd batch");
        let json = serde_json::to_string(&key).unwrap();
        assert!(!json.contains("split"), "{json}");
        let back: MeasureKey = serde_json::from_str(&json).unwrap();
        assert_eq!(back, key);
        assert_eq!(back.problem.n, 16);
    }
}
