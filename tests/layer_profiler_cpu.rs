//! The drop-in layer and the profiler on the CPU backend: the layer tunes itself once per
//! shape and computes what a float64 reference computes; the profiler measures every
//! (size, algorithm), in parallel across devices too, and refuses to mix device models.

use mucudnn::backend::cpu::{self, reference, CpuAlgo};
use mucudnn::backend::{
    Backend, BackendError, CpuBackend, MeasureSettings, Measured, TimingSettings,
};
use mucudnn::cache::Cache;
use mucudnn::device::DeviceFingerprint;
use mucudnn::layer::{Conv2d, LayerError, Tensor};
use mucudnn::profiler::{profile_job, profile_job_parallel, Job};
use mucudnn::solver::{
    AlgoKind, CandidateSet, ConvOp, ConvProblem, Layout, MeasureKey, Measurement, Policy,
};

const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

fn tensor(dims: [usize; 4], layout: Layout, seed: u64) -> Tensor {
    let len = dims.iter().product();
    let data =
        mucudnn::backend::cudnn::host::random_values(mucudnn::solver::DType::Fp32, len, seed);
    Tensor { dims, layout, data }
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max)
        / scale;
    assert!(err < 1e-5, "{what}: relative error {err}");
}

#[test]
fn conv2d_tunes_once_and_matches_the_reference() {
    for layout in [Layout::Nchw, Layout::Nhwc] {
        let mut layer = Conv2d::new("toy.conv", 4, 6, 3)
            .with_padding(1)
            .with_stride(2)
            .with_layout(layout);
        let x = tensor([5, 4, 9, 8], layout, 1);
        assert!(layer.plans(5, 9, 8).is_none());
        let y = layer.forward(&x).unwrap();
        assert_eq!(y.dims, [5, 6, 5, 4]);
        let plans = layer.plans(5, 9, 8).expect("tuned on first use").clone();
        for (plan, op) in plans.iter().zip(ConvOp::ALL) {
            assert_eq!((plan.op, plan.batch()), (op, 5));
        }
        let problem = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            stride_h: 2,
            stride_w: 2,
            layout,
            ..ConvProblem::new(5, 4, 9, 8, 6, 3, 3)
        };
        let mut want = reference::conv_f64(
            &problem,
            ConvOp::Forward,
            &wide(&x.data),
            &wide(&layer.weight),
        )
        .unwrap();
        let bias = layer.bias.clone().unwrap();
        for n in 0..5 {
            for k in 0..6 {
                for p in 0..5 {
                    for q in 0..4 {
                        want[y.index(n, k, p, q)] += f64::from(bias[k]);
                    }
                }
            }
        }
        assert_close(&y.data, &want, "forward");

        let dy = tensor(y.dims, layout, 2);
        let grads = layer.backward(&x, &dy).unwrap();
        assert_eq!(
            layer.plans(5, 9, 8),
            Some(&plans),
            "a seen shape is not tuned again"
        );
        let dx = reference::conv_f64(
            &problem,
            ConvOp::BackwardData,
            &wide(&layer.weight),
            &wide(&dy.data),
        )
        .unwrap();
        assert_close(&grads.input.data, &dx, "dx");
        let dw = reference::conv_f64(
            &problem,
            ConvOp::BackwardFilter,
            &wide(&x.data),
            &wide(&dy.data),
        )
        .unwrap();
        assert_close(&grads.weight, &dw, "dw");
        let db: Vec<f64> = (0..6)
            .map(|k| {
                (0..5)
                    .flat_map(|n| (0..5).flat_map(move |p| (0..4).map(move |q| (n, p, q))))
                    .map(|(n, p, q)| f64::from(dy.data[dy.index(n, k, p, q)]))
                    .sum()
            })
            .collect();
        assert_close(grads.bias.as_ref().unwrap(), &db, "db");

        // A new batch size is a new shape: tuned then, and only then.
        layer.forward(&tensor([3, 4, 9, 8], layout, 3)).unwrap();
        assert!(layer.plans(3, 9, 8).is_some());
    }
}

