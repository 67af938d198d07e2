//! Which device measurements belong to. A fingerprint is part of every cache key and is
//! written into profiles, so that measurements are never mixed across GPUs, drivers or
//! cuDNN versions.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The kind of backend that measured or runs a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cuda,
    Cpu,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Cpu => "cpu",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that decides whether two measurements are comparable.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceFingerprint {
    pub backend: BackendKind,
    /// GPU name as CUDA reports it, or the CPU model name.
    pub name: String,
    /// (major, minor) for a GPU.
    pub compute_capability: Option<(u32, u32)>,
    /// CUDA driver version as `cuDriverGetVersion` reports it (e.g. 13000).
    pub driver_version: Option<u32>,
    /// cuDNN version as `cudnnGetVersion` reports it (e.g. 91900).
    pub cudnn_version: Option<u64>,
}

impl DeviceFingerprint {
    /// The fingerprint of this machine's CPU backend: the CPU model and the crate version
    /// (whose algorithms the measurements are of).
    pub fn cpu() -> Self {
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
}

impl fmt::Display for DeviceFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        if let Some((major, minor)) = self.compute_capability {
            write!(f, ", sm_{major}{minor}")?;
        }
        if let Some(driver) = self.driver_version {
            write!(f, ", driver {}.{}", driver / 1000, (driver % 1000) / 10)?;
        }
        if let Some(cudnn) = self.cudnn_version {
            write!(f, ", cuDNN {}", crate::report::cudnn_version_string(cudnn))?;
        }
        Ok(())
    }
}
