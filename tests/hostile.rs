//! The binary against a corpus of bad inputs: each must exit non-zero with one clear
//! error message, never a panic, before measuring anything, and leave every input file
//! byte-for-byte as it was (a cache path that is not a cache included). The corpus kept as files
//! is `tests/fixtures/hostile` (network files, profiles); cache forgeries are written row by row
//! into a cache the binary made; a class of bad input found later gets a file or a row here.

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
/// The hostile corpus kept as files: network files and profiles of each class found so far.
const HOSTILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hostile");

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
        // mucudnn's own `fingerprint` key, malformed: not "no fingerprint".
        let record = r#"{"layer": "a", "dtype": "fp32", "layout": "nchw", "n": 1, "c": 2, "h": 5, "w": 5, "k": 2, "r": 3, "s": 3, "pad_h": 0, "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 1, "micro": 1, "workspace_bytes": 0, "time_ms": 0.5}"#;
        write(
            "bad-fingerprint.json",
            format!(r#"{{"format": "mucudnn-profile-v1", "device": "cpu", "fingerprint": {{"backend": "cpu"}}, "records": [{record}]}}"#).as_bytes(),
        );
        write(
            "huge-count.toml",
            b"[[layer]]\nname = \"c\"\nin_channels = 3\nout_channels = 8\ninput = 4\nkernel = 1\ncount = 4294967296\n",
        );
        write(
            "huge-kernel.toml",
            b"[[layer]]\nname = \"c\"\nin_channels = 3\nout_channels = 8\ninput = 4\nkernel = 9\n",
        );
        // The corpus kept as files (tests/fixtures/hostile): network files, profiles.
        for entry in std::fs::read_dir(HOSTILE).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
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
    // Each part of the message once: not "EOF while ...: EOF while ...".
    let line = stderr
        .lines()
        .find(|line| line.starts_with("error"))
        .unwrap_or_default();
    let parts: Vec<&str> = line.split(": ").filter(|part| part.len() > 8).collect();
    for (i, part) in parts.iter().enumerate() {
        assert!(
            !parts[i + 1..].contains(part),
            "{part:?} is printed twice: {what}"
        );
    }
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
        (
            "bad-fingerprint.json",
            "is not a mucudnn device fingerprint",
        ),
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

    // Output paths that cannot be written are refused before measuring, not after the tune.
    for (flag, path, expect) in [
        (
            "--save-profile",
            "/nonexistent/dir/profile.json",
            "cannot create it",
        ),
        (
            "--save-profile",
            corpus.dir.to_str().unwrap(),
            "it is a directory",
        ),
        (
            "--report",
            &p("garbage.bin"),
            "cannot make the report folder",
        ),
    ] {
        let message = refuses(
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
                flag,
                path,
            ],
            expect,
        );
        assert!(message.contains("nothing was measured"), "{message}");
        assert!(!message.contains("[   "), "it measured first: {message}");
    }

    // Negative and zero sizes are values, refused with the model's own form and example
    // (they were unknown arguments, and `--input 0` showed r3d_18's example for every model).
    for (args, expect) in [
        (
            "--model wav2vec2_fe --input 0 --batch 1",
            "--input for wav2vec2_fe: 0 is not a positive size (expected SAMPLES of audio; default 16000)",
        ),
        (
            "--model wan21_vae_decoder --input 0x480x832 --batch 1",
            "default 17x480x832",
        ),
        (
            "--model r3d_18 --input -5x112x112 --batch 1",
            "--input for r3d_18: -5 is not a positive size",
        ),
        (
            "--model r3d_18 --channel-divisor -2 --batch 1",
            "--channel-divisor -2 for r3d_18",
        ),
        ("--model r3d_18 --batch -3", "--batch must be at least 1, got -3"),
    ] {
        let mut args: Vec<&str> = args.split(' ').collect();
        args.splice(0..0, ["tune"]);
        args.extend(["--device", "cpu"]);
        refuses(&corpus, fresh, &args, expect);
    }

    // A tiny profile with a huge extent: refused by name, quickly, allocating little.
    for args in [
        vec!["solve", "--profile"],
        vec!["explain", "--layer", "huge", "--op", "fwd", "--profile"],
    ] {
        let huge = p("huge-extent.json");
        refuses(
            &corpus,
            fresh,
            &[&args[..], &[huge.as_str()]].concat(),
            "an extent of 1073741824 is too large to solve",
        );
    }

    // Bad network files.
    for (name, expect) in [
        ("bad-network.toml", "in_channels"),
        ("not-toml.toml", "TOML syntax error"),
        ("huge-kernel.toml", "kernel"),
        ("huge-count.toml", "4294967296 is too large"),
        ("missing.toml", "cannot read network file"),
        (
            "transposed-output-padding.toml",
            "field `output_padding`: 2 is not smaller than the stride (1)",
        ),
        (
            "transposed-huge-stride.toml",
            "field `stride`: 4611686018427387904 is too large",
        ),
        (
            "video-past-2-pow-31.toml",
            "a chunk's view spans every sample of the batch",
        ),
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
            expect,
        );
    }

    // Arguments that once panicked or were refused only after measuring.
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
    // A negative size is a bad value, not "an unexpected argument".
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

