//! CPU convolution backend (in progress).
