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
    assert!(
        stdout.contains("8x32@IMPLICIT_PRECOMP_GEMM"),
        "the 64 MiB plan: {stdout}"
    );
    assert!(
        stdout.contains("FFT_TILING"),
        "the unlimited choice: {stdout}"
    );
    assert!(
        stdout.starts_with("alexnet.conv2 fp32 nchw fwd"),
        "fp32 NCHW by default: {stdout}"
    );
    // --dtype and --layout pick the entry, not the first of the layer's.
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

/// Verified tuning through the binary: `--no-verify` measures without comparing outputs (the
/// summary and `--json` say so), a verifying tune then measures those sizes again, and
/// `explain` reads the verified ones from the cache and says how they were verified.
#[test]
fn no_verify_is_measured_again_by_a_verifying_tune() {
    let dir = temp("no-verify");
    let cache = dir.join("cache.sqlite");
    let tune = |extra: &[&str]| {
        let mut args = vec![
            "tune",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--json",
        ];
        args.extend_from_slice(extra);
        let output = mucudnn(&args, cache.to_str().unwrap());
        assert!(output.status.success(), "{}", text(&output.stderr));
        let doc: serde_json::Value = serde_json::from_str(&text(&output.stdout)).unwrap();
        (doc, text(&output.stderr))
    };
    let (off, stderr) = tune(&["--no-verify"]);
    assert!(
        stderr.contains("verification off (--no-verify)"),
        "{stderr}"
    );
    assert_eq!(off["tuning"]["verify"], false);
    assert_eq!(off["tuning"]["candidates_compared"], 0);
    let candidates = &off["verification"][0]["candidates"][0];
    assert!(candidates["max_rel_error"].is_null() && candidates["tolerance"].is_null());
    let (on, stderr) = tune(&[]);
    let sizes = off["tuning"]["sizes_measured"].as_u64().unwrap();
    assert_eq!(on["tuning"]["sizes_measured"], sizes, "{stderr}");
    assert!(stderr.contains("candidate output(s) against the reference this run; none rejected"));
    assert_eq!(on["tuning"]["candidates_unverified"], 0);
    let (again, _) = tune(&["--no-verify"]);
    assert_eq!(
        again["tuning"]["sizes_measured"], 0,
        "verified sizes serve it"
    );
    let explained = mucudnn(
        &[
            "explain",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--layer",
            "tiny.conv1",
            "--op",
            "fwd",
        ],
        cache.to_str().unwrap(),
    );
    let stdout = text(&explained.stdout);
    assert!(
        stdout.contains(
            "Outputs verified against the reference candidate's: 6 timing(s) compared, 0 rejected."
        ),
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

/// Layer names with `|` or a newline (a profile may carry any string) stay
/// one cell on one line in the table, `explain` and report.md.
#[test]
fn odd_layer_names_do_not_break_tables_or_report_md() {
    let dir = temp("odd-names");
    let record = |layer: &str, micro: i64, time: f64| {
        serde_json::json!({"layer": layer, "dtype": "fp32", "layout": "nchw", "n": 2, "c": 2, "h": 5,
            "w": 5, "k": 2, "r": 3, "s": 3, "pad_h": 1, "pad_w": 1, "stride_h": 1, "stride_w": 1,
            "dilation_h": 1, "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 0, "micro": micro,
            "workspace_bytes": 0, "time_ms": time})
    };
    let names = ["a|b", "c\nd", "e\tf"];
    let records: Vec<serde_json::Value> = names
        .iter()
        .flat_map(|name| [record(name, 1, 0.4), record(name, 2, 1.0)])
        .collect();
    let profile = dir.join("odd.json");
    std::fs::write(
        &profile,
        serde_json::json!({"format": "mucudnn-profile-v1", "device": "toy", "records": records})
            .to_string(),
    )
    .unwrap();
    let profile = profile.to_str().unwrap();
    let output = mucudnn(&["solve", "--profile", profile], "/x");
    assert!(output.status.success(), "{}", text(&output.stderr));
    let table = text(&output.stdout);
    // Header, rule, three rows, rule, total: every line as wide as the rule.
    let lines: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("layer"))
        .collect();
    assert_eq!(lines.len(), 7, "{table}");
    for escaped in ["a|b", "c\\nd", "e\\tf"] {
        assert!(
            lines.iter().any(|l| l.starts_with(escaped)),
            "{escaped}: {table}"
        );
    }

    let output = mucudnn(
        &[
            "explain",
            "--profile",
            profile,
            "--layer",
            "c\nd",
            "--op",
            "fwd",
        ],
        "/x",
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(
        text(&output.stdout).starts_with("c\\nd fp32 nchw fwd: mini-batch 2"),
        "{}",
        text(&output.stdout)
    );

    let out = dir.join("report");
    let output = mucudnn(
        &[
            "report",
            "--profile",
            profile,
            "--out",
            out.to_str().unwrap(),
        ],
        "/x",
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let plan_rows: Vec<&str> = md
        .lines()
        .filter(|l| {
            ["| a\\|b |", "| c\\nd |", "| e\\tf |"]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect();
    assert_eq!(plan_rows.len(), 3, "{md}");
    let header = md.lines().find(|l| l.starts_with("| layer")).unwrap();
    let cells = |line: &str| line.replace("\\|", "").matches('|').count();
    for row in plan_rows {
        assert_eq!(cells(row), cells(header), "{row}\n{md}");
    }
    assert!(md.contains("| a\\|b |") && md.contains("| c\\nd |"), "{md}");
    std::fs::remove_dir_all(dir).ok();
}

/// `tune --json` has `solve --json`'s keys in its order (then `tuning`),
/// each plan's multiplicity (so the weighted total can be rebuilt), and a saved profile's times
/// carry no float noise beyond the clock's nanoseconds.
#[test]
fn tune_json_orders_keys_like_solve_and_carries_multiplicity() {
    let dir = temp("tune-json");
    let cache = dir.join("cache.sqlite");
    let saved = dir.join("saved.json");
    let output = mucudnn(
        &[
            "tune",
            "--network",
            TINY,
            "--batch",
            "4",
            "--device",
            "cpu",
            "--json",
            "--quiet",
            "--save-profile",
            saved.to_str().unwrap(),
        ],
        cache.to_str().unwrap(),
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let tuned = text(&output.stdout);
    let solved = text(
        &mucudnn(
            &["solve", "--profile", saved.to_str().unwrap(), "--json"],
            "/x",
        )
        .stdout,
    );
    // Keys in order of first appearance at each indentation, as the text prints them.
    let keys = |doc: &str, indent: usize| -> Vec<String> {
        let prefix = format!("{}\"", " ".repeat(indent));
        let mut keys: Vec<String> = Vec::new();
        for line in doc.lines() {
            if let Some(rest) = line.strip_prefix(&prefix) {
                let key = rest.split('"').next().unwrap().to_string();
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
        }
        keys
    };
    let mut expected = keys(&solved, 2);
    assert_eq!(expected[..2], ["mode", "policy"], "{solved}");
    expected.push("tuning".into());
    expected.push("verification".into());
    assert_eq!(keys(&tuned, 2), expected, "{tuned}");
    let plan_keys = keys(&tuned, 6);
    assert_eq!(
        plan_keys[..7],
        [
            "layer",
            "dtype",
            "layout",
            "op",
            "n",
            "multiplicity",
            "undivided_ms"
        ],
        "{tuned}"
    );
    assert_eq!(
        keys(&tuned, 4),
        [
            "seconds",
            "candidates",
            "sizes_measured",
            "sizes_cached",
            "engine_timings_pruned",
            "measuring_limit_bytes",
            "timings_skipped_over_limit",
            "peak_measuring_memory_bytes",
            "largest_workspace_bytes",
            "verify",
            "candidates_verified_now",
            "candidates_compared",
            "candidates_rejected",
            "candidates_unverified"
        ],
        "{tuned}"
    );

    let doc: serde_json::Value = serde_json::from_str(&tuned).unwrap();
    // Every candidate's output was compared with the reference's; none is wrong.
    let entries = doc["verification"].as_array().unwrap();
    assert_eq!(entries.len(), doc["plans"].as_array().unwrap().len());
    for entry in entries {
        for candidate in entry["candidates"].as_array().unwrap() {
            let error = candidate["max_rel_error"].as_f64().unwrap();
            let tolerance = candidate["tolerance"].as_f64().unwrap();
            assert!(error <= tolerance && tolerance > 0.0, "{candidate}");
            assert_eq!(candidate["rejected"], false, "{candidate}");
        }
    }
    assert_eq!(doc["tuning"]["verify"], true);
    assert_eq!(doc["tuning"]["candidates_rejected"], 0);
    assert_eq!(
        doc["tuning"]["candidates_compared"],
        doc["tuning"]["candidates_verified_now"]
    );
    // Measuring held memory, and no workspace above the default limit.
    let tuning = &doc["tuning"];
    assert_eq!(tuning["measuring_limit_bytes"], 64 << 20, "{tuning}");
    let largest = tuning["largest_workspace_bytes"].as_u64().unwrap();
    let peak = tuning["peak_measuring_memory_bytes"].as_u64().unwrap();
    assert!(
        largest <= 64 << 20 && peak >= largest && peak > 0,
        "{tuning}"
    );
    let plans = doc["plans"].as_array().unwrap();
    for plan in plans {
        let expect = if plan["layer"] == "tiny.conv3_dw" {
            2
        } else {
            1
        };
        assert_eq!(plan["multiplicity"], expect, "{plan}");
    }
    let weighted: f64 = plans
        .iter()
        .map(|p| p["time_ms"].as_f64().unwrap() * p["multiplicity"].as_f64().unwrap())
        .sum();
    assert!(weighted > doc["total_time_ms"].as_f64().unwrap());

    let profile = std::fs::read_to_string(&saved).unwrap();
    let mut times = 0;
    for value in profile.split("\"time_ms\":").skip(1) {
        let number: String = value
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == 'e' || *c == '-')
            .collect();
        let decimals = number.split('.').nth(1).map_or(0, str::len);
        assert!(decimals <= 6, "float noise: {number}");
        times += 1;
    }
    assert!(times > 20, "{profile}");
    std::fs::remove_dir_all(dir).ok();
}

/// `tune --verify`'s table keeps two spaces between its columns, however
/// wide a cell, and its JSON section keeps the layer first.
#[test]
fn verify_table_columns_stay_apart() {
    let dir = temp("verify");
    let cache = dir.join("cache.sqlite");
    let tune = |extra: &[&str]| {
        let mut args = vec![
            "tune",
            "--network",
            TINY,
            "--batch",
            "2",
            "--device",
            "cpu",
            "--verify",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let output = mucudnn(&args, cache.to_str().unwrap());
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stdout)
    };
    let table = tune(&[]);
    let header = table
        .lines()
        .find(|l| l.contains("predicted ms"))
        .unwrap_or_else(|| panic!("{table}"));
    for pair in [
        "op  ",
        "predicted ms  ",
        "measured ms  ",
        "undivided pred  ",
        "undivided meas  ",
    ] {
        assert!(header.contains(pair), "{pair:?}: {header}");
    }
    let json = tune(&["--json"]);
    let measured = &json[json.find("\"measured\"").unwrap()..];
    let layer = measured.find("\"layer\"").unwrap();
    assert!(layer < measured.find("\"dtype\"").unwrap(), "{measured}");
    std::fs::remove_dir_all(dir).ok();
}