/// A batch whose buffers cannot fit is refused before anything is allocated
/// (it used to abort with "memory allocation of 4000000000 bytes failed"), here under a 4 GiB
/// address-space limit as a memory-limited user would run it.
#[cfg(target_os = "linux")]
#[test]
fn a_batch_that_cannot_fit_is_refused_before_allocating() {
    let dir = std::env::temp_dir().join(format!("mucudnn-huge-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let network = dir.join("one-1x1-layer.toml");
    std::fs::write(
        &network,
        "[[layer]]\nname = \"c\"\nin_channels = 1\nout_channels = 1\ninput = 1\nkernel = 1\n",
    )
    .unwrap();
    let started = Instant::now();
    let output = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_mucudnn"))
        .args(["tune", "--network", network.to_str().unwrap()])
        .args(["--batch", "1000000000", "--device", "cpu", "--no-cache"])
        .output()
        .expect("sh runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("memory allocation"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("the CPU backend's full-batch buffers need 11.2 GiB")
            && stderr.contains("of host memory is available (tune a smaller --batch)"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().filter(|l| l.starts_with("error")).count(), 1);
    assert!(started.elapsed() < Duration::from_secs(20));
    std::fs::remove_dir_all(&dir).ok();
}

/// A 663-byte profile whose mini-batch is 2^30 (sizes 1 and 2^30): the WR solver made DP
/// tables of 16 bytes per row of the extent with an infallible allocation, and `solve`
/// aborted (SIGABRT) under a 4 GiB address-space limit. Its cost now follows the sizes, and
/// sizes that make up too many partial sums are refused by the problem's name.
#[cfg(target_os = "linux")]
#[test]
fn a_huge_extent_in_a_tiny_profile_is_refused_not_an_abort() {
    let profile = format!("{HOSTILE}/huge-extent.json");
    let started = Instant::now();
    let output = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_mucudnn"))
        .args(["solve", "--profile", &profile, "--policy", "power-of-two"])
        .output()
        .expect("sh runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("huge fp32 nchw fwd: an extent of 1073741824 is too large to solve"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().filter(|l| l.starts_with("error")).count(), 1);
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Runs the binary with `cache` as `MUCUDNN_CACHE`, killing it after 60 s (a command that
/// blocks on a FIFO would otherwise hang the test run); returns (status code, stdout, stderr).
fn run_bounded(cache: &str, args: &[&str]) -> (Option<i32>, String, String) {
    use std::process::Stdio;
    let child = Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .env("MUCUDNN_CACHE", cache)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // The pipes are read while it runs (a long table would fill them and stall it).
    let pid = child.id();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    let output = match receiver.recv_timeout(Duration::from_secs(60)) {
        Ok(output) => output.expect("output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("mucudnn {} with cache {cache} hung", args.join(" "));
        }
    };
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A cache path that exists and is not a regular file is refused before
/// anything opens it. A FIFO used to hang every command, read-only ones included (opening a
/// FIFO for reading waits for a writer); a character device (`/dev/null`) used to be opened
/// by SQLite, which left `/dev/null-journal` behind.
#[cfg(unix)]
#[test]
fn a_cache_path_that_is_not_a_regular_file_is_refused_before_any_open() {
    use std::os::unix::fs::FileTypeExt;
    let dir = std::env::temp_dir().join(format!("mucudnn-hostile-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("cache.fifo");
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let journal = Path::new("/dev/null-journal");
    let journal_before = journal.exists();
    let commands: [&[&str]; 6] = [
        &["cache", "show"],
        &["cache", "list", "--json"],
        &["cache", "export", "/nonexistent/x.json", "--device", "cpu"],
        &["cache", "import", FIXTURE, "--force", "--device", "cpu"],
        &["cache", "clear"],
        &["tune", "--network", TINY, "--batch", "2", "--device", "cpu"],
    ];
    for (cache, what) in [
        (
            fifo.to_str().unwrap(),
            "it is a FIFO (named pipe), not a regular file",
        ),
        ("/dev/null", "it is a character device, not a regular file"),
    ] {
        for args in commands {
            let (code, _, stderr) = run_bounded(cache, args);
            let context = format!("mucudnn {} with cache {cache}:\n{stderr}", args.join(" "));
            assert_eq!(code, Some(1), "{context}");
            assert!(!stderr.contains("panicked at"), "{context}");
            assert_eq!(
                stderr.lines().filter(|l| l.starts_with("error")).count(),
                1,
                "{context}"
            );
            assert!(
                stderr.contains("is not a mucudnn cache") && stderr.contains(what),
                "{context}"
            );
        }
    }
    // Left as they were: the FIFO is still the only thing in its directory, still a FIFO,
    // and nothing was written beside /dev/null.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [fifo.file_name().unwrap()]);
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    if !journal_before {
        assert!(
            !journal.exists(),
            "a command left {} behind",
            journal.display()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A layer name of 65,536 characters is printed, not a panic: `format!`'s
/// `{:width$}` panics past a width of 65,535, which the tables used to pad their columns.
/// `solve`, `report`, `explain` (from a profile) and `tune` (from a network file) all work.
#[test]
fn a_layer_name_of_65536_characters_is_printed_not_a_panic() {
    let dir = std::env::temp_dir().join(format!("mucudnn-hostile-long-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let long = "x".repeat(65_536);
    let record = |algo: u32, micro: i64, time: f64| {
        format!(
            r#"{{"layer": "{long}", "dtype": "fp32", "layout": "nchw", "n": 2, "c": 2, "h": 5, "w": 5, "k": 2, "r": 3, "s": 3, "pad_h": 0, "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1, "op": "fwd", "algo": {algo}, "micro": {micro}, "workspace_bytes": 0, "time_ms": {time}}}"#
        )
    };
    let records = [record(0, 1, 0.5), record(0, 2, 0.8), record(1, 2, 0.9)].join(", ");
    let profile = dir.join("long.json");
    std::fs::write(
        &profile,
        format!(r#"{{"format": "mucudnn-profile-v1", "device": "cpu", "records": [{records}]}}"#),
    )
    .unwrap();
    let profile = profile.to_str().unwrap();
    let network = dir.join("long.toml");
    std::fs::write(
        &network,
        format!(
            "[[layer]]\nname = \"{long}\"\nin_channels = 1\nout_channels = 1\ninput = 3\nkernel = 1\n"
        ),
    )
    .unwrap();
    let network = network.to_str().unwrap();
    let report = dir.join("report");
    let cache = dir.join("cache.sqlite");
    for args in [
        vec!["solve", "--profile", profile],
        vec!["solve", "--profile", profile, "--json"],
        vec![
            "report",
            "--profile",
            profile,
            "--out",
            report.to_str().unwrap(),
        ],
        vec![
            "explain",
            "--profile",
            profile,
            "--layer",
            &long,
            "--op",
            "fwd",
        ],
        vec![
            "tune",
            "--network",
            network,
            "--batch",
            "1",
            "--device",
            "cpu",
            "--quiet",
        ],
    ] {
        let (code, stdout, stderr) = run_bounded(cache.to_str().unwrap(), &args);
        let what = format!("mucudnn {}: {}", args[0], &stderr[..stderr.len().min(2000)]);
        assert!(!stderr.contains("panicked"), "{what}");
        assert_eq!(code, Some(0), "{what}");
        assert!(stdout.contains(&long), "{what}: the name is printed whole");
    }
    assert!(report.join("report.md").is_file());
    std::fs::remove_dir_all(&dir).ok();
}

/// Control characters of a layer name never reach the terminal raw: a
/// network file's name with an escape sequence is refused with the name escaped (`\u{1b}`),
/// in the one error line, wherever the message names the layer.
#[test]
fn control_characters_of_a_layer_name_are_escaped_in_errors() {
    let corpus = Corpus::new();
    let network = corpus.dir.join("escape.toml");
    // TOML's \u001b is the ESC character inside the name.
    std::fs::write(
        &network,
        "[[layer]]\nname = \"a\\u001b[31mred\\u0007\"\nin_channels = 1\nout_channels = 1\ninput = 3\nkernel = 1\n",
    )
    .unwrap();
    let network = network.to_str().unwrap().to_string();
    let fresh = corpus.dir.join("fresh").join("cache.sqlite");
    let stderr = refuses(
        &corpus,
        fresh.to_str().unwrap(),
        &[
            "tune",
            "--network",
            &network,
            "--batch",
            "1",
            "--device",
            "cpu",
        ],
        "contains whitespace or control characters",
    );
    assert!(
        !stderr.contains('\u{1b}') && !stderr.contains('\u{7}'),
        "{stderr:?}"
    );
    assert!(stderr.contains("a\\u{1b}[31mred\\u{7}"), "{stderr:?}");
    // A profile's layer name in a solver error (a bad time) is escaped the same way.
    let profile = corpus.dir.join("escape.json");
    std::fs::write(
        &profile,
        r#"{"format": "mucudnn-profile-v1", "device": "cpu", "records": [{"layer": "b\u001b[2J", "dtype": "fp32", "layout": "nchw", "n": 1, "c": 2, "h": 5, "w": 5, "k": 2, "r": 3, "s": 3, "pad_h": 0, "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 1, "micro": 1, "workspace_bytes": 0, "time_ms": 0}]}"#,
    )
    .unwrap();
    let profile = profile.to_str().unwrap().to_string();
    let stderr = refuses(
        &corpus,
        fresh.to_str().unwrap(),
        &["solve", "--profile", &profile],
        "not a usable profile",
    );
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    std::fs::remove_dir_all(&corpus.dir).ok();
}

/// Cache forgeries: rows no measurement could produce never stop a tune. A cache whose every
/// measurement has a time of 0 (what an older unchecked store could write) made `tune` exit 1
/// with "no measurements", since the sizes still counted as measured; now they are measured
/// again and their rows replaced. One shape row of a dtype this mucudnn does not know (`fp8`)
/// made `cache list` and `cache export` fail; now it is skipped with a warning.
#[test]
fn forged_cache_rows_never_stop_a_tune_or_a_listing() {
    let dir = std::env::temp_dir().join(format!("mucudnn-forged-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cache = dir.join("cache.sqlite");
    let cache = cache.to_str().unwrap();
    let tune = [
        "tune",
        "--network",
        TINY,
        "--batch",
        "2",
        "--device",
        "cpu",
        "--json",
    ];
    let (code, _, stderr) = run_bounded(cache, &tune);
    assert_eq!(code, Some(0), "{stderr}");
    let sql = |statement: &str| {
        let conn = rusqlite::Connection::open(cache).unwrap();
        conn.execute(statement, []).unwrap();
    };
    sql("UPDATE measurements SET time_ms = 0");
    let (code, stdout, stderr) = run_bounded(cache, &tune);
    assert_eq!(code, Some(0), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        doc["tuning"]["sizes_measured"].as_u64() > Some(0),
        "the poisoned sizes are measured again: {}",
        doc["tuning"]
    );
    // Measured again, the rows were replaced: the next tune measures nothing.
    let (code, stdout, stderr) = run_bounded(cache, &tune);
    assert_eq!(code, Some(0), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["tuning"]["sizes_measured"], 0, "{}", doc["tuning"]);

    sql("UPDATE shapes SET dtype = 'fp8' WHERE id = (SELECT MIN(id) FROM shapes)");
    let (code, stdout, stderr) = run_bounded(cache, &["cache", "list"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("tiny."), "{stdout}");
    assert!(stderr.contains("skipped"), "{stderr}");
    let exported = dir.join("exported.json");
    let exported = exported.to_str().unwrap();
    let (code, _, stderr) = run_bounded(cache, &["cache", "export", exported, "--device", "cpu"]);
    assert_eq!(code, Some(0), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Finite times whose sum passes f64's range: `--json` wrote `null` (JSON has no infinity),
/// which reads as "no value"; it writes the largest f64, a number.
#[test]
fn an_overflowing_sum_of_times_is_a_number_in_json() {
    let profile = format!("{HOSTILE}/overflowing-times.json");
    let (code, stdout, stderr) = run_bounded(
        "/nonexistent/unused.sqlite",
        &["solve", "--profile", &profile, "--json"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for key in ["total_time_ms", "total_undivided_ms"] {
        assert_eq!(doc[key].as_f64(), Some(f64::MAX), "{key}: {}", doc[key]);
    }
}