#[test]
fn conv2d_rejects_bad_input() {
    let mut layer = Conv2d::new("toy.conv", 4, 6, 3).with_cache(Cache::in_memory());
    let cases = [
        (tensor([2, 3, 8, 8], Layout::Nchw, 1), "3 channels"),
        (tensor([2, 4, 8, 8], Layout::Nhwc, 1), "layer is nchw"),
        (tensor([2, 4, 2, 8], Layout::Nchw, 1), "output height"),
        (
            Tensor {
                dims: [2, 4, 8, 8],
                layout: Layout::Nchw,
                data: vec![1.0; 5],
            },
            "5 elements",
        ),
    ];
    for (x, expected) in cases {
        let err = layer.forward(&x).unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
    let x = tensor([2, 4, 8, 8], Layout::Nchw, 1);
    let err = layer
        .backward(&x, &tensor([2, 6, 5, 5], Layout::Nchw, 2))
        .unwrap_err();
    assert!(
        matches!(err, LayerError::Input { .. }) && err.to_string().contains("output gradient"),
        "{err}"
    );
    let mut grouped = Conv2d::new("toy.grouped", 4, 6, 3)
        .with_groups(4)
        .with_cache(Cache::in_memory());
    assert!(grouped
        .forward(&x)
        .unwrap_err()
        .to_string()
        .contains("divisible by groups"));
}

#[test]
fn profiler_measures_every_size_and_algorithm_with_cpu_workspaces() {
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(3, 2, 6, 6, 4, 3, 3)
    };
    for op in ConvOp::ALL {
        let job = Job::batch("toy", problem, op);
        let mut seen = 0;
        let profile = profile_job(&mut CpuBackend::new(), &job, Policy::All, &FAST, &mut |p| {
            seen += 1;
            assert_eq!((p.done, p.total), (seen, 3));
        })
        .unwrap();
        profile.validate().unwrap();
        assert_eq!(profile.measurements.len(), 3 * CpuAlgo::ALL.len());
        for m in &profile.measurements {
            let algo = CpuAlgo::from_id(m.algo.legacy().unwrap()).unwrap();
            assert_eq!(
                m.workspace_bytes,
                cpu::workspace_bytes(&problem.with_batch(m.micro), op, algo)
            );
            assert!(m.time_ms > 0.0);
        }
        // Im2colGemm's workspace grows with the micro-batch.
        let ws = |micro| {
            profile
                .measurements
                .iter()
                .find(|m| {
                    m.micro == micro
                        && m.algo == mucudnn::solver::Algo::Legacy(CpuAlgo::Im2colGemm.id())
                })
                .unwrap()
                .workspace_bytes
        };
        assert!(ws(1) < ws(2) && ws(2) < ws(3));

        // Two "devices" deal the sizes out and give the same (size, algo) set.
        let (device, parallel) =
            profile_job_parallel(|_| Ok(CpuBackend::new()), 2, &job, Policy::All, &FAST).unwrap();
        assert_eq!(device, mucudnn::device::cpu_fingerprint());
        let keys = |ms: &[Measurement]| {
            ms.iter()
                .map(|m| (m.micro, m.algo, m.workspace_bytes))
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(&parallel.measurements), keys(&profile.measurements));
    }
}

/// The profiler measures a 3-D problem on the CPU backend like a 2-D one, with workspaces that
/// count the depth.
#[test]
fn profiler_measures_a_3d_problem() {
    let problem = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        stride_d: 2,
        ..ConvProblem::new_3d(3, 2, 5, 4, 4, 3, 3, 2, 3)
    };
    // The 2-D problem of one input depth slice and one filter depth tap.
    let slice = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(3, 2, 4, 4, 3, 2, 3)
    };
    for op in ConvOp::ALL {
        let job = Job::batch("toy3d", problem, op);
        let profile = profile_job(
            &mut CpuBackend::new(),
            &job,
            Policy::All,
            &FAST,
            &mut |_| {},
        )
        .unwrap();
        profile.validate().unwrap();
        assert_eq!(profile.problem, problem);
        assert_eq!(profile.measurements.len(), 3 * CpuAlgo::ALL.len());
        for m in &profile.measurements {
            let algo = CpuAlgo::from_id(m.algo.legacy().unwrap()).unwrap();
            assert_eq!(
                m.workspace_bytes,
                cpu::workspace_bytes(&problem.with_batch(m.micro), op, algo)
            );
            assert!(m.time_ms > 0.0);
            if algo != CpuAlgo::Direct {
                // Output depth 3 and filter depth 3: the im2col matrix is 9 times the slice's.
                let flat = cpu::workspace_bytes(&slice.with_batch(m.micro), op, algo);
                assert!(m.workspace_bytes > 3 * flat, "{op} {algo}: {m:?} vs {flat}");
            }
        }
    }
}

