//! The binary with 3-D, 1-D and transposed layers: the zoo's video and audio models
//! and network files listed (`tune --list`), and tuned, solved and reported on the CPU at
//! reduced sizes.

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

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&text(&ok(args).stdout)).expect("valid JSON")
}

/// `--list --json`: the zoo's layers with counts, layouts by rank and problems, and nothing
/// measured (no device, no cache).
#[test]
fn list_shows_the_zoo_layers_without_measuring() {
    let doc = json(&[
        "tune",
        "--model",
        "wan21_vae_decoder",
        "--batch",
        "1",
        "--dtype",
        "fp16",
        "--layout",
        "ndhwc",
        "--list",
        "--json",
        "--cache",
        "/nonexistent/dir/cache.sqlite",
    ]);
    assert_eq!(doc["network"], "wan21_vae_decoder");
    assert_eq!(doc["convolutions"], 189);
    let layers = doc["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 25);
    let conv_in = &layers[1];
    assert_eq!(conv_in["layer"], "wan21_vae_decoder.decoder.conv_in");
    assert_eq!(conv_in["count"], 5);
    assert_eq!(conv_in["layout"], "ndhwc");
    assert_eq!(
        conv_in["shape"],
        "1x16x3x60x104 * 384x16x3x3x3 pad 0,1,1 fp16 ndhwc"
    );
    assert_eq!(conv_in["problem"]["d"], 3);
    assert_eq!(conv_in["problem"]["t"], 3);
    // A per-frame Conv2d: 2-D, so its layout has the 2-D name and no depth fields.
    let qkv = &layers[3];
    assert_eq!(qkv["layout"], "nhwc");
    assert!(qkv["problem"].get("d").is_none());

    let table = text(
        &ok(&[
            "tune",
            "--model",
            "r3d_18",
            "--batch",
            "2",
            "--input",
            "8x32x32",
            "--channel-divisor",
            "8",
            "--list",
        ])
        .stdout,
    );
    assert!(
        table.contains("r3d_18.stem.0")
            && table.contains("2x3x8x32x32 * 8x3x3x7x7 pad 1,3,3 stride 1,2,2 fp32 ncdhw")
            && table.ends_with("11 distinct shapes of 20 convolutions\n"),
        "{table}"
    );
    let audio = json(&[
        "tune",
        "--model",
        "wav2vec2_fe",
        "--batch",
        "3",
        "--layout",
        "nwc",
        "--list",
        "--json",
    ]);
    assert_eq!(audio["convolutions"], 7);
    assert_eq!(audio["layers"][0]["problem"]["w"], 16000);
    assert_eq!(audio["layers"][0]["problem"]["layout"], "nhwc");

    let file = json(&[
        "tune",
        "--network",
        "examples/networks/tiny-3d.toml",
        "--batch",
        "2",
        "--list",
        "--json",
    ]);
    let names: Vec<&str> = file["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["layer"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["tiny3d.conv1", "tiny3d.causal", "tiny3d.up", "tiny3d.audio"]
    );
}

/// The `tune` document's plans as (layer, layout, op) and the micro-batches summing to n.
fn plans(doc: &Value) -> Vec<(String, String, String)> {
    doc["plans"]
        .as_array()
        .expect("plans")
        .iter()
        .map(|plan| {
            let n = plan["n"].as_i64().unwrap();
            let sizes: i64 = plan["micro_batches"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["size"].as_i64().unwrap())
                .sum();
            assert_eq!(sizes, n, "{plan}");
            (
                plan["layer"].as_str().unwrap().to_string(),
                plan["layout"].as_str().unwrap().to_string(),
                plan["op"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `tune --model r3d_18 --batch 2 --device cpu` at a reduced clip and width: tunes all three
/// ops of the 11 distinct Conv3d shapes, solves, and writes a report naming NCDHW.
#[test]
fn r3d_18_tunes_solves_and_reports_on_the_cpu() {
    let dir = std::env::temp_dir().join(format!("mucudnn-cli-nd-r3d-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let report = dir.join("report");
    let report_arg = report.to_string_lossy().into_owned();
    let doc = json(&[
        "tune",
        "--model",
        "r3d_18",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--input",
        "4x16x16",
        "--channel-divisor",
        "8",
        "--no-cache",
        "--quiet",
        "--json",
        "--report",
        &report_arg,
    ]);
    let plans = plans(&doc);
    assert_eq!(plans.len(), 11 * 3);
    assert!(plans.iter().all(|(_, layout, _)| layout == "ncdhw"));
    assert!(plans
        .iter()
        .any(|(layer, _, op)| layer == "r3d_18.layer1.0.conv1.0" && op == "bwd_filter"));
    let markdown = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(
        markdown.contains("| r3d_18.stem.0 | fp32 | ncdhw | fwd |"),
        "{markdown}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The Wan VAE decoder at a reduced size (5 frames of 16x16, channels / 24) in NDHWC: 3-D
/// and per-frame 2-D layers, their layouts named by rank, and the table's weighted total.
#[test]
fn wan_vae_decoder_tunes_on_the_cpu_at_a_reduced_size() {
    let args = [
        "tune",
        "--model",
        "wan21_vae_decoder",
        "--batch",
        "1",
        "--device",
        "cpu",
        "--layout",
        "ndhwc",
        "--input",
        "5x16x16",
        "--channel-divisor",
        "24",
        "--no-cache",
        "--quiet",
    ];
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let doc = json(&with_json);
    let plans = plans(&doc);
    // 24 distinct shapes: at 16 channels conv_in (z_dim 16 -> 16) is the mid block's shape.
    assert_eq!(plans.len(), 24 * 3);
    let layout_of = |name: &str| {
        plans
            .iter()
            .find(|(layer, _, _)| layer == name)
            .map(|(_, layout, _)| layout.as_str())
    };
    assert_eq!(
        layout_of("wan21_vae_decoder.decoder.conv_in"),
        Some("ndhwc")
    );
    assert_eq!(
        layout_of("wan21_vae_decoder.decoder.mid_block.attentions.0.to_qkv"),
        Some("nhwc")
    );
    // The multiplicity of the later chunk's layers is in the JSON.
    let mid = doc["plans"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["layer"] == "wan21_vae_decoder.decoder.conv_in")
        .unwrap();
    // conv_in and the 10 latent-size 3x3x3 convolutions of both chunks.
    assert_eq!(mid["multiplicity"], 22);
}

/// A network file of 3-D, causal, transposed and 1-D layers tunes on the CPU, and `explain`
/// shows a 3-D layer's shape.
#[test]
fn tiny_3d_network_tunes_and_explains_on_the_cpu() {
    let doc = json(&[
        "tune",
        "--network",
        "examples/networks/tiny-3d.toml",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--no-cache",
        "--quiet",
        "--json",
    ]);
    let layouts: Vec<(String, String)> = plans(&doc)
        .into_iter()
        .filter(|(_, _, op)| op == "fwd")
        .map(|(layer, layout, _)| (layer, layout))
        .collect();
    assert_eq!(
        layouts,
        [
            ("tiny3d.conv1".to_string(), "ncdhw".to_string()),
            ("tiny3d.causal".into(), "ncdhw".into()),
            ("tiny3d.up".into(), "ncdhw".into()),
            // 1-D: tuned as 2-D with unit height, named at its own rank.
            ("tiny3d.audio".into(), "ncw".into()),
        ]
    );
    let output = ok(&[
        "explain",
        "--layer",
        "tiny3d.causal",
        "--op",
        "fwd",
        "--network",
        "examples/networks/tiny-3d.toml",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--no-cache",
        "--limits",
        "unlimited",
    ]);
    let explained = text(&output.stdout);
    assert!(
        explained.starts_with("tiny3d.causal fp32 ncdhw fwd: mini-batch 2")
            && explained.contains("shape: 2x4x6x4x4 * 4x4x3x3x3 pad 0,1,1 fp32 ncdhw"),
        "{explained}"
    );
}
