//! The binary against a corpus of bad inputs (issue 14): each must exit non-zero with one clear
//! error message, never a panic, before measuring anything, and leave every input file
//! byte-for-byte as it was (a cache path that is not a cache included).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/h100-alexnet-profile.json"
);
const OTHER_PROGRAM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/other-program.sqlite"
);
const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/networks/tiny.toml");

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mucudnn-hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every file under `dir`, path -> bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(snapshot(&path));
        } else {
            files.insert(path.clone(), std::fs::read(&path).unwrap());
        }
    }
    files
}

/// The hostile files: written once, then checked after every command.
struct Corpus {
    dir: PathBuf,
}

impl Corpus {
    fn new() -> Corpus {
        let dir = temp_dir();
        let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).unwrap();
        // Another program's SQLite database with a table named like one of ours (`plans`,
        // which the old migration dropped) and one of its own.
        std::fs::copy(OTHER_PROGRAM, dir.join("other.sqlite")).unwrap();
        write(
            "profile-as-cache.json",
            br#"{"format": "mucudnn-profile-v1"}"#,
        );
        write("garbage.bin", &[0xA5; 5000]);
        write("empty.json", b"");
        write("truncated.json", &std::fs::read(FIXTURE).unwrap()[..700]);
        write("not-json.json", b"layer = 1\n");
        write(
            "wrong-format.json",
            br#"{"format": "something-else", "entries": []}"#,
        );
        write(
            "bad-network.toml",
            b"[[layer]]\nname = \"c\"\nin_channels = 0\nout_channels = 8\ninput = 8\nkernel = 3\n",
        );
        write("not-toml.toml", b"[[layer\nname = ");
        write(
            "huge-kernel.toml",
            b"[[layer]]\nname = \"c\"\nin_channels = 3\nout_channels = 8\ninput = 4\nkernel = 9\n",
        );
        Corpus { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

/// Runs the binary with `cache` as the cache; checks the contract; returns stderr.
fn refuses(corpus: &Corpus, cache: &str, args: &[&str], expect: &str) -> String {
    let before = snapshot(&corpus.dir);
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .env("MUCUDNN_CACHE", cache)
        .output()
        .expect("the binary runs");
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let what = format!("mucudnn {}\n{stderr}", args.join(" "));
    assert!(!output.status.success(), "succeeded: {what}");
    assert!(
        matches!(output.status.code(), Some(1 | 2)),
        "{:?}: {what}",
        output.status
    );
    assert!(!stderr.contains("panicked at"), "{what}");
    assert!(!stderr.contains("RUST_BACKTRACE"), "{what}");
    let errors = stderr
        .lines()
        .filter(|line| line.starts_with("error"))
        .count();
    assert_eq!(errors, 1, "one error message: {what}");
    assert!(stderr.contains(expect), "expected {expect:?}: {what}");
    assert!(
        elapsed < Duration::from_secs(20),
        "refused only after {elapsed:?} (measuring first?): {what}"
    );
    assert!(
        snapshot(&corpus.dir) == before,
        "the inputs changed: {what}"
    );
    stderr
}

#[test]
fn every_bad_input_is_one_clear_error_and_changes_nothing() {
    let corpus = Corpus::new();
    let fresh = corpus.dir.join("fresh-cache-dir").join("cache.sqlite");
    let fresh = fresh.to_str().unwrap();
    let p = |name: &str| corpus.path(name);
    let not_ours = "is not a mucudnn cache";

    // Caches that are not ours, through every command that opens one.
    for cache in ["other.sqlite", "profile-as-cache.json", "garbage.bin"] {
        let cache = p(cache);
        for args in [
            vec!["cache", "show"],
            vec!["cache", "list", "--json"],
            vec!["cache", "export", "/nonexistent/x.json", "--device", "cpu"],
            vec!["cache", "import", FIXTURE, "--force", "--device", "cpu"],
            vec!["cache", "clear"],
            vec!["tune", "--network", TINY, "--batch", "2", "--device", "cpu"],
        ] {
            refuses(&corpus, &cache, &args, not_ours);
        }
        // An explicit --cache wins over the environment and is refused the same way.
        refuses(
            &corpus,
            fresh,
            &["cache", "--cache", &cache, "show"],
            not_ours,
        );
    }

    // Bad profiles.
    for (name, expect) in [
        ("empty.json", "not a usable profile"),
        ("truncated.json", "not a usable profile"),
        ("not-json.json", "not a usable profile"),
        ("wrong-format.json", "not a usable profile"),
        ("garbage.bin", "cannot read profile"),
        ("missing.json", "cannot read profile"),
    ] {
        let profile = p(name);
        refuses(&corpus, fresh, &["solve", "--profile", &profile], expect);
        refuses(
            &corpus,
            fresh,
            &["cache", "import", &profile, "--device", "cpu"],
            expect,
        );
        refuses(
            &corpus,
            fresh,
            &[
                "explain",
                "--profile",
                &profile,
                "--layer",
                "x",
                "--op",
                "fwd",
            ],
            expect,
        );
    }

    // Bad network files.
    for name in [
        "bad-network.toml",
        "not-toml.toml",
        "huge-kernel.toml",
        "missing.toml",
    ] {
        let network = p(name);
        refuses(
            &corpus,
            fresh,
            &[
                "tune",
                "--network",
                &network,
                "--batch",
                "2",
                "--device",
                "cpu",
            ],
            "error",
        );
    }

    // Arguments that once panicked or were refused only after measuring (items 4 and 8).
    for limit in ["1e19", "inf", "NaN", "0", "-1", "ten"] {
        refuses(
            &corpus,
            fresh,
            &[
                "solve",
                "--profile",
                FIXTURE,
                "--total-workspace",
                "1GiB",
                "--ilp-time-limit",
                limit,
            ],
            "--ilp-time-limit",
        );
        refuses(
            &corpus,
            fresh,
            &[
                "tune",
                "--network",
                TINY,
                "--batch",
                "2",
                "--device",
                "cpu",
                "--ilp-time-limit",
                limit,
            ],
            "--ilp-time-limit",
        );
    }
    refuses(
        &corpus,
        fresh,
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--candidates",
            "engines",
        ],
        "nothing was measured",
    );
    refuses(
        &corpus,
        fresh,
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "fp16",
            "--verify",
        ],
        "nothing was measured",
    );
    refuses(
        &corpus,
        fresh,
        &["tune", "--network", TINY, "--batch", "0", "--device", "cpu"],
        "--batch",
    );
    refuses(
        &corpus,
        fresh,
        &["tune", "--network", TINY, "--device", "cpu"],
        "--batch",
    );
    refuses(
        &corpus,
        fresh,
        &["solve", "--profile", FIXTURE, "--workspace-limit", "64MB"],
        "error",
    );
    refuses(&corpus, fresh, &["solve"], "--profile");
    // A negative size is a bad value, not "an unexpected argument" (item 10).
    refuses(
        &corpus,
        fresh,
        &["solve", "--profile", FIXTURE, "--workspace-limit", "-1"],
        "--workspace-limit",
    );

    // Nothing above created a cache: no command got far enough to need one, and the
    // read-only ones never create.
    assert!(
        !Path::new(fresh).exists(),
        "a refused command created {fresh}"
    );
    std::fs::remove_dir_all(&corpus.dir).ok();
}
