//! mucudnn: micro-batching convolution autotuner.
//!
//! Data flows problem -> profile -> (cache) -> solve -> plan -> execute:
//! - the problem model, profiles and solvers live in the pure crate `mucudnn-solver`,
//!   re-exported here as [`solver`];
//! - [`backend`] measures and runs convolutions (cuDNN on the GPU, real algorithms on the CPU);
//! - [`profiler`] and [`tune`] turn problems into profiles through the cache, and plans;
//! - [`exec`] runs plans; [`layer`], [`local_tuner`], `candle` (feature `candle`) and
//!   [`c_abi`] are the integrations on top; the CLI's network files and report plots are behind
//!   feature `cli`.

pub use mucudnn_cache as cache;
pub use mucudnn_solver as solver;

pub mod backend;
pub mod c_abi;
#[cfg(feature = "candle")]
pub mod candle;
pub mod device;
pub mod exec;
pub mod explain;
pub mod layer;
pub mod local_tuner;
pub mod models;
#[cfg(feature = "cli")]
pub mod network;
pub mod profiler;
pub mod report;
#[cfg(feature = "cli")]
pub mod report_files;
pub mod torch;
pub mod tune;
