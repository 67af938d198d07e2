//! The `mucudnn` binary end to end: `solve` on the recorded profile, its JSON contract, and
//! its errors.

use serde_json::Value;
use std::process::{Command, Output};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/h100-alexnet-profile.json"
);

fn mucudnn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .output()
        .expect("binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn solve_json(extra: &[&str]) -> Value {
    let mut args = vec!["solve", "--profile", FIXTURE, "--json"];
    args.extend_from_slice(extra);
    let output = mucudnn(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    serde_json::from_str(&stdout(&output)).expect("valid JSON")
}

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

#[test]
fn json_has_exactly_the_documented_shape() {
    let doc = solve_json(&[]);
    assert_eq!(
        keys(&doc),
        [
            "mode",
            "plans",
            "policy",
            "total_time_ms",
            "total_undivided_ms",
            "total_workspace_bytes"
        ]
    );
    assert_eq!(doc["mode"], "wr");
    assert_eq!(doc["policy"], "power-of-two");
    let plans = doc["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 30);
    for plan in plans {
        assert_eq!(
            keys(plan),
            [
                "dtype",
                "layer",
                "layout",
                "micro_batches",
                "n",
                "op",
                "split",
                "time_ms",
                "undivided_ms",
                "workspace_bytes"
            ]
        );
        assert_eq!(plan["split"], "batch");
        let micro = plan["micro_batches"].as_array().unwrap();
        assert_eq!(
            keys(&micro[0]),
            ["algo", "kind", "name", "size", "time_ms", "workspace_bytes"]
        );
        // The number for programs, the name for people (the fixture is a cuDNN profile).
        for m in micro {
            let number = m["algo"].as_u64().unwrap() as u32;
            let op: mucudnn::solver::ConvOp = plan["op"].as_str().unwrap().parse().unwrap();
            let name = mucudnn::solver::legacy_name(mucudnn::solver::BackendKind::Cuda, op, number);
            assert_eq!(m["name"].as_str(), name, "{m}");
        }
        let sizes: i64 = micro.iter().map(|m| m["size"].as_i64().unwrap()).sum();
        assert_eq!(sizes, plan["n"].as_i64().unwrap());
        let time: f64 = micro.iter().map(|m| m["time_ms"].as_f64().unwrap()).sum();
        assert!((time - plan["time_ms"].as_f64().unwrap()).abs() < 1e-9);
        let ws = micro
            .iter()
            .map(|m| m["workspace_bytes"].as_u64().unwrap())
            .max()
            .unwrap();
        assert_eq!(ws, plan["workspace_bytes"].as_u64().unwrap());
        assert!(ws <= 64 << 20);
    }
    let max_ws = plans
        .iter()
        .map(|p| p["workspace_bytes"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(doc["total_workspace_bytes"].as_u64().unwrap(), max_ws);
    let fp32: f64 = plans
        .iter()
        .filter(|p| p["dtype"] == "fp32")
        .map(|p| p["time_ms"].as_f64().unwrap())
        .sum();
    let fp32_undivided: f64 = plans
        .iter()
        .filter(|p| p["dtype"] == "fp32")
        .map(|p| p["undivided_ms"].as_f64().unwrap())
        .sum();
    let speedup = fp32_undivided / fp32;
    assert!((3.6..3.9).contains(&speedup), "{speedup}");
}

#[test]
fn wd_mode_sums_workspaces_within_the_budget() {
    let doc = solve_json(&["--total-workspace", "100MiB", "--policy", "all"]);
    assert_eq!(doc["mode"], "wd");
    assert_eq!(doc["policy"], "all");
    let plans = doc["plans"].as_array().unwrap();
    let sum: u64 = plans
        .iter()
        .map(|p| p["workspace_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(doc["total_workspace_bytes"].as_u64().unwrap(), sum);
    assert!(sum <= 100 << 20);
    assert!(doc["total_time_ms"].as_f64().unwrap() < doc["total_undivided_ms"].as_f64().unwrap());
}

fn synthetic_profile(name: &str) -> String {
    // One problem, N = 4: the whole batch needs 100 bytes of workspace, halves need 10.
    let record = |micro: i64, ws: u64, time: f64| {
        serde_json::json!({"layer": "toy.conv", "dtype": "fp32", "layout": "nchw", "n": 4, "c": 2, "h": 5, "w": 5,
            "k": 2, "r": 3, "s": 3, "pad_h": 1, "pad_w": 1, "stride_h": 1, "stride_w": 1, "dilation_h": 1,
            "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 3, "micro": micro, "workspace_bytes": ws, "time_ms": time})
    };
    let doc = serde_json::json!({"format": "mucudnn-profile-v1", "device": "toy", "records": [record(4, 100, 1.0), record(2, 10, 0.4)]});
    let path = std::env::temp_dir().join(format!("mucudnn-{name}-{}.json", std::process::id()));
    std::fs::write(&path, doc.to_string()).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn undivided_is_null_when_no_single_algorithm_fits() {
    let path = synthetic_profile("undivided-null");
    for mode in [["--workspace-limit", "50"], ["--total-workspace", "50"]] {
        let output = mucudnn(&["solve", "--profile", &path, "--json", mode[0], mode[1]]);
        assert!(output.status.success(), "{}", stderr(&output));
        let doc: Value = serde_json::from_str(&stdout(&output)).unwrap();
        assert!(doc["plans"][0]["undivided_ms"].is_null(), "{doc}");
        assert!(doc["total_undivided_ms"].is_null(), "{doc}");
        assert_eq!(
            doc["plans"][0]["micro_batches"].as_array().unwrap().len(),
            2
        );
        assert!((doc["total_time_ms"].as_f64().unwrap() - 0.8).abs() < 1e-12);
    }
    // With room for the whole batch, the undivided baseline appears.
    let doc: Value = serde_json::from_str(&stdout(&mucudnn(&[
        "solve",
        "--profile",
        &path,
        "--json",
        "--workspace-limit",
        "100",
    ])))
    .unwrap();
    assert_eq!(doc["plans"][0]["undivided_ms"].as_f64(), Some(1.0));
    std::fs::remove_file(path).ok();
}

/// Workspace sums near 2^64 neither wrap ("0 B (sum)") nor panic, and a sum
/// past 2^64 does not fit a budget of 2^64 - 1.
#[test]
fn workspace_totals_near_2_pow_64_do_not_overflow() {
    let record = |layer: &str, algo: u32, ws: u64, time: f64| {
        serde_json::json!({"layer": layer, "dtype": "fp32", "layout": "nchw", "n": 1, "c": 2, "h": 5,
            "w": 5, "k": 2, "r": 3, "s": 3, "pad_h": 1, "pad_w": 1, "stride_h": 1, "stride_w": 1,
            "dilation_h": 1, "dilation_w": 1, "groups": 1, "op": "fwd", "algo": algo, "micro": 1,
            "workspace_bytes": ws, "time_ms": time})
    };
    let huge = 1u64 << 63;
    let write = |name: &str, records: Vec<Value>| {
        let doc = serde_json::json!({"format": "mucudnn-profile-v1", "device": "toy", "records": records});
        let path = std::env::temp_dir().join(format!("mucudnn-{name}-{}.json", std::process::id()));
        std::fs::write(&path, doc.to_string()).unwrap();
        path.to_string_lossy().into_owned()
    };
    let max = u64::MAX.to_string();
    // Each layer's fast algorithm needs 2^63 bytes: only one of them fits in 2^64 - 1.
    let path = write(
        "near-2-64",
        vec![
            record("a", 0, huge, 1.0),
            record("a", 1, 0, 2.0),
            record("b", 0, huge, 1.0),
            record("b", 1, 0, 2.0),
        ],
    );
    let output = mucudnn(&["solve", "--profile", &path, "--total-workspace", &max]);
    assert!(output.status.success(), "{}", stderr(&output));
    let table = stdout(&output);
    assert!(!table.contains("0 B (sum)"), "{table}");
    assert!(table.contains("8388608 TiB (sum)"), "{table}");
    let output = mucudnn(&[
        "solve",
        "--profile",
        &path,
        "--total-workspace",
        &max,
        "--json",
    ]);
    let doc: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(doc["total_workspace_bytes"].as_u64(), Some(huge), "{doc}");
    assert_eq!(doc["total_time_ms"].as_f64(), Some(3.0), "{doc}");
    std::fs::remove_file(path).ok();
    // Without the small algorithms no assignment fits: the error says so.
    let path = write(
        "past-2-64",
        vec![record("a", 0, huge, 1.0), record("b", 0, huge, 1.0)],
    );
    let output = mucudnn(&["solve", "--profile", &path, "--total-workspace", &max]);
    assert!(!output.status.success(), "{}", stdout(&output));
    assert!(
        stderr(&output).contains("add up to more than 2^64 - 1 bytes, so no total works"),
        "{}",
        stderr(&output)
    );
    std::fs::remove_file(path).ok();
}

#[test]
fn human_table_has_rows_subtotals_and_compact_splits() {
    let output = mucudnn(&["solve", "--profile", FIXTURE]);
    assert!(output.status.success());
    let text = stdout(&output);
    assert!(text.contains("per-layer limit 64 MiB"), "{text}");
    assert!(text.contains("cuDNN 9.19.0"), "{text}");
    let row: Vec<&str> = text
        .lines()
        .find(|l| l.starts_with("alexnet.conv2"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(row[..4], ["alexnet.conv2", "fp32", "nchw", "fwd"], "{text}");
    assert!(text.contains("8x32@IMPLICIT_PRECOMP_GEMM"), "{text}");
    assert!(!text.contains("algo"), "algorithms by name: {text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("total fp32 nchw") && l.contains("3.75x")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("total ") && l.contains("(max)")),
        "{text}"
    );
}

#[test]
fn errors_are_clear_and_exit_nonzero() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["solve", "--profile", "/nonexistent/profile.json"],
            "cannot read profile",
        ),
        (
            &["solve", "--profile", FIXTURE, "--workspace-limit", "64MB"],
            "decimal suffixes are ambiguous",
        ),
        (
            &["solve", "--profile", FIXTURE, "--policy", "pow2"],
            "[possible values: undivided, power-of-two, all]",
        ),
        (
            &[
                "solve",
                "--profile",
                FIXTURE,
                "--workspace-limit",
                "1MiB",
                "--total-workspace",
                "1MiB",
            ],
            "cannot be used with",
        ),
        (
            &[
                "solve",
                "--profile",
                FIXTURE,
                "--ilp-time-limit",
                "0",
                "--total-workspace",
                "1GiB",
            ],
            "ilp-time-limit",
        ),
    ];
    for (args, expected) in cases {
        let output = mucudnn(args);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(
            stderr(&output).contains(expected),
            "{args:?}: {}",
            stderr(&output)
        );
        assert!(!stderr(&output).contains("panicked"), "{args:?}");
    }
}

#[test]
fn bad_profiles_are_errors_not_panics() {
    let dir = std::env::temp_dir().join(format!("mucudnn-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let original = std::fs::read_to_string(FIXTURE).unwrap();
    let cases = [
        (
            write("truncated.json", &original[..original.len() / 2]),
            "not valid JSON",
        ),
        (
            write(
                "empty.json",
                r#"{"format": "mucudnn-profile-v1", "records": []}"#,
            ),
            "no measurements",
        ),
        (
            write("wrongformat.json", r#"{"format": "other", "records": []}"#),
            "unsupported profile format",
        ),
        (
            write(
                "negative.json",
                &original.replacen("\"time_ms\": 0.031377", "\"time_ms\": -1", 1),
            ),
            "time_ms",
        ),
        (
            write(
                "inconsistent.json",
                &original.replacen("\"k\": 96", "\"k\": 97", 1),
            ),
            "earlier record",
        ),
        (
            write(
                "badshape.json",
                &original.replace("\"groups\": 1", "\"groups\": 0"),
            ),
            "groups must be positive",
        ),
    ];
    for (path, expected) in cases {
        let output = mucudnn(&["solve", "--profile", &path]);
        assert!(!output.status.success(), "{path}");
        assert!(
            stderr(&output).contains(expected),
            "{path}: {}",
            stderr(&output)
        );
    }
    // A 0-byte limit on a problem with no zero-workspace algorithm names the smallest limit.
    let needs_workspace = original.replace("\"workspace_bytes\": 0,", "\"workspace_bytes\": 7,");
    let path = write("needs-ws.json", &needs_workspace);
    let output = mucudnn(&["solve", "--profile", &path, "--workspace-limit", "0"]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("alexnet.conv1 fp32 nchw fwd: no plan fits"),
        "{}",
        stderr(&output)
    );
    assert!(
        stderr(&output).contains("smallest limit that works is 7 B"),
        "{}",
        stderr(&output)
    );
    let output = mucudnn(&["solve", "--profile", &path, "--total-workspace", "100"]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("smallest total that works is 210 B"),
        "{}",
        stderr(&output)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tune_errors_are_clear() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "tune", "--model", "alexnet", "--batch", "0", "--device", "cpu",
            ],
            "--batch must be at least 1",
        ),
        (
            &["tune", "--model", "vgg", "--batch", "4"],
            "invalid value 'vgg' for '--model <MODEL>'",
        ),
        (
            &[
                "tune", "--model", "alexnet", "--batch", "4", "--dtype", "fp64",
            ],
            "[possible values: fp32, fp16, bf16]",
        ),
        (
            &[
                "tune", "--model", "alexnet", "--batch", "4", "--layout", "chwn",
            ],
            "[possible values: nchw, nhwc, ncdhw, ndhwc, ncw, nwc]",
        ),
        // The 3-D and 1-D models' sizes: checked before any device opens.
        (
            &[
                "tune", "--model", "resnet50", "--batch", "2", "--input", "224x224",
            ],
            "resnet50 has a fixed input and width",
        ),
        (
            &[
                "tune", "--model", "r3d_18", "--batch", "2", "--input", "16x0x112",
            ],
            "--input for r3d_18: 0 is not a positive size",
        ),
        (
            &[
                "tune",
                "--model",
                "wan21_vae_decoder",
                "--batch",
                "1",
                "--input",
                "16x480x832",
            ],
            "--input for wan21_vae_decoder: 16 frames",
        ),
        (
            &[
                "tune",
                "--model",
                "wav2vec2_fe",
                "--batch",
                "1",
                "--channel-divisor",
                "3",
            ],
            "--channel-divisor 3 for wav2vec2_fe",
        ),
        (
            &[
                "tune",
                "--model",
                "wav2vec2_fe",
                "--batch",
                "1",
                "--input",
                "100",
            ],
            "wav2vec2_fe.feature_extractor.conv_layers.4.conv: output width size is 0",
        ),
        (
            &[
                "tune",
                "--network",
                "examples/networks/tiny.toml",
                "--batch",
                "1",
                "--input",
                "8",
            ],
            "cannot be used with",
        ),
        (
            &[
                "tune",
                "--model",
                "alexnet",
                "--batch",
                "4",
                "--workspace-limit",
                "1M",
                "--total-workspace",
                "1M",
            ],
            "cannot be used with",
        ),
    ];
    for (args, expected) in cases {
        let output = mucudnn(args);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(
            stderr(&output).contains(expected),
            "{args:?}: {}",
            stderr(&output)
        );
    }
}

/// Asking for CUDA runs on the GPU where there is one (the device line names its cuDNN), and
/// elsewhere is an error that says what is missing; never a panic. Either way it asserts.
#[test]
fn tune_on_cuda_runs_there_or_is_a_clear_error() {
    let output = mucudnn(&[
        "tune", "--model", "alexnet", "--batch", "2", "--device", "cuda",
    ]);
    let text = stderr(&output);
    assert!(!text.contains("panicked"), "{text}");
    if output.status.success() {
        let out = stdout(&output);
        assert!(out.contains("cuDNN"), "{out}");
    } else {
        assert!(
            text.contains("--device cuda") && text.contains("unavailable"),
            "{text}"
        );
    }
}

const ENGINES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/h100-engines-3layers-pareto.json"
);

/// Two profiles of one device merge; `--candidates` picks one kind or both, and the table
/// says which kind won.
#[test]
fn solve_merges_profiles_and_compares_candidate_kinds() {
    let total = |candidates: &str| -> (f64, Value) {
        let output = mucudnn(&[
            "solve",
            "--profile",
            FIXTURE,
            "--profile",
            ENGINES,
            "--candidates",
            candidates,
            "--json",
        ]);
        assert!(output.status.success(), "{}", stderr(&output));
        let doc: Value = serde_json::from_str(&stdout(&output)).unwrap();
        (doc["total_time_ms"].as_f64().unwrap(), doc)
    };
    let (legacy, _) = total("legacy");
    let (engines, doc) = total("engines");
    let (all, all_doc) = total("all");
    // The engines fixture has 3 layers (18 plans), two of them AlexNet's; the legacy profile
    // AlexNet's 5 layers (30 plans).
    assert_eq!(doc["plans"].as_array().unwrap().len(), 18);
    assert_eq!(all_doc["plans"].as_array().unwrap().len(), 36);
    let alexnet_all: f64 = all_doc["plans"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["layer"].as_str().unwrap().starts_with("alexnet"))
        .map(|p| p["time_ms"].as_f64().unwrap())
        .sum();
    assert!(alexnet_all < legacy, "{alexnet_all} vs {legacy}");
    assert!(all > alexnet_all);
    assert!(engines > 0.0);
    let kinds: Vec<&str> = all_doc["plans"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["micro_batches"].as_array().unwrap())
        .map(|m| {
            // A micro-batch names its candidate by exactly one of `algo` and `engine`.
            assert!(m.get("algo").is_some() != m.get("engine").is_some(), "{m}");
            if let Some(engine) = m.get("engine") {
                assert_eq!(m["name"], *engine);
            }
            m["kind"].as_str().unwrap()
        })
        .collect();
    assert!(kinds.contains(&"engine") && kinds.contains(&"legacy"));
    let table = stdout(&mucudnn(&[
        "solve",
        "--profile",
        FIXTURE,
        "--profile",
        ENGINES,
    ]));
    assert!(
        table.contains("winners: engine configurations run"),
        "{table}"
    );
    assert!(table.contains("@eng"), "{table}");
    let legacy_only = stdout(&mucudnn(&["solve", "--profile", FIXTURE]));
    assert!(!legacy_only.contains("winners:"), "{legacy_only}");
    // Merging a profile with itself measures candidates twice: refused, naming the file.
    let output = mucudnn(&["solve", "--profile", ENGINES, "--profile", ENGINES]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("cannot merge"),
        "{}",
        stderr(&output)
    );
    let output = mucudnn(&["solve", "--profile", FIXTURE, "--candidates", "engines"]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("no engines candidates"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn engine_options_are_checked() {
    let output = mucudnn(&[
        "tune",
        "--model",
        "alexnet",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--no-cache",
        "--candidates",
        "engines",
        "--quiet",
    ]);
    assert!(!output.status.success());
    let err = stderr(&output);
    assert!(err.contains("no graph-API engine configurations"), "{err}");
    for bad in [
        ["--prune-margin", "0.5"],
        ["--prune-margin", "nan"],
        ["--max-candidates", "0"],
        ["--candidates", "engine"],
    ] {
        let mut args = vec![
            "tune", "--model", "alexnet", "--batch", "2", "--device", "cpu",
        ];
        args.extend_from_slice(&bad);
        let output = mucudnn(&args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{bad:?}: {}",
            stderr(&output)
        );
    }
}

#[test]
fn reports_say_which_candidates_won() {
    let dir = std::env::temp_dir().join(format!("mucudnn-engines-report-{}", std::process::id()));
    let output = mucudnn(&[
        "report",
        "--profile",
        ENGINES,
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(report.contains("### Which candidates won"), "{report}");
    assert!(report.contains("eng"), "{report}");
    std::fs::remove_dir_all(dir).ok();
}

/// One option of one command: its allowed values (in order) and its default, as `--help`
/// prints them or as docs/cli.md's option tables list them.
#[derive(Debug, PartialEq)]
struct OptionDoc {
    values: Vec<String>,
    default: Option<String>,
}

/// The options `mucudnn <command> --help` lists (not `--help`/`--version`), in either of
/// clap's layouts: one line per option (`--x <V>  text [default: d] [possible values: a, b]`)
/// or a block per option (`[default: d]`, `[possible values: ...]` or a `Possible values:`
/// list of `- name: text` lines).
fn options_in_help(command: &[&str]) -> Vec<(String, OptionDoc)> {
    let mut args = command.to_vec();
    args.push("--help");
    let output = mucudnn(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    let mut blocks: Vec<(String, String)> = Vec::new();
    for line in stdout(&output).lines() {
        let trimmed = line.trim_start();
        let option = trimmed
            .strip_prefix("-h, ")
            .unwrap_or(trimmed)
            .strip_prefix("--")
            .filter(|_| line.starts_with("  "));
        match option {
            Some(rest) => {
                let name = rest.split([' ', '<']).next().unwrap().to_string();
                blocks.push((name, rest.to_string()));
            }
            None => {
                if let Some((_, text)) = blocks.last_mut() {
                    text.push('\n');
                    text.push_str(line.trim());
                }
            }
        }
    }
    let bracket = |text: &str, key: &str| -> Option<String> {
        let start = text.find(key)? + key.len();
        Some(text[start..start + text[start..].find(']')?].to_string())
    };
    blocks
        .into_iter()
        .filter(|(name, _)| name != "help" && name != "version")
        .map(|(name, text)| {
            let mut values: Vec<String> = bracket(&text, "[possible values: ")
                .map(|list| list.split(", ").map(str::to_string).collect())
                .unwrap_or_default();
            if let Some(list) = text.split("Possible values:\n").nth(1) {
                values = list
                    .lines()
                    .map_while(|l| l.strip_prefix("- "))
                    .map(|l| l.split(':').next().unwrap().to_string())
                    .collect();
            }
            let default = bracket(&text, "[default: ");
            (name, OptionDoc { values, default })
        })
        .collect()
}

/// The option table docs/cli.md has under "### `mucudnn <command>`": rows of
/// | `--option` VALUE | `a`, `b` or - | `default` or - |.
fn options_in_docs(docs: &str, command: &[&str]) -> Vec<(String, OptionDoc)> {
    let heading = format!("### `mucudnn {}`\n", command.join(" "));
    let section = docs
        .split(&heading)
        .nth(1)
        .unwrap_or_else(|| panic!("docs/cli.md has no {heading:?}"));
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    section
        .lines()
        .skip_while(|l| !l.starts_with("| option"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = ticked(cells[1])[0]
                .strip_prefix("--")
                .expect("an option")
                .to_string();
            let default = ticked(cells[3]).into_iter().next();
            (
                name,
                OptionDoc {
                    values: ticked(cells[2]),
                    default,
                },
            )
        })
        .collect()
}

/// `--help` lists the allowed values and the default of every option, and
/// docs/cli.md's option tables say the same, for every subcommand.
#[test]
fn help_and_docs_agree_on_every_option() {
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/cli.md"))
        .expect("docs/cli.md");
    // Every subcommand, from the help itself (so a new one needs its table).
    let subcommands = |args: &[&str]| -> Vec<String> {
        let mut args = args.to_vec();
        args.push("--help");
        stdout(&mucudnn(&args))
            .split("Commands:\n")
            .nth(1)
            .map(|list| {
                list.lines()
                    .map_while(|l| l.strip_prefix("  "))
                    .map(|l| l.split_whitespace().next().unwrap().to_string())
                    .filter(|name| name != "help")
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut commands: Vec<Vec<String>> = Vec::new();
    for command in subcommands(&[]) {
        let nested = subcommands(&[command.as_str()]);
        if nested.is_empty() {
            commands.push(vec![command]);
        } else {
            commands.extend(nested.into_iter().map(|sub| vec![command.clone(), sub]));
        }
    }
    assert!(commands.len() >= 10, "{commands:?}");
    for command in &commands {
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let help = options_in_help(&command);
        assert!(
            !help.is_empty() || command == ["cache", "path"],
            "{command:?}"
        );
        assert_eq!(
            options_in_docs(&docs, &command),
            help,
            "docs/cli.md's table for `mucudnn {}` and its --help differ",
            command.join(" ")
        );
    }
    // tune's main options: their values and defaults are in the help.
    let tune = options_in_help(&["tune"]);
    let find = |name: &str| &tune.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(find("dtype").values, ["fp32", "fp16", "bf16"]);
    assert_eq!(
        find("layout").values,
        ["nchw", "nhwc", "ncdhw", "ndhwc", "ncw", "nwc"]
    );
    assert!(find("model")
        .values
        .iter()
        .any(|m| m == "wan21_vae_decoder"));
    assert_eq!(find("candidates").values, ["legacy", "engines", "all"]);
    assert_eq!(find("workspace-limit").default.as_deref(), Some("64MiB"));
    assert_eq!(find("device").values, ["auto", "cuda", "cpu"]);
}
