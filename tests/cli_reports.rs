//! Real networks through the binary: network files (and their errors), progress when stderr is
//! not a terminal, report directories with SVG plots, and `explain`.

use std::path::PathBuf;
use std::process::{Command, Output};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/h100-alexnet-profile.json"
);
const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/networks/tiny.toml");

fn mucudnn(args: &[&str], cache: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .env("MUCUDNN_CACHE", cache)
        .output()
        .expect("binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn temp(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("mucudnn-cli-reports-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

#[test]
fn tune_a_network_file_with_progress_lines_and_a_report() {
    let dir = temp("tiny");
    let cache = dir.join("cache.sqlite");
    let report = dir.join("report");
    let output = mucudnn(
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "4",
            "--device",
            "cpu",
            "--report",
            report.to_str().unwrap(),
        ],
        cache.to_str().unwrap(),
    );
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stderr}");
    // Not a terminal: one progress line per (layer, op), no bar escape codes.
    assert_eq!(count(&stderr, "] tiny."), 9, "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "{stderr}");
    // The depthwise layer appears twice in the file: tuned once, shown with its multiplicity.
    assert!(stdout.contains("tiny.conv3_dw (x2)"), "{stdout}");
    assert!(stdout.contains("total x multiplicity"), "{stdout}");
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(
        md.contains("tiny.conv2") && md.contains("speedup.svg"),
        "{md}"
    );
    let svgs: Vec<PathBuf> = std::fs::read_dir(report.join("pareto"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(svgs.len(), 9, "one Pareto chart per (layer, op)");
    for svg in svgs {
        let body = std::fs::read_to_string(&svg).unwrap();
        assert!(
            body.trim_start().starts_with("<svg") || body.trim_start().starts_with("<?xml"),
            "{svg:?}"
        );
        assert_eq!(count(&body, "class=\"chosen\""), 1, "{svg:?}");
    }
    // --quiet: no progress at all; a second run is served by the cache.
    let output = mucudnn(
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "4",
            "--device",
            "cpu",
            "--quiet",
        ],
        cache.to_str().unwrap(),
    );
    assert!(output.status.success());
    assert_eq!(text(&output.stderr), "");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_network_file_with_a_typo_names_the_line() {
    let dir = temp("typo");
    let path = dir.join("typo.toml");
    let original = std::fs::read_to_string(TINY).unwrap();
    let typo = original.replacen("kernel", "kernal", 1);
    let line = typo.lines().position(|l| l.contains("kernal")).unwrap() + 1;
    std::fs::write(&path, typo).unwrap();
    let output = mucudnn(
        &[
            "tune",
            "--network",
            path.to_str().unwrap(),
            "--batch",
            "2",
            "--device",
            "cpu",
        ],
        "/nonexistent/c.sqlite",
    );
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(&format!("line {line}")) && stderr.contains("kernal"),
        "{stderr}"
    );
    let output = mucudnn(
        &[
            "tune",
            "--network",
            path.to_str().unwrap(),
            "--device",
            "cpu",
        ],
        "/nonexistent/c.sqlite",
    );
    assert!(
        text(&output.stderr).contains("--batch is required"),
        "{}",
        text(&output.stderr)
    );
    let output = mucudnn(&["tune", "--batch", "2"], "/nonexistent/c.sqlite");
    assert!(
        text(&output.stderr).contains("--model NAME or --network"),
        "{}",
        text(&output.stderr)
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn report_and_explain_from_a_saved_profile() {
    let dir = temp("report");
    let out = dir.join("out");
    let output = mucudnn(
        &[
            "report",
            "--profile",
            FIXTURE,
            "--out",
            out.to_str().unwrap(),
        ],
        "/nonexistent/c.sqlite",
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(out.join("report.md").exists() && out.join("speedup.svg").exists());
    assert_eq!(std::fs::read_dir(out.join("pareto")).unwrap().count(), 30);

    let output = mucudnn(
        &[
            "explain",
            "--profile",
            FIXTURE,
            "--layer",
            "alexnet.conv2",
            "--op",
            "fwd",
            "--limits",
            "64MiB,unlimited",
        ],
        "/x",
    );
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(stdout.contains("8x32@algo1"), "the 64 MiB plan: {stdout}");
    assert!(stdout.contains("algo5"), "the unlimited choice: {stdout}");
    assert!(
        stdout.starts_with("alexnet.conv2 fp32 nchw fwd"),
        "fp32 NCHW by default: {stdout}"
    );
    // Issue 14, item 7: --dtype and --layout pick the entry, not the first of the layer's.
    let output = mucudnn(
        &[
            "explain",
            "--profile",
            FIXTURE,
            "--layer",
            "alexnet.conv2",
            "--op",
            "fwd",
            "--dtype",
            "fp16",
            "--layout",
            "nhwc",
        ],
        "/x",
    );
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(
        stdout.starts_with("alexnet.conv2 fp16 nhwc fwd"),
        "the fp16 NHWC entry: {stdout}"
    );
    let output = mucudnn(
        &[
            "explain",
            "--profile",
            FIXTURE,
            "--layer",
            "alexnet.conv2",
            "--op",
            "fwd",
            "--dtype",
            "bf16",
        ],
        "/x",
    );
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("fp16 nhwc fwd"),
        "lists what the layer has: {}",
        text(&output.stderr)
    );
    let output = mucudnn(
        &[
            "explain",
            "--profile",
            FIXTURE,
            "--layer",
            "alexnet.conv9",
            "--op",
            "fwd",
        ],
        "/x",
    );
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("alexnet.conv1"),
        "lists the layers: {}",
        text(&output.stderr)
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn explain_measures_one_layer_of_a_network_through_the_cache() {
    let dir = temp("explain");
    let cache = dir.join("cache.sqlite");
    let output = mucudnn(
        &[
            "explain",
            "--network",
            TINY,
            "--batch",
            "4",
            "--device",
            "cpu",
            "--layer",
            "tiny.conv2",
            "--op",
            "bwd_filter",
        ],
        cache.to_str().unwrap(),
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("tiny.conv2") && stdout.contains("micro"),
        "{stdout}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Ctrl-C (SIGINT) stops after the current measurement; what was measured stays cached.
#[test]
fn ctrl_c_stops_cleanly_and_keeps_the_measurements() {
    let dir = temp("interrupt");
    let cache = dir.join("cache.sqlite");
    let network = dir.join("slow.toml");
    // Big enough to take many seconds in a debug build, small enough for one measurement to
    // finish quickly.
    std::fs::write(
        &network,
        "[[layer]]\nname = \"a\"\nin_channels = 32\nout_channels = 32\ninput = 24\nkernel = 3\npadding = 1\n\
         [[layer]]\nname = \"b\"\nin_channels = 32\nout_channels = 48\ninput = 24\nkernel = 5\npadding = 2\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args([
            "tune",
            "--network",
            network.to_str().unwrap(),
            "--batch",
            "16",
            "--device",
            "cpu",
            "--policy",
            "all",
        ])
        .env("MUCUDNN_CACHE", &cache)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let still_running = child.try_wait().unwrap().is_none();
    assert!(
        still_running,
        "the run finished before it could be interrupted: make the network slower"
    );
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let output = child.wait_with_output().unwrap();
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("interrupted") && stderr.contains("kept in the cache"),
        "{stderr}"
    );
    let list = mucudnn(&["cache", "list", "--json"], cache.to_str().unwrap());
    let entries: serde_json::Value = serde_json::from_str(&text(&list.stdout)).unwrap();
    let sizes: u64 = entries
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sizes"].as_u64().unwrap())
        .sum();
    assert!(sizes >= 1, "measured sizes were kept: {entries}");
    assert!(sizes < 2 * 3 * 16, "the run did stop early");
    std::fs::remove_dir_all(dir).ok();
}
