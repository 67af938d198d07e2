//! Which tuning cache the ranks' conv layers share.
//!
//! Every [`Conv2d`](crate::exec::conv2d::Conv2d) owns a [`Cache`] connection (a cache is not
//! `Sync`), so sharing means opening the same SQLite file from every layer of every rank. The
//! file supports concurrent writers, and the driver makes rank 0 tune first so that the other
//! ranks find its plans instead of measuring the same shapes again. A run that must keep
//! nothing uses a [`TempCache`]: a private file, removed when the run ends.

use super::TrainError;
use mucudnn_cache::Cache;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Where conv layers read and store their tuning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheChoice {
    /// One SQLite file, shared by every layer of every rank (and kept).
    File(PathBuf),
    /// A separate in-memory cache per layer: nothing is shared, so every rank tunes alone.
    Memory,
}

impl CacheChoice {
    /// Opens a connection for one layer. Fails only when the file is not a mucudnn cache (see
    /// [`Cache::open`]).
    pub fn open(&self) -> Result<Cache, TrainError> {
        match self {
            CacheChoice::File(path) => Ok(Cache::open(path)?),
            CacheChoice::Memory => Ok(Cache::in_memory()),
        }
    }

    /// The user's cache file (`$MUCUDNN_CACHE`, else the user's cache directory), or `None`
    /// when there is no home directory to put it in.
    pub fn user_default() -> Option<CacheChoice> {
        mucudnn_cache::default_path().map(CacheChoice::File)
    }
}

/// A cache file private to one run, in the system's temporary directory, deleted (with its
/// WAL and shared-memory files) on drop.
#[derive(Debug)]
pub struct TempCache {
    dir: PathBuf,
}

impl TempCache {
    pub fn new() -> Result<TempCache, TrainError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "mucudnn-train-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| {
            TrainError::Config(format!(
                "cannot make a private tuning cache in {}: {e}",
                dir.display()
            ))
        })?;
        Ok(TempCache { dir })
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("cache.sqlite")
    }

    pub fn choice(&self) -> CacheChoice {
        CacheChoice::File(self.path())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        // Best effort: a leftover file in the temporary directory harms nothing.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_cache_is_a_shared_file_removed_on_drop() {
        let temp = TempCache::new().unwrap();
        let dir = temp.dir().to_path_buf();
        let choice = temp.choice();
        let cache = choice.open().unwrap();
        assert_eq!(
            cache.location(),
            &mucudnn_cache::Location::File(temp.path())
        );
        drop(cache);
        assert!(dir.exists());
        drop(temp);
        assert!(!dir.exists());
        assert_ne!(
            TempCache::new().unwrap().path(),
            TempCache::new().unwrap().path()
        );
    }
}
