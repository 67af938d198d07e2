//! Backends that measure and run convolutions: [`cudnn`] on NVIDIA GPUs, [`cpu`] everywhere.

pub mod cpu;
pub mod cudnn;
