//! Which device measurements belong to. A fingerprint is part of every cache key and travels
//! with exported profiles, so that measurements are never mixed across GPUs, drivers or cuDNN
//! versions. Plain data: probing the device is the backends' job.

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
            write!(f, ", cuDNN {}", cudnn_version_string(cudnn))?;
        }
        Ok(())
    }
}

/// cuDNN's version number as text: 91900 -> `9.19.0` (cuDNN 9 encodes major*10000 +
/// minor*100 + patch; earlier versions major*1000 + minor*100 + patch).
pub fn cudnn_version_string(version: u64) -> String {
    let major_scale = if version >= 90000 { 10000 } else { 1000 };
    format!(
        "{}.{}.{}",
        version / major_scale,
        (version % major_scale) / 100,
        version % 100
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cudnn_versions() {
        assert_eq!(cudnn_version_string(91900), "9.19.0");
        assert_eq!(cudnn_version_string(90100), "9.1.0");
        assert_eq!(cudnn_version_string(8907), "8.9.7");
    }

    #[test]
    fn display() {
        let f = DeviceFingerprint {
            backend: BackendKind::Cuda,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: Some((9, 0)),
            driver_version: Some(13000),
            cudnn_version: Some(91900),
        };
        assert_eq!(
            f.to_string(),
            "NVIDIA H100 80GB HBM3, sm_90, driver 13.0, cuDNN 9.19.0"
        );
    }
}
