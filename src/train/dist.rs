//! Multi-process settings: which rank this process is, of how many, and where rank 0 listens
//! for the rendezvous. Read from flags, else from the environment variables torchrun sets
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), else defaults for a
//! single process. Flags win over the environment.
//!
//! The CPU trainer runs its ranks as threads of one process, so it accepts only a world of
//! one process here; the GPU trainer (one process per GPU, NCCL) uses these settings.

use super::TrainError;

/// Settings as given on the command line (`None`: not given).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DistFlags {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

/// This process's place in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DistConfig {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes of this machine (which GPU to use).
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistConfig {
    pub const DEFAULT_MASTER_ADDR: &'static str = "127.0.0.1";
    /// PyTorch's default rendezvous port.
    pub const DEFAULT_MASTER_PORT: u16 = 29500;

    /// A single process.
    pub fn single() -> Self {
        DistConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: Self::DEFAULT_MASTER_ADDR.into(),
            master_port: Self::DEFAULT_MASTER_PORT,
        }
    }

    /// Flags, else this process's environment, else defaults.
    pub fn from_flags_and_env(flags: &DistFlags) -> Result<Self, TrainError> {
        Self::resolve(flags, |name| std::env::var(name).ok())
    }

    /// Flags, else `env(NAME)`, else defaults; checked for consistency.
    pub fn resolve(
        flags: &DistFlags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TrainError> {
        let from_env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let number = |name: &str, flag: Option<usize>| -> Result<Option<usize>, TrainError> {
            match (flag, from_env(name)) {
                (Some(value), _) => Ok(Some(value)),
                (None, Some(text)) => text.trim().parse().map(Some).map_err(|_| {
                    TrainError::Dist(format!("{name}={text:?} is not a non-negative integer"))
                }),
                (None, None) => Ok(None),
            }
        };
        let world_size = number("WORLD_SIZE", flags.world_size)?.unwrap_or(1);
        let rank = number("RANK", flags.rank)?;
        let local_rank = number("LOCAL_RANK", flags.local_rank)?;
        let master_addr = match (&flags.master_addr, from_env("MASTER_ADDR")) {
            (Some(addr), _) => addr.clone(),
            (None, Some(addr)) => addr.trim().to_string(),
            (None, None) => Self::DEFAULT_MASTER_ADDR.to_string(),
        };
        let master_port = match (flags.master_port, from_env("MASTER_PORT")) {
            (Some(port), _) => port,
            (None, Some(text)) => text.trim().parse().map_err(|_| {
                TrainError::Dist(format!(
                    "MASTER_PORT={text:?} is not a port number (1-65535)"
                ))
            })?,
            (None, None) => Self::DEFAULT_MASTER_PORT,
        };

        if world_size == 0 {
            return Err(TrainError::Dist(
                "the world size (--world-size or WORLD_SIZE) must be at least 1".into(),
            ));
        }
        let rank = match rank {
            Some(rank) => rank,
            None if world_size == 1 => 0,
            None => {
                return Err(TrainError::Dist(format!(
                    "the world has {world_size} processes: give each its --rank (or RANK)"
                )))
            }
        };
        if rank >= world_size {
            return Err(TrainError::Dist(format!(
                "rank {rank} does not exist in a world of {world_size} (ranks are 0 to {})",
                world_size - 1
            )));
        }
        let local_rank = local_rank.unwrap_or(if world_size == 1 { 0 } else { rank });
        if local_rank >= world_size {
            return Err(TrainError::Dist(format!(
                "local rank {local_rank} is not below the world size {world_size}"
            )));
        }
        if master_port == 0 {
            return Err(TrainError::Dist(
                "the master port (--master-port or MASTER_PORT) must be 1-65535, not 0".into(),
            ));
        }
        if master_addr.is_empty() {
            return Err(TrainError::Dist(
                "the master address (--master-addr or MASTER_ADDR) is empty".into(),
            ));
        }
        Ok(DistConfig {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// Whether the job spans several processes.
    pub fn is_multi_process(&self) -> bool {
        self.world_size > 1
    }

    /// `addr:port` of rank 0's rendezvous (IPv6 addresses in brackets).
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve(flags: DistFlags, env: &[(&str, &str)]) -> Result<DistConfig, TrainError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistConfig::resolve(&flags, |name| env.get(name).cloned())
    }

    #[test]
    fn defaults_are_a_single_process() {
        let config = resolve(DistFlags::default(), &[]).unwrap();
        assert_eq!(config, DistConfig::single());
        assert!(!config.is_multi_process());
        assert_eq!(config.master_endpoint(), "127.0.0.1:29500");
    }

    #[test]
    fn torchrun_environment_and_flags_over_it() {
        let env = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ];
        let config = resolve(DistFlags::default(), &env).unwrap();
        assert_eq!(
            config,
            DistConfig {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 1234
            }
        );
        assert!(config.is_multi_process());
        let flags = DistFlags {
            rank: Some(5),
            master_addr: Some("::1".into()),
            ..DistFlags::default()
        };
        let config = resolve(flags, &env).unwrap();
        assert_eq!((config.rank, config.world_size), (5, 8));
        assert_eq!(config.master_endpoint(), "[::1]:1234");
    }

    #[test]
    fn inconsistent_settings_name_the_problem() {
        type Case = (
            DistFlags,
            &'static [(&'static str, &'static str)],
            &'static str,
        );
        let cases: [Case; 6] = [
            (DistFlags::default(), &[("WORLD_SIZE", "two")], "WORLD_SIZE"),
            (DistFlags::default(), &[("WORLD_SIZE", "2")], "--rank"),
            (
                DistFlags::default(),
                &[("WORLD_SIZE", "2"), ("RANK", "2")],
                "rank 2",
            ),
            (
                DistFlags::default(),
                &[("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                DistFlags {
                    world_size: Some(0),
                    ..DistFlags::default()
                },
                &[],
                "at least 1",
            ),
            (
                DistFlags {
                    master_port: Some(0),
                    ..DistFlags::default()
                },
                &[],
                "port",
            ),
        ];
        for (flags, env, expected) in cases {
            let error = resolve(flags, env).unwrap_err().to_string();
            assert!(error.contains(expected), "{error:?} lacks {expected:?}");
        }
    }
}
