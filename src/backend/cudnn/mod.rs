//! cuDNN backend (in progress).