/// Profile -> solve -> execute for a 3-D layer on the CPU, through a cache: the plans are for
/// the 3-D problem, stay within the workspace limit and compute what the reference computes.
#[test]
fn a_3d_layer_tunes_and_its_plans_execute_on_the_cpu() {
    use mucudnn::exec::{cpu_workspace_bytes, execute_cpu};
    use mucudnn::tune::{EngineOptions, LayerTuning};
    let problem = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        layout: Layout::Nhwc,
        ..ConvProblem::new_3d(4, 3, 4, 5, 5, 4, 3, 3, 2)
    };
    // Room for the batched im2col of two samples, not four.
    let limit = cpu::workspace_bytes(&problem.with_batch(2), ConvOp::Forward, CpuAlgo::Im2colGemm);
    let tuning = LayerTuning {
        policy: Policy::All,
        workspace_limit_bytes: limit,
        timing: FAST,
        candidates: CandidateSet::Legacy,
        engines: EngineOptions::default(),
        split: mucudnn::tune::SplitSetting::Batch,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    };
    let cache = Cache::in_memory();
    let plans = tuning
        .tune(&mut CpuBackend::new(), &cache, "toy3d.conv", &problem)
        .unwrap();
    for (plan, op) in plans.iter().zip(ConvOp::ALL) {
        assert_eq!((plan.problem, plan.op), (problem, op));
        assert_eq!(plan.batch(), problem.n);
        let workspace = cpu_workspace_bytes(plan);
        assert!(workspace <= limit, "{op}: {workspace} > {limit}");
        let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(&problem, op).unwrap();
        let dtype = mucudnn::solver::DType::Fp32;
        let a = mucudnn::backend::cudnn::host::random_values(dtype, la, 1);
        let b = mucudnn::backend::cudnn::host::random_values(dtype, lb, 2);
        let mut out = vec![f32::NAN; lo];
        let mut ws = cpu::AlignedWorkspace::new(workspace);
        execute_cpu(plan, 1.0, &a, &b, 0.0, &mut out, ws.as_bytes_mut()).unwrap();
        let want = reference::conv_f64(&problem, op, &wide(&a), &wide(&b)).unwrap();
        assert_close(&out, &want, &format!("{op} {:?}", plan.micro_batches));
    }
}

/// A CPU backend that claims to be another device.
struct Renamed(CpuBackend, DeviceFingerprint);

impl Backend for Renamed {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.1
    }
    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        self.0.measure(key, how)
    }
}

#[test]
fn parallel_profiling_refuses_different_device_models() {
    let job = Job::batch(
        "toy",
        ConvProblem::new(4, 2, 5, 5, 2, 3, 3),
        ConvOp::Forward,
    );
    let make = |device: usize| {
        let mut fingerprint = mucudnn::device::cpu_fingerprint();
        fingerprint.name = format!("model {device}");
        Ok(Renamed(CpuBackend::new(), fingerprint))
    };
    let err = profile_job_parallel(make, 2, &job, Policy::PowerOfTwo, &FAST).unwrap_err();
    assert!(matches!(err, BackendError::MixedDevices { .. }), "{err}");
    assert!(err.to_string().contains("model 0") && err.to_string().contains("model 1"));
    let bad = Job {
        problem: ConvProblem {
            c: -1,
            ..job.problem
        },
        ..job
    };
    assert!(profile_job(
        &mut CpuBackend::new(),
        &bad,
        Policy::All,
        &FAST,
        &mut |_| {}
    )
    .is_err());
}

/// `tune` on several devices: each job's missing sizes are dealt out over the devices and
/// stored in the cache; a second run measures nothing; a device of another model is refused.
#[test]
fn parallel_tuning_goes_through_the_cache() {
    use mucudnn::tune::{jobs_for, profile_jobs, profile_jobs_parallel, EngineOptions, ProfileRun};
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(4, 2, 6, 6, 3, 3, 3)
    };
    let jobs = jobs_for([
        ("toy.a".to_string(), problem),
        ("toy.b".to_string(), ConvProblem { k: 5, ..problem }),
    ]);
    let cache = Cache::in_memory();
    let run = ProfileRun {
        policy: Policy::All,
        timing: FAST,
        cache: &cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    };
    let fingerprint = mucudnn::device::cpu_fingerprint();
    let mut steps = 0;
    let (parallel, stats) = profile_jobs_parallel(
        |_| Ok(CpuBackend::new()),
        2,
        &fingerprint,
        &[AlgoKind::Legacy],
        &jobs,
        &run,
        &mut |_, _| steps += 1,
    )
    .unwrap();
    assert_eq!((stats.measured, stats.cached, steps), (24, 0, 24));
    parallel.validate().unwrap();
    // The same (size, algo, workspace) set as one device measuring everything.
    let (sequential, _) = profile_jobs(
        &mut CpuBackend::new(),
        &jobs,
        &ProfileRun {
            cache: &Cache::in_memory(),
            ..run
        },
        &mut |_, _| {},
    )
    .unwrap();
    let keys = |p: &mucudnn::solver::Profile| {
        p.entries
            .iter()
            .flat_map(|e| {
                e.measurements
                    .iter()
                    .map(|m| (e.op, m.micro, m.algo, m.workspace_bytes))
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&parallel), keys(&sequential));
    // Warm: nothing measured, same measurements.
    let (again, stats) = profile_jobs_parallel(
        |_| Ok(CpuBackend::new()),
        2,
        &fingerprint,
        &[AlgoKind::Legacy],
        &jobs,
        &run,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!((stats.measured, stats.cached), (0, 24));
    assert_eq!(again.entries, parallel.entries);
    // The devices must be the model the measurements are stored under.
    let mut other = fingerprint.clone();
    other.name = "another CPU".into();
    let err = profile_jobs_parallel(
        |_| Ok(CpuBackend::new()),
        2,
        &other,
        &[AlgoKind::Legacy],
        &jobs,
        &ProfileRun {
            cache: &Cache::in_memory(),
            ..run
        },
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("mix of devices"), "{err}");
}
