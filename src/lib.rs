//! mucudnn
