//! The binary with 3-D, 1-D and transposed layers (issue 26): the zoo's video and audio models
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
