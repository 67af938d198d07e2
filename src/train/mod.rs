//! Training: a small CNN trained data-parallel with mucudnn's micro-batched convolutions.

pub mod gpu;
