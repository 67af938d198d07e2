//! The cache through the binary: import refuses a foreign profile without --force; a tune whose
//! measurements are all cached runs no benchmark and gives the same plans as solving the
//! profile; export -> clear -> import round-trips; list/show/path; a corrupt cache file never
//! stops a command.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/h100-alexnet-profile.json"
);

/// The H100 fixture cut down to the algorithm numbers the CPU backend has (0-2), for tests
/// that import it with `--force` as this machine's and then tune without measuring. (Records
/// entering the cache must be candidates of its device: the full fixture's 3-7 are refused.)
fn cpu_fixture() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let mut doc: Value =
            serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
        doc["records"]
            .as_array_mut()
            .unwrap()
            .retain(|r| r["algo"].as_u64().unwrap() <= 2);
        let dir =
            std::env::temp_dir().join(format!("mucudnn-cli-cache-fixture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("h100-algos-0-2.json");
        std::fs::write(&path, doc.to_string()).unwrap();
        path.display().to_string()
    })
}

fn mucudnn(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .env("MUCUDNN_CACHE", cache)
        .output()
        .expect("binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn temp_cache(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mucudnn-cli-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("cache.sqlite")
}

fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    text(&output.stdout)
}

#[test]
fn cached_tune_runs_no_benchmark_and_matches_solve() {
    let cache = temp_cache("warm");
    // The H100 profile is not this machine's: refused unless forced.
    let refused = mucudnn(&cache, &["cache", "import", FIXTURE, "--device", "cpu"]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("--force"),
        "{}",
        text(&refused.stderr)
    );
    ok(&mucudnn(
        &cache,
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ],
    ));

    let tune = mucudnn(
        &cache,
        &[
            "tune", "--model", "alexnet", "--batch", "256", "--device", "cpu", "--json",
        ],
    );
    let tuned: Value = serde_json::from_str(&ok(&tune)).unwrap();
    assert!(
        text(&tune.stderr).contains("no benchmark was run"),
        "{}",
        text(&tune.stderr)
    );
    let solved: Value = serde_json::from_str(&ok(&mucudnn(
        &cache,
        &["solve", "--profile", cpu_fixture(), "--json"],
    )))
    .unwrap();
    // Algorithm names follow the device: the profile file is a cuDNN one (no fingerprint, a
    // cuDNN version), the cache holds it as this machine's CPU measurements. Numbers agree.
    let names = |plan: &mut Value| -> Vec<Value> {
        plan["micro_batches"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .map(|m| m.as_object_mut().unwrap().remove("name").unwrap())
            .collect()
    };
    let fp32: Vec<Value> = solved["plans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["dtype"] == "fp32")
        .map(|plan| {
            let mut plan = plan.clone();
            names(&mut plan);
            plan
        })
        .collect();
    // The same plans; tune adds each layer's multiplicity (AlexNet's layers occur once).
    let tuned_plans: Vec<Value> = tuned["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|plan| {
            let mut plan = plan.clone();
            let multiplicity = plan.as_object_mut().unwrap().remove("multiplicity");
            assert_eq!(multiplicity, Some(Value::from(1)), "{plan}");
            for name in names(&mut plan) {
                assert!(
                    ["direct", "im2col-batched", "im2col-per-image"]
                        .contains(&name.as_str().unwrap()),
                    "{name}"
                );
            }
            plan
        })
        .collect();
    assert_eq!(tuned_plans, fp32);

    // A smaller batch is solved from the same micro-batch measurements, still without profiling.
    let half = mucudnn(
        &cache,
        &[
            "tune", "--model", "alexnet", "--batch", "128", "--device", "cpu", "--quiet",
        ],
    );
    ok(&half);

    // fp16 NHWC was imported too.
    let fp16 = mucudnn(
        &cache,
        &[
            "tune", "--model", "alexnet", "--batch", "256", "--device", "cpu", "--dtype", "fp16",
            "--layout", "nhwc",
        ],
    );
    ok(&fp16);
    assert!(
        text(&fp16.stderr).contains("no benchmark was run"),
        "{}",
        text(&fp16.stderr)
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

#[test]
fn export_clear_import_and_inspection() {
    let cache = temp_cache("round-trip");
    ok(&mucudnn(
        &cache,
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ],
    ));
    assert_eq!(
        ok(&mucudnn(&cache, &["cache", "path"])).trim(),
        cache.display().to_string()
    );
    let list = ok(&mucudnn(&cache, &["cache", "list"]));
    assert!(
        list.contains("alexnet.conv2") && list.contains("9 sizes"),
        "{list}"
    );
    let listed: Value =
        serde_json::from_str(&ok(&mucudnn(&cache, &["cache", "list", "--json"]))).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 30);
    let show: Value =
        serde_json::from_str(&ok(&mucudnn(&cache, &["cache", "show", "--json"]))).unwrap();
    assert_eq!(show["schema_version"], mucudnn::cache::SCHEMA_VERSION);
    assert_eq!(show["devices"][0]["entries"], 30);

    let exported = cache.with_file_name("exported.json");
    let exported = exported.to_str().unwrap();
    ok(&mucudnn(
        &cache,
        &["cache", "export", exported, "--device", "cpu"],
    ));
    let before = ok(&mucudnn(
        &cache,
        &["solve", "--profile", exported, "--json"],
    ));
    ok(&mucudnn(&cache, &["cache", "clear"]));
    assert!(ok(&mucudnn(&cache, &["cache", "list"])).contains("is empty"));
    let empty_export = mucudnn(&cache, &["cache", "export", exported, "--device", "cpu"]);
    assert!(
        !empty_export.status.success() && text(&empty_export.stderr).contains("nothing cached")
    );
    // The exported file carries this machine's fingerprint and only its candidates: it imports
    // without --force.
    ok(&mucudnn(
        &cache,
        &["cache", "import", exported, "--device", "cpu"],
    ));
    // The full H100 profile is refused even with --force (which only relabels the device):
    // its algorithm numbers 3-7 are not the CPU backend's, and nothing is stored.
    let refused = mucudnn(
        &cache,
        &["cache", "import", FIXTURE, "--device", "cpu", "--force"],
    );
    assert!(
        !refused.status.success()
            && text(&refused.stderr).contains("candidate of the cpu backend")
            && text(&refused.stderr).contains("nothing was imported"),
        "{}",
        text(&refused.stderr)
    );
    let reexported = cache.with_file_name("again.json");
    ok(&mucudnn(
        &cache,
        &[
            "cache",
            "export",
            reexported.to_str().unwrap(),
            "--device",
            "cpu",
        ],
    ));
    let after = ok(&mucudnn(
        &cache,
        &["solve", "--profile", reexported.to_str().unwrap(), "--json"],
    ));
    assert_eq!(before, after);
    let original = ok(&mucudnn(
        &cache,
        &["solve", "--profile", cpu_fixture(), "--json"],
    ));
    // The same plans by number; the names follow the device (the export is this machine's CPU,
    // the original a cuDNN profile).
    let numbers_only = |json: &str| {
        let mut doc: Value = serde_json::from_str(json).unwrap();
        for plan in doc["plans"].as_array_mut().unwrap() {
            for m in plan["micro_batches"].as_array_mut().unwrap() {
                m.as_object_mut().unwrap().remove("name").unwrap();
            }
        }
        doc
    };
    assert_eq!(
        numbers_only(&before),
        numbers_only(&original),
        "export keeps every measurement of the original profile"
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

/// A file that is not a mucudnn cache is refused by every cache
/// command, never moved, and left byte-for-byte unchanged; an unusable location makes the
/// commands that exist to write fail instead of "importing into memory".
#[test]
fn a_file_that_is_not_a_cache_is_refused_by_every_command() {
    let cache = temp_cache("not-ours");
    std::fs::write(&cache, vec![0x42u8; 8192]).unwrap();
    let commands: [&[&str]; 5] = [
        &["cache", "show"],
        &["cache", "list"],
        &[
            "cache",
            "export",
            "/nonexistent/out.json",
            "--device",
            "cpu",
        ],
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ],
        &["cache", "clear"],
    ];
    for args in commands {
        let output = mucudnn(&cache, args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains("is not a mucudnn cache"),
            "{args:?}: {stderr}"
        );
        assert_eq!(
            std::fs::read(&cache).unwrap(),
            vec![0x42u8; 8192],
            "{args:?}"
        );
    }
    let names: Vec<_> = std::fs::read_dir(cache.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        vec![cache.file_name().unwrap().to_owned()],
        "nothing moved or added"
    );
    // An unusable location: writing commands fail, and say why.
    let blocked = cache.with_file_name("blocker");
    std::fs::write(&blocked, b"x").unwrap();
    for args in [
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ][..],
        &["cache", "clear"][..],
    ] {
        let output = mucudnn(&blocked.join("cache.sqlite"), args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        assert!(
            text(&output.stderr).contains("cannot be written"),
            "{}",
            text(&output.stderr)
        );
    }
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

/// A cache file that cannot be written is still read. As root (mode bits do
/// not stop root) the file is made immutable with `chattr +i`; where that is not possible the
/// documented `MUCUDNN_CACHE_READ_ONLY=1` takes the same read-only path.
#[test]
fn a_read_only_cache_is_read_and_never_written() {
    let cache = temp_cache("read-only");
    ok(&mucudnn(
        &cache,
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ],
    ));
    // Tune once so that the cache holds this machine's tiny network.
    ok(&mucudnn(
        &cache,
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--quiet",
        ],
    ));
    let before = std::fs::read(&cache).unwrap();
    let (how, env) = make_read_only(&cache);
    eprintln!("read-only by: {how}");
    let run = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_mucudnn"));
        command.args(args).env("MUCUDNN_CACHE", &cache);
        if let Some((key, value)) = env {
            command.env(key, value);
        }
        command.output().unwrap()
    };
    let list = ok(&run(&["cache", "list"]));
    assert!(list.contains("alexnet.conv2"), "{list}");
    ok(&run(&["cache", "show"]));
    let exported = cache.with_file_name("exported.json");
    ok(&run(&[
        "cache",
        "export",
        exported.to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    // tune uses the cached measurements and says new ones are not kept.
    let tune = run(&["tune", "--network", TINY, "--batch", "2", "--device", "cpu"]);
    ok(&tune);
    let stderr = text(&tune.stderr);
    assert!(stderr.contains("new ones will not be kept"), "{stderr}");
    assert!(stderr.contains("no benchmark was run"), "{stderr}");
    for args in [
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ][..],
        &["cache", "clear"][..],
    ] {
        let output = run(args);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{args:?}: {}",
            text(&output.stderr)
        );
        assert!(
            text(&output.stderr).contains("cannot be written"),
            "{}",
            text(&output.stderr)
        );
    }
    undo_read_only(&cache, how);
    assert_eq!(std::fs::read(&cache).unwrap(), before);
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/networks/tiny.toml");

fn make_read_only(path: &Path) -> (&'static str, Option<(&'static str, &'static str)>) {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false);
    if !root {
        let mut perms = std::fs::metadata(path).unwrap().permissions();
        perms.set_readonly(true);
        std::fs::set_permissions(path, perms).unwrap();
        ("mode bits", None)
    } else if Command::new("chattr")
        .arg("+i")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
    {
        ("chattr +i", None)
    } else {
        (
            "MUCUDNN_CACHE_READ_ONLY",
            Some(("MUCUDNN_CACHE_READ_ONLY", "1")),
        )
    }
}

fn undo_read_only(path: &Path, how: &str) {
    match how {
        "chattr +i" => {
            let _ = Command::new("chattr").arg("-i").arg(path).status();
        }
        "mode bits" => {
            let mut perms = std::fs::metadata(path).unwrap().permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            perms.set_readonly(false);
            std::fs::set_permissions(path, perms).unwrap();
        }
        _ => {}
    }
}

/// A reader that stops early (`| head -1`) is no panic: the command exits
/// quietly and still writes its report files.
#[test]
fn a_closed_stdout_is_no_panic_and_reports_are_still_written() {
    let cache = temp_cache("pipe");
    ok(&mucudnn(
        &cache,
        &[
            "cache",
            "import",
            cpu_fixture(),
            "--device",
            "cpu",
            "--force",
        ],
    ));
    let report = cache.with_file_name("report");
    for args in [
        vec!["cache", "list"],
        vec!["solve", "--profile", FIXTURE],
        vec![
            "report",
            "--profile",
            FIXTURE,
            "--out",
            report.to_str().unwrap(),
        ],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mucudnn"))
            .args(&args)
            .env("MUCUDNN_CACHE", &cache)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Hang up before the first line, as `head` does once it has what it wants (closing
        // at once makes every write meet the broken pipe, however short the output).
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        let stderr = text(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(output.status.success(), "{args:?}: {stderr}");
    }
    assert!(
        report.join("report.md").exists(),
        "the report was still written"
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

/// Whatever the cache holds, `cache export` writes a file that `cache import`
/// and `solve` accept: a network tuned at batch 2 and then at 4, a layer explained at another
/// batch size, and a layer name that two networks give to different shapes.
#[test]
fn export_of_several_batch_sizes_imports_and_solves() {
    let cache = temp_cache("batches");
    let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/networks/tiny.toml");
    let exported = cache.with_file_name("exported.json");
    let exported = exported.to_str().unwrap();
    let imported = cache.with_file_name("imported.sqlite");
    let round_trip = |what: &str| -> Value {
        ok(&mucudnn(
            &cache,
            &["cache", "export", exported, "--device", "cpu"],
        ));
        std::fs::remove_file(&imported).ok();
        let import = mucudnn(&imported, &["cache", "import", exported, "--device", "cpu"]);
        assert!(
            import.status.success(),
            "{what}: import refused its own export: {}",
            text(&import.stderr)
        );
        let solve = mucudnn(&cache, &["solve", "--profile", exported, "--json"]);
        assert!(
            solve.status.success(),
            "{what}: solve refused the export: {}",
            text(&solve.stderr)
        );
        serde_json::from_str(&text(&solve.stdout)).unwrap()
    };
    for batch in ["2", "4"] {
        ok(&mucudnn(
            &cache,
            &[
                "tune",
                "--network",
                tiny,
                "--batch",
                batch,
                "--device",
                "cpu",
                "--quiet",
            ],
        ));
    }
    let solved = round_trip("batches 2 and 4");
    // This machine's own export with an algorithm number its backend does
    // not have (the CPU's are 0-2) is refused, naming the problem.
    let edited = cache.with_file_name("edited.json");
    let text_of = std::fs::read_to_string(exported).unwrap();
    let at = text_of.rfind("\"algo\":").unwrap();
    let end = at + text_of[at..].find(',').unwrap();
    let edited_text = format!("{}\"algo\":7{}", &text_of[..at], &text_of[end..]);
    std::fs::write(&edited, edited_text).unwrap();
    let refused = mucudnn(
        &imported,
        &[
            "cache",
            "import",
            edited.to_str().unwrap(),
            "--device",
            "cpu",
        ],
    );
    assert!(
        !refused.status.success()
            && text(&refused.stderr)
                .contains("algorithm 7 is not a bwd_filter candidate of the cpu backend"),
        "{}",
        text(&refused.stderr)
    );
    let plans = solved["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 9, "3 layers x 3 ops, once each");
    assert!(plans.iter().all(|p| p["n"] == 4), "at the largest batch");

    ok(&mucudnn(
        &cache,
        &[
            "explain",
            "--network",
            tiny,
            "--batch",
            "3",
            "--layer",
            "tiny.conv2",
            "--op",
            "fwd",
            "--device",
            "cpu",
        ],
    ));
    round_trip("after explain at batch 3");

    // Another network's `conv1` is another shape: exported under its own name.
    let other = cache.with_file_name("other.toml");
    std::fs::write(
        &other,
        "name = \"tiny\"\n[[layer]]\nname = \"conv1\"\nin_channels = 4\nout_channels = 4\ninput = 6\nkernel = 1\n",
    )
    .unwrap();
    ok(&mucudnn(
        &cache,
        &[
            "tune",
            "--network",
            other.to_str().unwrap(),
            "--batch",
            "2",
            "--device",
            "cpu",
            "--quiet",
        ],
    ));
    let solved = round_trip("one layer name, two shapes");
    let layers: Vec<&str> = solved["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["layer"].as_str().unwrap())
        .collect();
    assert!(
        layers.contains(&"tiny.conv1") && layers.contains(&"tiny.conv1#2"),
        "{layers:?}"
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

/// A cache tuned with spatial splits at batch 1 (the use case) exports a profile that imports
/// into another cache: the import's check used to read every record as a micro-batch of the
/// batch and refused the export ("micro-batch size 2 is outside 1..=1"). A record it refuses
/// is numbered from 1, as profile errors number them.
#[test]
fn a_spatial_export_at_batch_1_imports_and_refusals_count_records_from_1() {
    let cache = temp_cache("spatial-export");
    let network = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/networks/tiny-3d.toml"
    );
    let args = [
        "tune",
        "--network",
        network,
        "--batch",
        "1",
        "--split",
        "spatial",
    ];
    ok(&mucudnn(
        &cache,
        &[&args[..], &["--device", "cpu", "--quiet"]].concat(),
    ));
    let exported = cache.with_file_name("spatial.json");
    let exported = exported.to_str().unwrap();
    ok(&mucudnn(
        &cache,
        &["cache", "export", exported, "--device", "cpu"],
    ));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(exported).unwrap()).unwrap();
    let records = doc["records"].as_array().unwrap();
    assert!(
        records
            .iter()
            .any(|r| r["split"] == "spatial" && r["micro"].as_i64() > Some(1)),
        "the export has spatial records of more than one row"
    );
    let fresh = cache.with_file_name("fresh.sqlite");
    ok(&mucudnn(
        &fresh,
        &["cache", "import", exported, "--device", "cpu"],
    ));
    // The fresh cache tunes the same network from what was imported, measuring nothing.
    let tuned = ok(&mucudnn(
        &fresh,
        &[&args[..], &["--device", "cpu", "--json"]].concat(),
    ));
    let tuned: Value = serde_json::from_str(&tuned).unwrap();
    assert_eq!(tuned["tuning"]["sizes_measured"], 0, "{}", tuned["tuning"]);

    // One record the CPU backend has no candidate for, the first: "record 1".
    let mut bad = doc.clone();
    bad["records"][0]["algo"] = Value::from(999);
    let bad_path = cache.with_file_name("bad.json");
    std::fs::write(&bad_path, bad.to_string()).unwrap();
    let refused = mucudnn(
        &fresh,
        &[
            "cache",
            "import",
            bad_path.to_str().unwrap(),
            "--device",
            "cpu",
        ],
    );
    let stderr = text(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains(": record 1 ("), "{stderr}");
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}
