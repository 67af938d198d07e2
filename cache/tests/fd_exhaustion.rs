//! A process out of file descriptors: opening a cache is an error (`OutOfResources`), never an
//! in-memory stand-in that would keep nothing without anyone noticing, and nothing on disk is
//! touched. A test binary of its own, with one test: it lowers its process's RLIMIT_NOFILE,
//! which no other test may share.

use mucudnn_cache::{Cache, Location, OpenFailure};
use std::fs::File;
use std::path::Path;

fn set_open_files_limit(soft: u64) -> libc::rlimit {
    // SAFETY: getrlimit and setrlimit write and read one rlimit struct we own.
    unsafe {
        let mut old = std::mem::zeroed::<libc::rlimit>();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let new = libc::rlimit {
            rlim_cur: soft.min(old.rlim_max),
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &new), 0);
        old
    }
}

fn restore_open_files_limit(old: &libc::rlimit) {
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, old) }, 0);
}

fn open_files() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_process_out_of_file_descriptors_cannot_open_a_cache_and_says_so() {
    let dir = std::env::temp_dir().join(format!("mucudnn-cache-fds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let existing = dir.join("existing.sqlite");
    drop(Cache::open(&existing).unwrap());
    let before = names(&dir);

    let old = set_open_files_limit(open_files() + 16);
    let mut held = Vec::new();
    let full = loop {
        match File::open("/dev/null") {
            Ok(file) => held.push(file),
            Err(e) => break e,
        }
    };
    assert_eq!(full.raw_os_error(), Some(libc::EMFILE), "{full}");
    // 0, 1 and 2 descriptors free: fewer than a cache's three (database, WAL, index).
    let mut outcomes = Vec::new();
    for free in 0..3 {
        let mut freed = Vec::new();
        for _ in 0..free {
            freed.push(held.pop().unwrap());
        }
        drop(freed);
        for path in [dir.join("new.sqlite"), existing.clone()] {
            let outcome = match Cache::open(&path) {
                Err(OpenFailure::OutOfResources(e)) => {
                    assert_eq!(e.path, path);
                    assert!(e.to_string().contains("cannot open more files"), "{e}");
                    "refused".to_string()
                }
                Ok(cache) => match cache.location() {
                    Location::File(_) => "opened".to_string(),
                    memory => format!("{free} free: {} in memory: {memory}", path.display()),
                },
                Err(other) => format!("{free} free: {}: {other}", path.display()),
            };
            outcomes.push(outcome);
        }
        while let Ok(file) = File::open("/dev/null") {
            held.push(file);
        }
    }
    drop(held);
    restore_open_files_limit(&old);
    // Never a stand-in in memory nor another error; with nothing free, always refused.
    assert!(
        outcomes.iter().all(|o| o == "refused" || o == "opened"),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[..2], ["refused", "refused"], "{outcomes:?}");
    // Nothing was moved aside or created, but for SQLite's own side files of the existing
    // cache (an empty WAL left by an open that got its database and WAL, not its index).
    let after: Vec<String> = names(&dir)
        .into_iter()
        .filter(|name| !name.ends_with("-wal") && !name.ends_with("-shm"))
        .collect();
    assert_eq!(after, before);
    // With descriptors again, both open as files.
    for path in [dir.join("new.sqlite"), existing] {
        let cache = Cache::open(&path).unwrap();
        assert!(matches!(cache.location(), Location::File(_)));
    }
    std::fs::remove_dir_all(dir).ok();
}
