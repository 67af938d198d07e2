//! The GPU building blocks of data-parallel training. So far: the TCP rendezvous that
//! bootstraps NCCL across processes and hosts ([`rendezvous`]).

pub mod rendezvous;

pub use rendezvous::{
    GpuLayout, Rendezvous, RendezvousArgs, RendezvousConfig, RendezvousError, RendezvousListener,
};
