//! The cuDNN host tier: the FFI wall against the real libcudnn on a machine without a GPU
//! (issue 17). `scripts/cudnn_host_env.sh` provides cuDNN and cuBLAS from PyPI's wheels and a
//! stub libcuda; graphs, heuristics and plans are built on a device description of an H100
//! (`tests/fixtures/h100-device-description.json`) instead of a handle. See
//! docs/cudnn_host.md.
//!
//! Gated by `MUCUDNN_CUDNN_HOST_TESTS=1`; without it every test prints that it was skipped.
//! `MUCUDNN_CUDNN_HOST_JSON=<file>` makes the zoo tests append one JSON object per (layer,
//! dtype, layout, op) to `<file>` (what `scripts/cudnn_host_check.sh --json` prints).

use mucudnn::backend::cudnn::{
    engine_configs_on_device, heuristic_plan_workspaces_on_device, plan_on_device, Alignments,
    ConvDescriptors, ConvShapes, CudnnError, DeviceDescription, EngineConfig, EngineSearch,
    HeurMode, Operand,
};
use mucudnn::models::Model;
use mucudnn::solver::{ConvOp, ConvProblem, DType, Layout};
use std::io::Write;
use std::path::Path;

const GATE: &str = "MUCUDNN_CUDNN_HOST_TESTS";
const JSON_OUT: &str = "MUCUDNN_CUDNN_HOST_JSON";
/// Set in a child process this test binary starts with a library hidden.
const CHILD: &str = "MUCUDNN_CUDNN_HOST_CHILD";
/// The mini-batch of every checked problem; micro-batch graphs use 1, 2, 4, 8.
const BATCH: i64 = 8;

fn enabled(test: &str) -> bool {
    if std::env::var(GATE).as_deref() == Ok("1") {
        true
    } else {
        println!(
            "skipped: {test} needs {GATE}=1 and the libraries of \
             `eval \"$(bash scripts/cudnn_host_env.sh)\"` (docs/cudnn_host.md)"
        );
        false
    }
}

fn device() -> DeviceDescription {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h100-device-description.json");
    let json = std::fs::read_to_string(&path).expect("the H100 device description");
    DeviceDescription::from_json(&json).unwrap_or_else(|e| panic!("device description: {e}"))
}

/// The three data configurations of the tier.
const CONFIGS: [(DType, Layout); 3] = [
    (DType::Fp32, Layout::Nchw),
    (DType::Fp16, Layout::Nhwc),
    (DType::Bf16, Layout::Nhwc),
];

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::Nchw => "nchw",
        Layout::Nhwc => "nhwc",
    }
}

/// The odd stems of issue 17: 7x7 stride-2 convolutions of 3 x 299 x 299 and 3 x 225 x 225.
fn odd_stems(dtype: DType, layout: Layout) -> Vec<(String, ConvProblem)> {
    [299, 225]
        .into_iter()
        .map(|side| {
            let p = ConvProblem {
                pad_h: 3,
                pad_w: 3,
                stride_h: 2,
                stride_w: 2,
                dtype,
                layout,
                ..ConvProblem::new(BATCH, 3, side, side, 64, 7, 7)
            };
            (format!("stem.3x{side}x{side}"), p)
        })
        .collect()
}

/// What one (layer, dtype, layout, op) check found.
#[derive(Default)]
struct Outcome {
    mode_a: usize,
    mode_b: usize,
    fallback: usize,
    plans: usize,
    /// Configurations the problem's math mode excludes (not rebuilt).
    declined: usize,
    failures: Vec<String>,
}

fn search(mode: HeurMode) -> EngineSearch {
    EngineSearch {
        heuristics: vec![mode],
        max_candidates: usize::MAX,
        ..EngineSearch::default()
    }
}

/// Legacy descriptors against the wall's shapes: cuDNN's output dims (checked inside
/// `ConvDescriptors::new`) and the strides cuDNN derived for every tensor.
fn check_legacy(problem: &ConvProblem, failures: &mut Vec<String>) {
    let d = match ConvDescriptors::new(problem) {
        Ok(d) => d,
        Err(e) => return failures.push(format!("legacy descriptors: {e}")),
    };
    let shapes = ConvShapes::new(problem).unwrap();
    for (role, desc) in [(Operand::Input, d.input()), (Operand::Output, d.output())] {
        let info = match desc.info() {
            Ok(info) => info,
            Err(e) => return failures.push(format!("cudnnGetTensor4dDescriptor: {e}")),
        };
        let dims = shapes.dims(role);
        let expected = mucudnn::backend::cudnn::graph_params::packed_strides(
            problem.layout,
            dims.map(i64::from),
        );
        if info.dims != dims || info.strides.map(i64::from) != expected {
            failures.push(format!(
                "{role:?}: cuDNN dims {:?} strides {:?}, the wall {dims:?} {expected:?}",
                info.dims, info.strides
            ));
        }
    }
}

