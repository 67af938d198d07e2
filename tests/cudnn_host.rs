//! The cuDNN host tier: the FFI wall against the real libcudnn on a machine without a GPU
//! at all. `scripts/cudnn_host_env.sh` provides cuDNN and cuBLAS from PyPI's wheels and a
//! stub libcuda; graphs, heuristics and plans are built on a device description of an H100
//! (`tests/fixtures/h100-device-description.json`) instead of a handle. See
//! docs/cudnn_host.md.
//!
//! Every test is `#[ignore = "needs the cuDNN host tier: ..."]` (`cargo test` counts them as
//! ignored); the tier runs them with
//! `--include-ignored` and `MUCUDNN_CUDNN_HOST_TESTS=1`, and a test asked for without that
//! variable fails.
//! `MUCUDNN_CUDNN_HOST_JSON=<file>` makes the zoo tests append one JSON object per (layer,
//! dtype, layout, op) to `<file>` (what `scripts/cudnn_host_check.sh --json` prints).

use mucudnn::backend::cudnn::graph_params::packed_strides;
use mucudnn::backend::cudnn::{
    engine_configs_for_chunk_on_device, engine_configs_on_device,
    heuristic_plan_workspaces_on_device, plan_for_chunk_on_device, plan_on_device, Alignments,
    ChunkShapes, ConvDescriptors, ConvShapes, CudnnError, DeviceDescription, EngineConfig,
    EngineSearch, HeurMode, Operand, TensorDescriptor,
};
use mucudnn::backend::cudnn::{operand_roles, ComparisonDescriptors, DataTypeCode};
use mucudnn::c_abi::problem_from_descriptors;
use mucudnn::models::Model;
use mucudnn::solver::{ConvOp, ConvProblem, DType, Layout};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "spatial/cases.rs"]
mod spatial;

const GATE: &str = "MUCUDNN_CUDNN_HOST_TESTS";
const JSON_OUT: &str = "MUCUDNN_CUDNN_HOST_JSON";
/// Set in a child process this test binary starts with a library hidden.
const CHILD: &str = "MUCUDNN_CUDNN_HOST_CHILD";
/// The mini-batch of every checked problem; micro-batch graphs use 1, 2, 4, 8.
const BATCH: i64 = 8;

