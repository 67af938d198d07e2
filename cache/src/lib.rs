//! mucudnn's persistent tuning cache. SQLite storage arrives with the cache issue; for now the
//! crate only fixes where the cache lives, so that every tool agrees on it.

use std::path::PathBuf;

/// The cache file: `$MUCUDNN_CACHE`, else `$XDG_CACHE_HOME/mucudnn/cache.sqlite`, else
/// `~/.cache/mucudnn/cache.sqlite`; `None` when no home directory is known.
pub fn default_path() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(path) = var("MUCUDNN_CACHE") {
        return Some(path);
    }
    let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|home| home.join(".cache")))?;
    Some(base.join("mucudnn").join("cache.sqlite"))
}