/// Everything the tier checks for one (problem, op) on the device description.
fn check_op(device: &DeviceDescription, problem: &ConvProblem, op: ConvOp) -> Outcome {
    let mut out = Outcome::default();
    let at_zero = Alignments::MAX;
    for mode in HeurMode::ALL {
        let results = match heuristic_plan_workspaces_on_device(device, problem, op, mode, at_zero)
        {
            Ok(results) => results,
            Err(e) if e.is_not_supported() => Vec::new(),
            Err(e) => {
                out.failures.push(format!("{mode:?}: {e}"));
                continue;
            }
        };
        let count = results.len();
        match mode {
            HeurMode::A => out.mode_a = count,
            HeurMode::B => out.mode_b = count,
            HeurMode::Fallback => out.fallback = count,
        }
        // Rebuild every configuration cuDNN could make a plan of from its name: the same
        // workspace, or the name does not capture the configuration.
        for (config, workspace) in results {
            let Some(theirs) = workspace else { continue };
            let name = config.to_string();
            let parsed = match name.parse::<EngineConfig>() {
                Ok(parsed) => parsed,
                Err(e) => {
                    out.failures.push(format!("{name}: {e}"));
                    continue;
                }
            };
            match plan_on_device(device, problem, op, &parsed, 0.0, at_zero) {
                Ok(plan) if plan.workspace_bytes == theirs => out.plans += 1,
                Ok(plan) => out.failures.push(format!(
                    "{name}: rebuilt plan needs {} workspace bytes, cuDNN's own {theirs}",
                    plan.workspace_bytes
                )),
                // mucudnn declines engines whose numerics the math mode excludes (here the
                // default mode and reduced-precision accumulation) before asking cuDNN.
                Err(CudnnError::EngineNotSupported { .. }) => out.declined += 1,
                Err(e) => out.failures.push(format!("{name}: rebuilt plan: {e}")),
            }
        }
    }
    out
}

/// The micro-batch graphs of `problem` (1, 2, 4, ... up to its batch) finalize and offer a
/// configuration (modes A, B or fallback), at the alignment of the offset the profiler times
/// them at.
fn check_micro_batches(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut micro = 1;
    while micro <= problem.n {
        let micro_problem = problem.with_batch(micro);
        let shapes = ConvShapes::new(&micro_problem).unwrap();
        let alignments = Alignments::at_sample(&shapes, (problem.n - micro) as usize);
        let all_modes = EngineSearch {
            max_candidates: usize::MAX,
            ..EngineSearch::default()
        };
        match engine_configs_on_device(device, &micro_problem, op, &all_modes, alignments) {
            Ok(configs) if !configs.is_empty() => {}
            Ok(_) => failures.push(format!(
                "micro-batch {micro} at {alignments:?}: no configuration"
            )),
            Err(e) if e.is_not_supported() => {}
            Err(e) => failures.push(format!("micro-batch {micro}: {e}")),
        }
        micro *= 2;
    }
    failures
}

fn json_line(layer: &str, problem: &ConvProblem, op: ConvOp, o: &Outcome) -> String {
    format!(
        "{{\"layer\":\"{layer}\",\"dtype\":\"{}\",\"layout\":\"{}\",\"op\":\"{op}\",\
         \"mode_a\":{},\"mode_b\":{},\"fallback\":{},\"plans\":{},\"passed\":{}}}",
        problem.dtype,
        layout_name(problem.layout),
        o.mode_a,
        o.mode_b,
        o.fallback,
        o.plans,
        o.failures.is_empty()
    )
}

/// Checks every layer in `layers` in the three data configurations and all three ops;
/// micro-batch graphs for every `micro_every`-th layer (sampled to keep the tier short).
fn check_layers(layers: Vec<(String, ConvProblem)>, micro_every: usize) {
    let device = device();
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (index, (layer, problem)) in layers.iter().enumerate() {
        for op in ConvOp::ALL {
            let mut o = check_op(&device, problem, op);
            if op == ConvOp::Forward {
                check_legacy(problem, &mut o.failures);
            }
            if index % micro_every == 0 {
                o.failures.extend(check_micro_batches(&device, problem, op));
            }
            if o.mode_a + o.mode_b + o.fallback == 0 {
                o.failures
                    .push("no configuration from any heuristics mode".into());
            }
            lines.push(json_line(layer, problem, op, &o));
            for f in &o.failures {
                failures.push(format!(
                    "{layer} {} {} {op}: {f}",
                    problem.dtype,
                    layout_name(problem.layout)
                ));
            }
            checked += 1;
        }
    }
    if let Ok(path) = std::env::var(JSON_OUT) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("the JSON output file");
        writeln!(file, "{}", lines.join("\n")).expect("write the JSON lines");
    }
    println!(
        "{checked} (layer, dtype, layout, op) checked, {} failures",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn zoo(model: Model) -> Vec<(String, ConvProblem)> {
    let mut layers = Vec::new();
    for (dtype, layout) in CONFIGS {
        for layer in model.layers(BATCH, dtype, layout) {
            layers.push((layer.name, layer.problem));
        }
    }
    layers
}

#[test]
fn alexnet_layers() {
    if enabled("alexnet_layers") {
        check_layers(zoo(Model::AlexNet), 1);
    }
}

#[test]
fn resnet50_layers() {
    if enabled("resnet50_layers") {
        check_layers(zoo(Model::ResNet50), 4);
    }
}

#[test]
fn mobilenet_v2_layers() {
    if enabled("mobilenet_v2_layers") {
        check_layers(zoo(Model::MobileNetV2), 4);
    }
}

#[test]
fn densenet121_layers() {
    if enabled("densenet121_layers") {
        check_layers(zoo(Model::DenseNet121), 8);
    }
}

#[test]
fn odd_stem_layers() {
    if enabled("odd_stem_layers") {
        let layers = CONFIGS
            .into_iter()
            .flat_map(|(dtype, layout)| odd_stems(dtype, layout))
            .collect();
        check_layers(layers, 1);
    }
}
