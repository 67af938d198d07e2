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
        &["cache", "import", FIXTURE, "--device", "cpu", "--force"],
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
        &["solve", "--profile", FIXTURE, "--json"],
    )))
    .unwrap();
    let fp32: Vec<&Value> = solved["plans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["dtype"] == "fp32")
        .collect();
    assert_eq!(
        tuned["plans"]
            .as_array()
            .unwrap()
            .iter()
            .collect::<Vec<_>>(),
        fp32
    );

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
        &["cache", "import", FIXTURE, "--device", "cpu", "--force"],
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
    assert_eq!(show["schema_version"], 2);
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
    // The exported file carries this machine's fingerprint: no --force needed.
    ok(&mucudnn(
        &cache,
        &["cache", "import", exported, "--device", "cpu"],
    ));
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
    let original = ok(&mucudnn(&cache, &["solve", "--profile", FIXTURE, "--json"]));
    assert_eq!(
        before, original,
        "export keeps every measurement of the original profile"
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}

#[test]
fn a_corrupt_cache_file_is_set_aside_and_the_command_goes_on() {
    let cache = temp_cache("corrupt");
    std::fs::write(&cache, vec![0x42u8; 8192]).unwrap();
    let output = mucudnn(
        &cache,
        &["cache", "import", FIXTURE, "--device", "cpu", "--force"],
    );
    ok(&output);
    assert!(
        text(&output.stderr).contains("moved it to"),
        "{}",
        text(&output.stderr)
    );
    assert!(ok(&mucudnn(&cache, &["cache", "list"])).contains("alexnet.conv1"));
    // An unwritable location: the command still works, in memory.
    let blocked = cache.with_file_name("blocker");
    std::fs::write(&blocked, b"x").unwrap();
    let output = mucudnn(
        &blocked.join("cache.sqlite"),
        &["cache", "import", FIXTURE, "--device", "cpu", "--force"],
    );
    ok(&output);
    assert!(
        text(&output.stderr).contains("in memory"),
        "{}",
        text(&output.stderr)
    );
    std::fs::remove_dir_all(cache.parent().unwrap()).ok();
}