/// The tests are `#[ignore = "needs the cuDNN host tier: ..."]`; one that is asked for (`--include-ignored`) without the tier's
/// environment fails rather than passing without running.
fn enabled(test: &str) -> bool {
    assert!(
        std::env::var(GATE).as_deref() == Ok("1"),
        "{test} needs {GATE}=1 and the libraries of \
         `eval \"$(bash scripts/cudnn_host_env.sh)\"` (docs/cudnn_host.md)"
    );
    true
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

/// Stems with odd input sizes: 7x7 stride-2 convolutions of 3 x 299 x 299 and 3 x 225 x 225.
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
/// `ConvDescriptors::new`), the strides cuDNN derived for every tensor (4-D, or 5-D for a 3-D
/// problem), and all four descriptors read back through the C ABI's readers (cuDNN's Nd
/// getters) into the same problem.
fn check_legacy(problem: &ConvProblem, failures: &mut Vec<String>) {
    let d = match ConvDescriptors::new(problem) {
        Ok(d) => d,
        Err(e) => return failures.push(format!("legacy descriptors: {e}")),
    };
    let shapes = ConvShapes::new(problem).unwrap();
    let rank = 2 + problem.spatial_dims();
    let mut infos = Vec::new();
    for (role, desc) in [(Operand::Input, d.input()), (Operand::Output, d.output())] {
        let info = match desc.info() {
            Ok(info) => info,
            Err(e) => return failures.push(format!("cudnnGetTensorNdDescriptor: {e}")),
        };
        let dims = shapes.dims(role);
        let wide: Vec<i64> = dims.iter().map(|&v| i64::from(v)).collect();
        let expected = packed_strides(problem.layout, &wide);
        let strides: Vec<i64> = info.strides.iter().map(|&v| i64::from(v)).collect();
        if info.dims != dims || dims.len() != rank || strides[..] != expected[..] {
            failures.push(format!(
                "{role:?}: cuDNN dims {:?} strides {:?}, the wall {dims:?} {expected:?}",
                info.dims, info.strides
            ));
        }
        infos.push(info);
    }
    let (filter, conv) = match (d.filter().info(), d.convolution().info()) {
        (Ok(f), Ok(c)) => (f, c),
        (Err(e), _) | (_, Err(e)) => return failures.push(format!("read back: {e}")),
    };
    if filter.dims != shapes.filter || filter.layout != Some(problem.layout) {
        failures.push(format!(
            "filter: cuDNN dims {:?} layout {:?}, the wall {:?} {:?}",
            filter.dims, filter.layout, shapes.filter, problem.layout
        ));
    }
    if conv.pad != shapes.pad || conv.stride != shapes.stride || conv.dilation != shapes.dilation {
        failures.push(format!(
            "convolution: cuDNN pad {:?} stride {:?} dilation {:?}, the wall {:?} {:?} {:?}",
            conv.pad, conv.stride, conv.dilation, shapes.pad, shapes.stride, shapes.dilation
        ));
    }
    for op in ConvOp::ALL {
        match problem_from_descriptors(op, &infos[0], &filter, &conv, &infos[1]) {
            Ok(read) if read == *problem => {}
            Ok(read) => failures.push(format!(
                "{op}: the C ABI reads {} back, not {}",
                read.describe(),
                problem.describe()
            )),
            Err(e) => failures.push(format!("{op}: the C ABI's reading: {e}")),
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
/// configuration (modes A, B or fallback), at the alignment the profiler declares when it
/// times them (what holds at every offset).
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
        let alignments = Alignments::any_sample(&shapes);
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
        problem.layout_name(),
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
                    problem.layout_name()
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
    zoo_in(model, BATCH, &CONFIGS)
}

/// Verified tuning compares outputs with `cudnnOpTensor` (ADD, `out - reference`) and
/// `cudnnReduceTensor` (AMAX) into a one-element tensor: their descriptors build for the
/// output of every op (y, dx, dw) of a 2-D, a 3-D and a 1-D problem in fp32, fp16 and bf16,
/// NCHW and NHWC (NCDHW and NDHWC), and read back as made: the wall's dims and packed strides,
/// a one-element tensor of the same rank and dtype, ADD and AMAX in fp32 with NaN propagated.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn output_comparison_descriptors_for_every_dtype_and_layout() {
    if !enabled("output_comparison_descriptors_for_every_dtype_and_layout") {
        return;
    }
    let mut two_d = ConvProblem::new(BATCH, 64, 28, 28, 128, 3, 3);
    (two_d.pad_h, two_d.pad_w) = (1, 1);
    let three_d = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new_3d(2, 16, 8, 28, 28, 32, 3, 3, 3)
    };
    let one_d = ConvProblem::new_1d(BATCH, 512, 400, 512, 3);
    let mut failures = Vec::new();
    let mut built = 0;
    for problem in [two_d, three_d, one_d] {
        for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                let p = ConvProblem {
                    dtype,
                    layout,
                    ..problem
                };
                let shapes = ConvShapes::new(&p).unwrap();
                for op in ConvOp::ALL {
                    let what = format!("{} {op}", p.describe());
                    let info = match ComparisonDescriptors::for_output(&shapes, op)
                        .and_then(|d| d.info().map(|info| (d.len(), info)))
                    {
                        Ok(info) => info,
                        Err(e) => {
                            failures.push(format!("{what}: {e}"));
                            continue;
                        }
                    };
                    let (len, info) = info;
                    let [_, _, role] = operand_roles(op);
                    let dims = shapes.dims(role);
                    let wide: Vec<i64> = dims.iter().map(|&v| i64::from(v)).collect();
                    let strides: Vec<i64> =
                        info.output.strides.iter().map(|&v| i64::from(v)).collect();
                    let ones = vec![1; dims.len()];
                    let ok = info.output.dims == dims
                        && strides[..] == packed_strides(layout, &wide)[..]
                        && info.output.data_type == DataTypeCode::of(dtype)
                        && info.scalar.dims[..] == ones[..]
                        && info.scalar.data_type == DataTypeCode::of(dtype)
                        && info.add_in_fp32
                        && info.amax_in_fp32
                        && len == shapes.elements(role);
                    if ok {
                        built += 1;
                    } else {
                        failures.push(format!("{what}: {info:?} (the wall's dims {dims:?})"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(built, 3 * 3 * 2 * 3);
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn alexnet_layers() {
    if enabled("alexnet_layers") {
        check_layers(zoo(Model::AlexNet), 1);
    }
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn resnet50_layers() {
    if enabled("resnet50_layers") {
        check_layers(zoo(Model::ResNet50), 4);
    }
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn mobilenet_v2_layers() {
    if enabled("mobilenet_v2_layers") {
        check_layers(zoo(Model::MobileNetV2), 4);
    }
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn densenet121_layers() {
    if enabled("densenet121_layers") {
        check_layers(zoo(Model::DenseNet121), 8);
    }
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn odd_stem_layers() {
    if enabled("odd_stem_layers") {
        let layers = CONFIGS
            .into_iter()
            .flat_map(|(dtype, layout)| odd_stems(dtype, layout))
            .collect();
        check_layers(layers, 1);
    }
}

// ---------------------------------------------------------------------------------------------
// 3-D and 1-D convolutions

/// The data configurations of 3-D (and 1-D) convolutions: fp16 NDHWC
/// (channels last) and fp32 NCDHW.
const CONFIGS_3D: [(DType, Layout); 2] = [(DType::Fp16, Layout::Nhwc), (DType::Fp32, Layout::Nchw)];

/// Every distinct layer of a zoo `model` at batch `n` in each of `configs`.
fn zoo_in(model: Model, n: i64, configs: &[(DType, Layout)]) -> Vec<(String, ConvProblem)> {
    let mut layers = Vec::new();
    for &(dtype, layout) in configs {
        for layer in model.layers(n, dtype, layout) {
            layers.push((layer.name, layer.problem));
        }
    }
    layers
}

/// The video models at their default inputs: torchvision's r3d_18 at batch 2 (a clip
/// of 16 x 112 x 112) and the Wan 2.1 VAE decoder at 480p, batch 1 (17 frames of 480 x 832,
/// decoded chunk by chunk; its causal convolutions pad time on one side, which reaches the
/// convolution as an already padded input: `pad_d` 0). The decoder's upsamplers and
/// attention are 2-D convolutions (frames folded into the batch) and are checked as such.
fn video_layers() -> Vec<(String, ConvProblem)> {
    let mut layers = zoo_in(Model::R3d18, 2, &CONFIGS_3D);
    layers.extend(zoo_in(Model::WanVaeDecoder, 1, &CONFIGS_3D));
    layers
}

/// 3-D acceptance on the H100 description: every 3-D layer gets engine configurations
/// in all three ops, fp16 NDHWC and fp32 NCDHW; its 5-D legacy descriptors match the wall's
/// shapes and read back into the same problem; its micro-batch graphs finalize.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn video_3d_layers() {
    if enabled("video_3d_layers") {
        let layers = video_layers();
        let three_d = layers.iter().filter(|(_, p)| p.is_3d()).count();
        // r3d_18's 11 distinct Conv3d and the decoder's 3-D ones, in both configurations.
        assert!(three_d >= 2 * (11 + 10), "{three_d} 3-D layers");
        check_layers(layers, 1);
    }
}

/// wav2vec 2.0's feature encoder (7 Conv1d layers of 512 channels on one second of 16 kHz
/// audio) at batch 8: 1-D problems, which cuDNN runs as 2-D with unit height.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn speech_1d_layers() {
    if enabled("speech_1d_layers") {
        let layers = zoo_in(Model::Wav2Vec2Fe, BATCH, &CONFIGS_3D);
        assert_eq!(layers.len(), 2 * 7);
        assert!(layers.iter().all(|(_, p)| p.h == 1 && p.r == 1));
        check_layers(layers, 1);
    }
}

/// The 3-D checks can fail: a 5-D graph whose output is one frame too deep is refused
/// (CUDNN_STATUS_BAD_PARAM); the descriptors of a 3-D problem really are 5-D, and a 3-D
/// problem at the 2-D defaults in depth gets the 2-D (4-D) ones; other ranks are refused.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn three_d_negative_controls() {
    if !enabled("three_d_negative_controls") {
        return;
    }
    use mucudnn::backend::cudnn::{
        broken_graph_on_device, BrokenGraph, ConvolutionDescriptor, FilterDescriptor,
        TensorDescriptor,
    };
    let device = device();
    let (name, layer1) = zoo_in(Model::R3d18, 2, &[(DType::Fp16, Layout::Nhwc)]).remove(1);
    assert_eq!(name, "r3d_18.layer1.0.conv1.0");
    for op in ConvOp::ALL {
        match broken_graph_on_device(&device, &layer1, op, BrokenGraph::WrongOutputSize) {
            Err(CudnnError::Backend { code, .. }) => assert_eq!(code, 2000, "{op}"),
            other => panic!("{op}: a 5-D output one frame too deep gave {other:?}"),
        }
    }
    let d = ConvDescriptors::new(&layer1).unwrap();
    assert_eq!(d.input().dims(), [2, 64, 16, 56, 56]);
    assert_eq!(d.filter().dims(), [64, 64, 3, 3, 3]);
    assert_eq!(d.convolution().info().unwrap().pad, [1, 1, 1]);
    let flat = ConvProblem::new_3d(2, 3, 1, 9, 9, 4, 1, 3, 3);
    assert_eq!(ConvDescriptors::new(&flat).unwrap().input().dims().len(), 4);
    // Another depth padding reads back as set: the getter reports the descriptor, not the
    // problem.
    let shapes = ConvShapes::new(&layer1).unwrap();
    let padded_more = ConvShapes {
        pad: [2, 1, 1].into(),
        stride: [1, 2, 2].into(),
        ..shapes
    };
    let info = ConvolutionDescriptor::new(&padded_more)
        .unwrap()
        .info()
        .unwrap();
    assert_eq!(
        (info.pad, info.stride),
        ([2, 1, 1].into(), [1, 2, 2].into())
    );
    // Descriptors of ranks other than 4 and 5 are refused before cuDNN is asked.
    assert!(TensorDescriptor::new(DType::Fp32, Layout::Nchw, &[2, 3, 4]).is_err());
    assert!(FilterDescriptor::new(DType::Fp32, Layout::Nchw, &[2, 3, 4, 5, 6, 7]).is_err());
    let mixed = ConvShapes {
        stride: [1, 1].into(),
        ..shapes
    };
    assert!(ConvolutionDescriptor::new(&mixed).is_err());
}

// ---------------------------------------------------------------------------------------------
// Alignment, thread-safety and loader fixes, against the real library

/// Configurations per heuristics mode for `problem`, with tensors declaring `alignments`.
fn mode_counts(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    alignments: Alignments,
) -> [usize; 3] {
    HeurMode::ALL.map(|mode| {
        match heuristic_plan_workspaces_on_device(device, problem, op, mode, alignments) {
            Ok(results) => results.len(),
            Err(e) if e.is_not_supported() => 0,
            Err(e) => panic!("{} {op} {mode:?}: {e}", problem.describe()),
        }
    })
}

/// Fix 1: the odd stems before (alignment that holds at any sample offset, what every plan
/// declared) and after (the alignment of offset 0, where an undivided plan and every first
/// micro-batch run). Prints the table for docs/cudnn_host.md.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn odd_stems_gain_configurations_from_the_offset_alignment() {
    if !enabled("odd_stems_gain_configurations_from_the_offset_alignment") {
        return;
    }
    let device = device();
    println!("| stem | dtype | layout | op | align x/y before | A B fallback before | A B fallback after |");
    println!("|---|---|---|---|---|---|---|");
    for (dtype, layout) in CONFIGS {
        for (layer, problem) in odd_stems(dtype, layout) {
            let shapes = ConvShapes::new(&problem).unwrap();
            let before_align = Alignments::any_sample(&shapes);
            for op in ConvOp::ALL {
                let before = mode_counts(&device, &problem, op, before_align);
                let after = mode_counts(&device, &problem, op, Alignments::MAX);
                println!(
                    "| {layer} | {dtype} | {} | {op} | {}/{} | {} {} {} | {} {} {} |",
                    layout_name(layout),
                    before_align.x,
                    before_align.y,
                    before[0],
                    before[1],
                    before[2],
                    after[0],
                    after[1],
                    after[2]
                );
                // Acceptance: modes A and B offer configurations in every op and dtype.
                assert!(
                    after[0] > 0 && after[1] > 0,
                    "{layer} {dtype} {op}: {after:?}"
                );
                for i in 0..3 {
                    assert!(
                        after[i] >= before[i],
                        "{layer} {dtype} {op}: {before:?} -> {after:?}"
                    );
                }
            }
        }
    }
    // The original failure: 3x299x299 fp16 NHWC backward-filter had nothing from modes A and
    // B at the old alignment; the same check at the old alignment is the negative control.
    let (_, stem) = odd_stems(DType::Fp16, Layout::Nhwc).remove(0);
    let old = Alignments::any_sample(&ConvShapes::new(&stem).unwrap());
    let before = mode_counts(&device, &stem, ConvOp::BackwardFilter, old);
    assert_eq!([before[0], before[1]], [0, 0], "{before:?}");
}

// ---------------------------------------------------------------------------------------------
// What is timed can be prepared wherever a plan runs it

/// PyTorch's AlexNet-style stem at N = 12 in fp16 NHWC with 3 unpadded channels: 3 x 227 x 227
/// x 2 bytes per sample is only 2-byte aligned, so sample 4 is 8-byte aligned and sample 8
/// 16-byte aligned.
fn alexnet_conv1_fp16_n12() -> ConvProblem {
    ConvProblem {
        stride_h: 4,
        stride_w: 4,
        dtype: DType::Fp16,
        layout: Layout::Nhwc,
        ..ConvProblem::new(12, 3, 227, 227, 96, 11, 11)
    }
}

/// The engine configurations the profiler would time for `micro` samples of `problem` when
/// its tensors declare `timed` (every heuristics mode; only those whose plans build there, for
/// backward-filter with beta = 0 and 1, as `CudnnBackend::time_engine` keeps them).
fn timed_configs(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    micro: i64,
    timed: Alignments,
) -> Vec<EngineConfig> {
    let micro_problem = problem.with_batch(micro);
    let all_modes = EngineSearch {
        max_candidates: usize::MAX,
        ..EngineSearch::default()
    };
    let configs = match engine_configs_on_device(device, &micro_problem, op, &all_modes, timed) {
        Ok(configs) => configs,
        Err(e) if e.is_not_supported() => Vec::new(),
        Err(e) => panic!("{op} at {micro}: {e}"),
    };
    let betas: &[f32] = if op == ConvOp::BackwardFilter {
        &[0.0, 1.0]
    } else {
        &[0.0]
    };
    configs
        .into_iter()
        .filter(|config| {
            betas.iter().all(|&beta| {
                plan_on_device(device, &micro_problem, op, config, beta, timed).is_ok()
            })
        })
        .collect()
}

/// Every micro-batch of the plan `sizes` (each at its real offset, with its real beta) built
/// with every configuration timed for its size under `timing` (size -> declared alignments):
/// the failures, as `(op, size, first, config, error)` lines.
fn unbuildable_steps(
    device: &DeviceDescription,
    problem: &ConvProblem,
    sizes: &[i64],
    timing: impl Fn(&ConvShapes, i64) -> Alignments,
) -> (usize, Vec<String>) {
    let mut built = 0;
    let mut failures = Vec::new();
    for op in ConvOp::ALL {
        let mut first = 0usize;
        for (index, &size) in sizes.iter().enumerate() {
            let micro_problem = problem.with_batch(size);
            let shapes = ConvShapes::new(&micro_problem).unwrap();
            let timed = timing(&shapes, size);
            let run_at = Alignments::at_sample(&shapes, first);
            let beta = if op == ConvOp::BackwardFilter && index > 0 {
                1.0
            } else {
                0.0
            };
            for config in timed_configs(device, problem, op, size, timed) {
                match plan_on_device(device, &micro_problem, op, &config, beta, run_at) {
                    Ok(_) => built += 1,
                    Err(e) => failures.push(format!(
                        "{op} micro-batch {size} at sample {first} ({run_at:?}), timed at \
                         {timed:?}: {config}: {e}"
                    )),
                }
            }
            first += size as usize;
        }
    }
    (built, failures)
}

/// The acceptance test: AlexNet conv1 fp16 NHWC at N = 12 split 4+4+4 (and 5+3+4, odd
/// offsets): every configuration timed under the profiler's rule (the alignment that holds at
/// every offset, `Alignments::any_sample`) builds at every micro-batch's real offset, in every
/// op. The old rule (the alignment of sample N - m) is the negative control: it timed size 4
/// at sample 8 (16 bytes) and configurations that need 16 bytes failed at sample 4 (8 bytes).
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn every_micro_batch_builds_at_its_offset() {
    enabled("every_micro_batch_builds_at_its_offset");
    let device = device();
    let problem = alexnet_conv1_fp16_n12();
    let shapes = ConvShapes::new(&problem).unwrap();
    assert_eq!(Alignments::at_sample(&shapes, 4).x, 8);
    assert_eq!(Alignments::at_sample(&shapes, 8).x, 16);
    for sizes in [&[4, 4, 4][..], &[5, 3, 4][..]] {
        let (built, failures) =
            unbuildable_steps(&device, &problem, sizes, |s, _| Alignments::any_sample(s));
        println!("{sizes:?}: {built} micro-batch plans built at their offsets");
        assert!(built > 0, "{sizes:?}: no configuration was timed at all");
        assert!(failures.is_empty(), "{sizes:?}:\n{}", failures.join("\n"));
    }
    // The old rule: size m declared the alignment of sample N - m.
    let n = problem.n;
    let (built, failures) = unbuildable_steps(&device, &problem, &[4, 4, 4], |s, m| {
        Alignments::at_sample(s, (n - m) as usize)
    });
    println!(
        "old rule, 4+4+4: {built} built, {} failed at their offsets",
        failures.len()
    );
    assert!(
        !failures.is_empty(),
        "the old rule should time configurations that fail at sample 4"
    );
}

/// Builds the first four of `configs` (to keep the tier short) for the chunk `view` at its own
/// offset, with the beta of a plan's call after `earlier_calls` others (backward-filter sums
/// its chunks: beta 1 after the first): how many built. A configuration cuDNN declines is not
/// counted; any other error goes to `failures`, after `what`.
fn build_first_chunk_plans(
    (device, view, op): (&DeviceDescription, &ChunkShapes, ConvOp),
    configs: &[EngineConfig],
    earlier_calls: usize,
    what: &str,
    failures: &mut Vec<String>,
) -> usize {
    let beta = if op == ConvOp::BackwardFilter && earlier_calls > 0 {
        1.0
    } else {
        0.0
    };
    let mut built = 0;
    for config in configs.iter().take(4) {
        match plan_for_chunk_on_device(device, view, op, config, beta, view.alignments()) {
            Ok(_) => built += 1,
            Err(e) if e.is_not_supported() => {}
            Err(e) => failures.push(format!("{what}: {config}: {e}")),
        }
    }
    built
}

/// Zoo-like problems split along their outermost spatial axis (2-D 3x3 pad 1 fp16
/// NHWC, 3-D 3x3x3 pad 1 fp16 NDHWC, a stride-2 2-D layer), in uneven chunkings of 2, 3 and 7
/// chunks, every op. Every chunk's graph (views of the full tensors: the chunk's rows, the full
/// strides; the split axis padded only at the border, so boundary chunks pad one side only)
/// finalizes with the alignment of any row offset (what `CudnnBackend::measure_spatial`
/// declares), heuristics offer configurations for it, and those configurations build at the
/// chunk's real offset with its real beta (backward-filter: 1 after the first call). A chunk
/// whose padding does not make its output rows is refused (the negative control).
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn spatial_chunks_build_with_asymmetric_padding() {
    use mucudnn::solver::spatial::{chunks, split_axis, AxisGeometry};
    enabled("spatial_chunks_build_with_asymmetric_padding");
    let device = device();
    let fp16 = |p: ConvProblem| ConvProblem {
        dtype: DType::Fp16,
        layout: Layout::Nhwc,
        ..p
    };
    let problems = [
        (
            "2-D 3x3 pad 1",
            fp16(ConvProblem {
                pad_h: 1,
                pad_w: 1,
                ..ConvProblem::new(1, 64, 40, 48, 64, 3, 3)
            }),
        ),
        (
            "3-D 3x3x3 pad 1",
            fp16(ConvProblem {
                pad_d: 1,
                pad_h: 1,
                pad_w: 1,
                ..ConvProblem::new_3d(1, 32, 17, 24, 24, 32, 3, 3, 3)
            }),
        ),
        (
            "2-D 3x3 pad 1 stride 2",
            fp16(ConvProblem {
                pad_h: 1,
                pad_w: 1,
                stride_h: 2,
                stride_w: 2,
                ..ConvProblem::new(1, 64, 41, 40, 64, 3, 3)
            }),
        ),
    ];
    let all_modes = EngineSearch {
        max_candidates: usize::MAX,
        ..EngineSearch::default()
    };
    let (mut graphs, mut asymmetric, mut built) = (0, 0, 0);
    let mut failures = Vec::new();
    for (name, problem) in problems {
        let geometry = AxisGeometry::of(&problem, split_axis(&problem));
        for op in ConvOp::ALL {
            let extent = geometry.extent(op);
            // Uneven chunkings of 2, 3 and 7 chunks.
            let two = vec![extent / 3, extent - extent / 3];
            let three = vec![2, extent / 2, extent - 2 - extent / 2];
            let mut seven = vec![1, 3, 2, 4, 1, 2];
            seven.push(extent - seven.iter().sum::<i64>());
            for sizes in [two, three, seven] {
                let parts = chunks(&geometry, op, &sizes)
                    .unwrap_or_else(|| panic!("{name} {op}: {sizes:?} of {extent}"));
                let mut calls = 0;
                for chunk in parts.iter().filter(|c| c.has_call()) {
                    let view = ChunkShapes::new(&problem, chunk).unwrap();
                    let what = format!("{name} {op} {sizes:?} {chunk:?}");
                    if !view.is_symmetric() {
                        asymmetric += 1;
                    }
                    let timed = view.any_row_alignments();
                    let configs = match engine_configs_for_chunk_on_device(
                        &device, &view, op, &all_modes, timed,
                    ) {
                        Ok(configs) => configs,
                        Err(e) => {
                            failures.push(format!("{what}: no graph or heuristics: {e}"));
                            continue;
                        }
                    };
                    graphs += 1;
                    if configs.is_empty() {
                        failures.push(format!("{what}: no configuration"));
                    }
                    built += build_first_chunk_plans(
                        (&device, &view, op),
                        &configs,
                        calls,
                        &what,
                        &mut failures,
                    );
                    calls += 1;
                }
            }
        }
    }
    println!(
        "{graphs} chunk graphs ({asymmetric} with one-sided padding), {built} plans built at \
         their offsets"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(asymmetric > 0 && built > graphs);
    // Negative control: one more row of padding after the chunk than its output rows need.
    let (_, problem) = problems[0];
    let geometry = AxisGeometry::of(&problem, split_axis(&problem));
    let parts = chunks(&geometry, ConvOp::Forward, &[13, 27]).unwrap();
    let mut view = ChunkShapes::new(&problem, &parts[0]).unwrap();
    view.chunk.pad_after += 2;
    let refused = engine_configs_for_chunk_on_device(
        &device,
        &view,
        ConvOp::Forward,
        &all_modes,
        Alignments::MAX,
    );
    assert!(refused.is_err(), "{refused:?}");
    // A strided legacy descriptor (what rows no call writes are scaled through) reads back
    // with the full tensor's strides.
    let rows = ChunkShapes::new(&problem, &parts[1]).unwrap();
    let desc = TensorDescriptor::strided(
        problem.dtype,
        &rows.dims(Operand::Output),
        &rows.strides(Operand::Output),
    )
    .unwrap();
    let info = desc.info().unwrap();
    assert_eq!(
        info.dims.iter().map(|&d| i64::from(d)).collect::<Vec<_>>(),
        rows.dims(Operand::Output).to_vec()
    );
    assert_eq!(
        info.strides
            .iter()
            .map(|&d| i64::from(d))
            .collect::<Vec<_>>(),
        rows.strides(Operand::Output).to_vec()
    );
}

/// The GPU test's spatial cases (tests/spatial/cases.rs) built here first: for every case and
/// op, the chunks the profiler times at the even chunk size (start, middle and end) and the
/// chunks of the plans the GPU test runs (equal chunks of that size; 2, 3 and 7 uneven ones),
/// as views of the full tensors. The fp32 NCHW cases' chunks are strided views of the rows.
/// Every chunk graph must finalize or be declined as unsupported (never another error); the
/// channels-last cases must be offered configurations that build at every chunk. What cuDNN
/// takes of the strided views is printed, as the GPU test reports it (not asserted there).
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn spatial_chunks_of_the_gpu_test_build() {
    use mucudnn::solver::spatial::{chunks, split_axis, timing_chunks, AxisGeometry};
    enabled("spatial_chunks_of_the_gpu_test_build");
    let device = device();
    let all_modes = EngineSearch {
        max_candidates: usize::MAX,
        ..EngineSearch::default()
    };
    let mut failures = Vec::new();
    let mut table = Vec::new();
    for case in spatial::cases() {
        let problem = case.problem;
        let geometry = AxisGeometry::of(&problem, split_axis(&problem));
        for op in ConvOp::ALL {
            let extent = geometry.extent(op);
            let size = spatial::even_chunk(extent);
            let mut chunkings = vec![vec![size; (extent / size) as usize]];
            chunkings.extend(spatial::uneven_chunkings(extent));
            // The timed positions, then each plan's chunks: a group's first call has beta 0.
            let mut groups = vec![timing_chunks(&geometry, op, size)];
            for sizes in &chunkings {
                groups.push(chunks(&geometry, op, sizes).unwrap());
            }
            let calls = groups
                .iter()
                .flat_map(|group| group.iter().filter(|c| c.has_call()).enumerate());
            // (chunk views, with configurations, plans built of the first four of each)
            let (mut views, mut offered, mut built) = (0, 0, 0);
            for (i, chunk) in calls {
                let what = format!("{} {op} {chunk:?}", case.label);
                let view = ChunkShapes::new(&problem, chunk).unwrap();
                views += 1;
                let configs = match engine_configs_for_chunk_on_device(
                    &device,
                    &view,
                    op,
                    &all_modes,
                    view.any_row_alignments(),
                ) {
                    Ok(configs) => configs,
                    Err(e) if e.is_not_supported() => Vec::new(),
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        continue;
                    }
                };
                let count = build_first_chunk_plans(
                    (&device, &view, op),
                    &configs,
                    i,
                    &what,
                    &mut failures,
                );
                built += count;
                if count > 0 {
                    offered += 1;
                } else if !case.strided_rows {
                    failures.push(format!("{what}: no configuration builds"));
                }
            }
            table.push(format!(
                "{:<40} {op:<11} chunk {size:>2} of {extent:>2}: {offered:>3} of {views:>3} \
                 chunk views take an engine ({built} plans)",
                case.label
            ));
        }
    }
    println!("{}", table.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Negative controls: the checks can fail. A wrong output size and swapped tensors are
/// refused with CUDNN_STATUS_BAD_PARAM (2000); a configuration that does not exist does not
/// build.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn negative_controls_fail() {
    if !enabled("negative_controls_fail") {
        return;
    }
    use mucudnn::backend::cudnn::{broken_graph_on_device, BrokenGraph};
    let device = device();
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(BATCH, 64, 56, 56, 64, 3, 3)
    };
    for op in ConvOp::ALL {
        match broken_graph_on_device(&device, &problem, op, BrokenGraph::WrongOutputSize) {
            Err(CudnnError::Backend { code, .. }) => assert_eq!(code, 2000, "{op}"),
            other => panic!("{op}: a wrong output size gave {other:?}"),
        }
    }
    let swapped = ConvProblem { k: 32, ..problem };
    match broken_graph_on_device(
        &device,
        &swapped,
        ConvOp::BackwardData,
        BrokenGraph::SwappedTensors,
    ) {
        Err(CudnnError::Backend { code, .. }) => assert_eq!(code, 2000),
        other => panic!("swapped dx/dy gave {other:?}"),
    }
    // The correct graph builds (the controls differ from it in one thing only).
    let fine = heuristic_plan_workspaces_on_device(
        &device,
        &problem,
        ConvOp::Forward,
        HeurMode::A,
        Alignments::MAX,
    )
    .unwrap();
    assert!(!fine.is_empty());
    let bogus: EngineConfig = "eng9999".parse().unwrap();
    assert!(plan_on_device(
        &device,
        &problem,
        ConvOp::Forward,
        &bogus,
        0.0,
        Alignments::MAX
    )
    .is_err());
}

/// Fix 4: mode-B heuristics from several threads at once (serialized inside the wall) give
/// every thread the same list.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn mode_b_heuristics_from_several_threads() {
    if !enabled("mode_b_heuristics_from_several_threads") {
        return;
    }
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        dtype: DType::Fp16,
        layout: Layout::Nhwc,
        ..ConvProblem::new(BATCH, 64, 56, 56, 64, 3, 3)
    };
    let lists: Vec<Vec<String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(move || {
                    let device = device();
                    (0..3)
                        .flat_map(|_| {
                            engine_configs_on_device(
                                &device,
                                &problem,
                                ConvOp::Forward,
                                &search(HeurMode::B),
                                Alignments::MAX,
                            )
                            .unwrap()
                        })
                        .map(|c| c.to_string())
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(!lists[0].is_empty());
    assert!(lists.iter().all(|l| *l == lists[0]), "{lists:?}");
}

// ---------------------------------------------------------------------------------------------
// Hidden libraries: this test binary runs itself with one library left out
// of the library path and must get an error value naming it, never an abort or a panic.

/// A folder beside the cached libraries holding hard links to every library of `dirs`
/// except `hidden` (hard links: `libcudnn.so.9` finds its sub-libraries through `$ORIGIN`).
fn library_dir_without(dirs: &[PathBuf], hidden: &str, tag: &str) -> PathBuf {
    let base = dirs[0]
        .parent()
        .unwrap()
        .join(format!(".hidden-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    for dir in dirs {
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name();
            if name.to_string_lossy() == hidden || !entry.file_type().unwrap().is_file() {
                continue;
            }
            let target = base.join(&name);
            if std::fs::hard_link(entry.path(), &target).is_err() {
                std::fs::copy(entry.path(), &target).unwrap();
            }
        }
    }
    base
}

fn host_dir(var: &str) -> PathBuf {
    PathBuf::from(std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run under eval \"$(bash scripts/cudnn_host_env.sh)\"")
    }))
}

/// Runs `child_probe` in a child process with `LD_LIBRARY_PATH=library_path` and returns
/// its exit status and output.
fn run_child(action: &str, library_path: &Path) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_probe",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, action)
        .env("LD_LIBRARY_PATH", library_path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// The child's side: does what the parent asks and prints `CHILD-RESULT: ...`.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn child_probe() {
    // Run directly (not as a child), it checks the graph path with every library present.
    let action = std::env::var(CHILD).unwrap_or_else(|_| {
        enabled("child_probe");
        "graph".to_string()
    });
    let result = match action.as_str() {
        // The backend on the graph path: the gate must refuse before cuDNN can abort.
        "graph" => {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/h100-device-description.json");
            let json = std::fs::read_to_string(path).unwrap();
            DeviceDescription::from_json(&json).and_then(|device| {
                let problem = ConvProblem {
                    pad_h: 1,
                    pad_w: 1,
                    dtype: DType::Fp16,
                    layout: Layout::Nhwc,
                    ..ConvProblem::new(BATCH, 64, 56, 56, 64, 3, 3)
                };
                for op in ConvOp::ALL {
                    for (config, _) in heuristic_plan_workspaces_on_device(
                        &device,
                        &problem,
                        op,
                        HeurMode::A,
                        Alignments::MAX,
                    )? {
                        let _ =
                            plan_on_device(&device, &problem, op, &config, 0.0, Alignments::MAX);
                    }
                }
                Ok(())
            })
        }
        "probe" => mucudnn::backend::cudnn::probe().map(|_| ()),
        // The GPU entry points, first in a fresh process: each must call cuInit before any
        // other driver call (the stub answers CUDA_ERROR_NOT_INITIALIZED to one out of order).
        "handle" => mucudnn::backend::cudnn::CudnnHandle::new(0).map(|_| ()),
        "tuner" => {
            let mut tuner = std::ptr::null_mut();
            // SAFETY: a valid out pointer; NULL options (the defaults).
            let status =
                unsafe { mucudnn::c_abi::mucudnnTunerCreate(&mut tuner, 0, std::ptr::null()) };
            println!("CHILD-RESULT: error: {status:?}: {}", last_c_error());
            return;
        }
        // The negative control: a driver call before cuInit, as a test once made.
        "context-before-init" => {
            let current = cudarc::driver::result::ctx::get_current();
            println!("CHILD-RESULT: error: {current:?}");
            return;
        }
        other => panic!("unknown child action {other}"),
    };
    match result {
        Ok(()) => println!("CHILD-RESULT: ok"),
        Err(e) if std::env::var(CHILD).is_ok() => println!("CHILD-RESULT: error: {e}"),
        Err(e) => panic!("the graph path with every library present: {e}"),
    }
}

/// The C ABI's last error on this thread.
fn last_c_error() -> String {
    let message = mucudnn::c_abi::mucudnnGetLastError();
    if message.is_null() {
        return String::new();
    }
    // SAFETY: mucudnn's last error is a NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned()
}

fn child_result(text: &str) -> &str {
    text.lines()
        .find_map(|l| l.split_once("CHILD-RESULT: ").map(|(_, rest)| rest.trim()))
        .unwrap_or_else(|| panic!("the child printed no result:\n{text}"))
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn missing_cublas_lt_is_an_error_naming_it() {
    if !enabled("missing_cublas_lt_is_an_error_naming_it") {
        return;
    }
    let dirs = [
        host_dir("MUCUDNN_HOST_STUB_DIR"),
        host_dir("MUCUDNN_HOST_CUDNN_DIR"),
        host_dir("MUCUDNN_HOST_CUBLAS_DIR"),
    ];
    let dir = library_dir_without(&dirs, "libcublasLt.so.13", "cublaslt");
    let (status, text) = run_child("graph", &dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "the child died ({status}):\n{text}");
    let result = child_result(&text);
    assert!(result.contains("libcublasLt.so.13"), "{result}");
    // With cuBLAS present the same child succeeds (the control).
    let all = library_dir_without(&dirs, "", "all");
    let (status, text) = run_child("graph", &all);
    let _ = std::fs::remove_dir_all(&all);
    assert!(status.success(), "{text}");
    assert_eq!(child_result(&text), "ok");
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn missing_sub_library_is_an_error_naming_it() {
    if !enabled("missing_sub_library_is_an_error_naming_it") {
        return;
    }
    let dirs = [
        host_dir("MUCUDNN_HOST_STUB_DIR"),
        host_dir("MUCUDNN_HOST_CUDNN_DIR"),
        host_dir("MUCUDNN_HOST_CUBLAS_DIR"),
    ];
    for hidden in [
        "libcudnn_cnn.so.9",
        "libcudnn_ops.so.9",
        "libcudnn_graph.so.9",
    ] {
        let dir = library_dir_without(&dirs, hidden, "sub");
        let (status, text) = run_child("graph", &dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            status.success(),
            "{hidden}: the child died ({status}):\n{text}"
        );
        let result = child_result(&text);
        assert!(result.contains(hidden), "{hidden}: {result}");
    }
}

/// The stub libcuda keeps the driver's state machine (every call before cuInit answers
/// CUDA_ERROR_NOT_INITIALIZED), so a GPU entry point that calls the driver out of order fails
/// here, in a fresh process, as it would on a GPU: each must fail for want of a device instead.
/// The negative control makes such a call and gets the stub's answer.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn gpu_entry_points_initialise_the_driver_first() {
    enabled("gpu_entry_points_initialise_the_driver_first");
    let path = std::env::var("LD_LIBRARY_PATH").unwrap();
    for action in ["probe", "handle", "tuner"] {
        let (status, text) = run_child(action, Path::new(&path));
        assert!(
            status.success(),
            "{action}: the child died ({status}):\n{text}"
        );
        let result = child_result(&text);
        assert!(
            result.contains("CUDA_ERROR_NO_DEVICE") && !result.contains("NOT_INITIALIZED"),
            "{action}: {result}"
        );
    }
    let (status, text) = run_child("context-before-init", Path::new(&path));
    assert!(status.success(), "the child died ({status}):\n{text}");
    let result = child_result(&text);
    assert!(result.contains("CUDA_ERROR_NOT_INITIALIZED"), "{result}");
}

#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn libcuda_without_error_names_is_an_error_not_a_panic() {
    if !enabled("libcuda_without_error_names_is_an_error_not_a_panic") {
        return;
    }
    let bare = host_dir("MUCUDNN_HOST_STUB_DIR").join("bare");
    let (status, text) = run_child("probe", &bare);
    assert!(status.success(), "the child died ({status}):\n{text}");
    let result = child_result(&text);
    assert!(result.contains("CUDA_ERROR_NO_DEVICE"), "{result}");
}

/// The known-bad list (`backend::cudnn::known_bad`) on the real library and the H100
/// description. Read for cuDNN 9.14 (in the broken TF32 3-D range; the GPU machine's system
/// cuDNN), an fp32 NCDHW layer of r3d_18 in the default math mode is offered no tensor-core
/// (TF32) engine configuration in any op; read for the loaded cuDNN (outside the range), the
/// same enumeration offers some, so the list is what removed them; a 2-D fp32 layer is left
/// alone. The legacy descriptor's math type is what the list says for the loaded version.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn known_bad_tf32_3d_configurations_are_not_offered() {
    if !enabled("known_bad_tf32_3d_configurations_are_not_offered") {
        return;
    }
    use mucudnn::backend::cudnn::known_bad::effective_math;
    use mucudnn::backend::cudnn::{cudnn_version, known_bad::KNOWN_BAD};
    use mucudnn::solver::MathMode;
    let device = device();
    let loaded = cudnn_version().unwrap();
    let in_range = 9_14_00;
    assert!(KNOWN_BAD
        .iter()
        .any(|bad| bad.applies(in_range, DType::Fp32, 3)));
    assert!(
        !KNOWN_BAD
            .iter()
            .any(|bad| bad.applies(loaded, DType::Fp32, 3)),
        "the host tier's cuDNN {loaded} is itself in a known-bad range: pick a version outside"
    );
    let (name, video) = zoo_in(Model::R3d18, 2, &[(DType::Fp32, Layout::Nchw)]).remove(1);
    assert_eq!(name, "r3d_18.layer1.0.conv1.0");
    assert!(video.is_3d() && video.math == MathMode::Default);
    let image = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(2, 64, 56, 56, 64, 3, 3)
    };
    // Tensor-core configurations offered for `problem` and `op` with the list read for
    // `version`, out of how many (their notes from a plan built on the description).
    let tensor_core = |problem: &ConvProblem, op: ConvOp, version: Option<u64>| {
        let search = EngineSearch {
            max_candidates: usize::MAX,
            known_bad_version: version,
            ..EngineSearch::default()
        };
        let configs =
            engine_configs_on_device(&device, problem, op, &search, Alignments::MAX).unwrap();
        let with_notes: Vec<bool> = configs
            .iter()
            .filter_map(|config| {
                plan_on_device(&device, problem, op, config, 0.0, Alignments::MAX)
                    .ok()
                    .map(|plan| plan.notes.tensor_core)
            })
            .collect();
        (
            with_notes.iter().filter(|&&tc| tc).count(),
            with_notes.len(),
        )
    };
    for op in ConvOp::ALL {
        let (bad_tc, bad_all) = tensor_core(&video, op, Some(in_range));
        let (tc, all) = tensor_core(&video, op, None);
        println!(
            "{name} fp32 {op}: as cuDNN {in_range}: {bad_tc} of {bad_all} tensor-core; \
             as the loaded {loaded}: {tc} of {all}"
        );
        assert_eq!(
            bad_tc, 0,
            "{op}: a TF32 configuration offered in the bad range"
        );
        assert!(bad_all > 0, "{op}: nothing left to time in the bad range");
        assert!(
            tc > 0,
            "{op}: the loaded cuDNN offers no TF32 configuration"
        );
        let (image_bad, _) = tensor_core(&image, op, Some(in_range));
        let (image_loaded, _) = tensor_core(&image, op, None);
        assert_eq!(image_bad, image_loaded, "{op}: a 2-D problem changed");
        assert!(image_bad > 0, "{op}: 2-D fp32 offers no TF32 configuration");
    }
    let math = ConvDescriptors::new(&video)
        .unwrap()
        .convolution()
        .info()
        .unwrap()
        .math;
    assert_eq!(
        math,
        Some(effective_math(loaded, DType::Fp32, 3, MathMode::Default))
    );
}

/// What an engine configuration's call costs on the host besides the launch: a variant pack
/// (the call's pointers) made, finalized and destroyed with the real library. Each call makes
/// one, as cuDNN's frontend does (a finalized pack takes no new pointers); caching them per
/// (plan, pointers) is worth it only if this costs more than 2 microseconds a call. Measured
/// as this thread's CPU time (the scheduler's count, in nanoseconds), the best of a few
/// rounds, so that the other tests and processes on the machine do not decide it.
#[test]
#[ignore = "needs the cuDNN host tier: run by scripts/test.sh under scripts/cudnn_host_env.sh (--include-ignored)"]
fn a_call_s_variant_pack_costs_under_two_microseconds() {
    if !enabled("a_call_s_variant_pack_costs_under_two_microseconds") {
        return;
    }
    use mucudnn::backend::cudnn::time_variant_packs;
    /// Nanoseconds this thread has run on a CPU (Linux's schedstat, first field).
    fn thread_cpu_ns() -> u64 {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
        text.split_whitespace().next().unwrap().parse().unwrap()
    }
    const CALLS: usize = 20_000;
    time_variant_packs(1_000).unwrap(); // warm up
    let (mut best_cpu, mut best_wall) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let before = thread_cpu_ns();
        let wall = time_variant_packs(CALLS).unwrap();
        let cpu = (thread_cpu_ns() - before) as f64 * 1e-9;
        best_cpu = best_cpu.min(cpu / CALLS as f64);
        best_wall = best_wall.min(wall / CALLS as f64);
    }
    println!(
        "variant pack: {:.3} us of CPU per call ({:.3} us wall; best of 5 x {CALLS})",
        best_cpu * 1e6,
        best_wall * 1e6
    );
    assert!(
        best_cpu < 2e-6,
        "a variant pack costs {:.3} us of CPU",
        best_cpu * 1e6
    );
}
