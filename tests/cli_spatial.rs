//! The binary with spatial splits: `tune --split`, the JSON plan's `split` and
//! `axis`, the table's `along h`, and `explain --split spatial`, on the CPU.

use serde_json::Value;
use std::process::{Command, Output};

fn mucudnn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mucudnn"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ok(args: &[&str]) -> Output {
    let output = mucudnn(args);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        text(&output.stderr)
    );
    output
}

const TUNE: [&str; 11] = [
    "tune",
    "--network",
    "tests/fixtures/batch1.toml",
    "--batch",
    "1",
    "--workspace-limit",
    "4KiB",
    "--device",
    "cpu",
    "--no-cache",
    "--quiet",
];

#[test]
fn forced_spatial_plans_split_every_op_along_h_within_the_limit() {
    let mut args = TUNE.to_vec();
    args.extend(["--split", "spatial", "--json"]);
    let doc: Value = serde_json::from_str(&text(&ok(&args).stdout)).unwrap();
    let plans = doc["plans"].as_array().unwrap();
    assert_eq!(plans.len(), 3);
    for plan in plans {
        assert_eq!(plan["split"], "spatial", "{plan}");
        assert_eq!(plan["axis"], "h", "{plan}");
        let chunks = plan["micro_batches"].as_array().unwrap();
        let rows: i64 = chunks.iter().map(|c| c["size"].as_i64().unwrap()).sum();
        // 12 rows of y (fwd, bwd_filter) or of dx (bwd_data): 3x3, padding 1, stride 1.
        assert_eq!(rows, 12, "{plan}");
        assert!(plan["workspace_bytes"].as_u64().unwrap() <= 4096, "{plan}");
    }
}

#[test]
fn batch_plans_have_no_axis_and_auto_names_the_axis_in_the_table() {
    let mut args = TUNE.to_vec();
    args.extend(["--split", "batch", "--json"]);
    let doc: Value = serde_json::from_str(&text(&ok(&args).stdout)).unwrap();
    for plan in doc["plans"].as_array().unwrap() {
        assert_eq!(plan["split"], "batch");
        assert!(plan.get("axis").is_none(), "{plan}");
    }
    // `auto` at batch 1 under the limit profiles the chunks too (the batch sizes skipped the
    // im2col candidates); whichever split wins, the table says which.
    let mut args = TUNE.to_vec();
    args.retain(|a| *a != "--quiet");
    args.extend(["--split", "auto"]);
    let output = ok(&args);
    let stderr = text(&output.stderr);
    assert!(stderr.contains("also profiling chunks along h"), "{stderr}");
    let stdout = text(&output.stdout);
    assert!(stdout.contains("split"), "{stdout}");
}

#[test]
fn explain_shows_chunk_sizes_along_the_axis() {
    let output = ok(&[
        "explain",
        "--network",
        "tests/fixtures/batch1.toml",
        "--batch",
        "1",
        "--layer",
        "batch1.conv",
        "--op",
        "fwd",
        "--split",
        "spatial",
        "--device",
        "cpu",
        "--no-cache",
        "--limits",
        "4KiB,unlimited",
    ]);
    let out = text(&output.stdout);
    assert!(
        out.contains("split along h (12 rows of the op's output, batch 1)"),
        "{out}"
    );
    assert!(out.contains("rows (h)"), "{out}");
    assert!(out.contains("along h"), "{out}");
}

#[test]
fn a_bad_split_is_refused_before_measuring() {
    let mut args = TUNE.to_vec();
    args.extend(["--split", "sideways"]);
    let output = mucudnn(&args);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("sideways"), "{stderr}");
    assert!(
        stderr.contains("batch, spatial, auto") || stderr.contains("possible values"),
        "{stderr}"
    );
}
