//! This machine's CPU as a device: the fingerprint of the CPU backend's measurements.
//! The fingerprint type itself is plain data in the core crate.

pub use crate::solver::device::{cudnn_version_string, BackendKind, DeviceFingerprint};

/// The fingerprint of this machine's CPU backend: the CPU model and the crate version (whose
/// algorithms the measurements are of).
pub fn cpu_fingerprint() -> DeviceFingerprint {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    DeviceFingerprint {
        backend: BackendKind::Cpu,
        name: format!("cpu: {model} (mucudnn {})", env!("CARGO_PKG_VERSION")),
        compute_capability: None,
        driver_version: None,
        cudnn_version: None,
    }
}
