//! [`EngineConfig`]: one engine configuration of cuDNN's graph (backend) API, named the way
//! NVIDIA's cuDNN frontend names execution plans (`eng38_k2=8_k13=1_k14=4_k18=0`).
//!
//! The type and the grammar of its names live in the solver
//! ([`crate::solver::algo::EngineConfig`]), beside the interned [`crate::solver::EngineName`]
//! that profiles, plans and the cache hold, so that one parser and one printer serve both; the
//! wall (`wall/graph.rs`) turns a config into descriptors.

pub use crate::solver::algo::{EngineConfig, EngineConfigError as EngineNameError};
