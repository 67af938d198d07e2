//! Tuning dealt out over processes, on the CPU backend: the tasks a cache lacks, measured in
//! shares by two "ranks" and exchanged, leave nothing missing, and both ranks then solve the
//! same plans without measuring. Stored records from elsewhere are checked first.

use mucudnn::backend::{Backend, CpuBackend, TimingSettings};
use mucudnn::cache::Cache;
use mucudnn::profiler::Job;
use mucudnn::solver::{Algo, AlgoKind, CandidateSet, ConvOp, ConvProblem, Measurement, Policy};
use mucudnn::tune::{
    jobs_for, measure_task, missing_tasks, store_measured, EngineOptions, LayerTuning,
    MeasuredTask, ProfileRun,
};

const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

fn run(cache: &Cache) -> ProfileRun<'_> {
    ProfileRun {
        policy: Policy::PowerOfTwo,
        timing: FAST,
        cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    }
}

fn jobs() -> Vec<Job> {
    let mut a = ConvProblem::new(8, 3, 6, 6, 4, 3, 3);
    (a.pad_h, a.pad_w) = (1, 1);
    let b = ConvProblem::new(8, 4, 6, 6, 4, 1, 1);
    // `c` repeats `a` under another name: its tasks are the same measurements.
    jobs_for([
        ("a".to_string(), a),
        ("b".to_string(), b),
        ("c".to_string(), a),
    ])
}

#[test]
fn shares_measured_by_two_ranks_complete_both_caches() {
    let (cache0, cache1) = (Cache::in_memory(), Cache::in_memory());
    let (mut rank0, mut rank1) = (CpuBackend::new(), CpuBackend::new());
    let jobs = jobs();
    let fingerprint = rank0.fingerprint().clone();
    let tasks = missing_tasks(&jobs, &run(&cache0), &fingerprint, &[AlgoKind::Legacy]).unwrap();
    // 3 layers x 3 ops x sizes 1, 2, 4, 8: anchors (1, 4, 8) of every layer before any size
    // between (2).
    assert_eq!(tasks.len(), 3 * 3 * 4);
    let first_between = tasks.iter().position(|t| t.between.is_some()).unwrap();
    assert_eq!(first_between, 3 * 3 * 3);
    assert!(tasks[first_between..]
        .iter()
        .all(|t| t.between == Some((1, 4))));
    let mut shares: [Vec<MeasuredTask>; 2] = [Vec::new(), Vec::new()];
    for between in [false, true] {
        let round: Vec<_> = tasks
            .iter()
            .filter(|t| t.between.is_some() == between)
            .collect();
        for (i, task) in round.iter().enumerate() {
            let (backend, cache, share) = if i % 2 == 0 {
                (&mut rank0, &cache0, 0)
            } else {
                (&mut rank1, &cache1, 1)
            };
            shares[share].push(measure_task(backend, task, &run(cache)).unwrap());
        }
        // Exchange this round's results before the next round (whose pruning reads them).
        store_measured(&cache0, &rank0, &fingerprint, &shares[1]).unwrap();
        store_measured(&cache1, &rank1, &fingerprint, &shares[0]).unwrap();
    }
    assert_eq!(shares[0].len() + shares[1].len(), tasks.len());
    for cache in [&cache0, &cache1] {
        assert!(
            missing_tasks(&jobs, &run(cache), &fingerprint, &[AlgoKind::Legacy])
                .unwrap()
                .is_empty()
        );
    }
    let tuning = LayerTuning {
        policy: Policy::PowerOfTwo,
        workspace_limit_bytes: 1 << 20,
        timing: FAST,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        split: mucudnn::tune::SplitSetting::Batch,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    };
    let problem = jobs[0].problem;
    let (plans0, stats0) = tuning
        .tune_counted(&mut rank0, &cache0, "a", &problem)
        .unwrap();
    let (plans1, stats1) = tuning
        .tune_counted(&mut rank1, &cache1, "a", &problem)
        .unwrap();
    assert_eq!(stats0.measured + stats1.measured, 0);
    assert_eq!(stats0.cached, 3 * 4);
    assert_eq!(plans0, plans1);
    assert_eq!(plans0.map(|p| p.op), ConvOp::ALL);
}

#[test]
fn stored_records_are_checked_before_anything_is_stored() {
    let cache = Cache::in_memory();
    let mut backend = CpuBackend::new();
    let fingerprint = backend.fingerprint().clone();
    let jobs = jobs();
    let tasks = missing_tasks(&jobs, &run(&cache), &fingerprint, &[AlgoKind::Legacy]).unwrap();
    let scratch = Cache::in_memory();
    let good = measure_task(&mut backend, &tasks[0], &run(&scratch)).unwrap();
    assert!(!good.measurements.is_empty());
    let mut wrong_size = good.clone();
    wrong_size.measurements[0].micro += 1;
    // Poisoned records: each refuses the whole batch, naming the record by its index among
    // the batch's measurements (the good task's come first).
    let first_bad = good.measurements.len();
    let poisoned = |f: &dyn Fn(&mut Measurement)| {
        let mut bad = good.clone();
        f(&mut bad.measurements[0]);
        bad
    };
    let (op, micro) = (good.task.op, good.task.micro);
    let cases: Vec<(MeasuredTask, String)> = vec![
        (wrong_size, format!("task 1 (a {op} micro-batch {micro})")),
        (
            poisoned(&|m| m.time_ms = f64::NAN),
            format!("record {first_bad} (a {op} micro-batch {micro})"),
        ),
        (poisoned(&|m| m.time_ms = 0.0), "positive finite".into()),
        (poisoned(&|m| m.time_ms = -1.0), "positive finite".into()),
        (
            poisoned(&|m| m.time_ms = f64::INFINITY),
            "positive finite".into(),
        ),
        (
            poisoned(&|m| m.algo = Algo::Legacy(999)),
            format!("algorithm 999 is not a {op} candidate of the cpu backend"),
        ),
        (
            poisoned(&|m| m.algo = Algo::Legacy(3)),
            "algorithm 3 is not a".into(),
        ),
        (
            poisoned(&|m| m.workspace_bytes = u64::MAX),
            "more than the device's".into(),
        ),
        // A measurement over its tolerance is a rejected candidate, never a measurement.
        (
            poisoned(&|m| {
                m.verification = Some(mucudnn::solver::Verification {
                    max_rel_error: 0.5,
                    tolerance: 1e-5,
                })
            }),
            "a rejected candidate, not a measurement".into(),
        ),
        (
            poisoned(&|m| {
                m.verification = Some(mucudnn::solver::Verification {
                    max_rel_error: f64::NAN,
                    tolerance: 1e-5,
                })
            }),
            "positive finite tolerance".into(),
        ),
        (
            {
                let mut bad = good.clone();
                bad.rejected = vec![bad.measurements[0]];
                bad.measurements.remove(0);
                bad
            },
            "listed as rejected".into(),
        ),
    ];
    for (bad, expect) in cases {
        let error = store_measured(&cache, &backend, &fingerprint, &[good.clone(), bad])
            .unwrap_err()
            .to_string();
        assert!(error.contains(&expect), "{expect:?} not in {error}");
        // Nothing of the batch was stored, the good record included.
        assert_eq!(
            missing_tasks(&jobs, &run(&cache), &fingerprint, &[AlgoKind::Legacy])
                .unwrap()
                .len(),
            tasks.len()
        );
    }
    // Another device's measurements are refused whole.
    let mut elsewhere = fingerprint.clone();
    elsewhere.name.push_str(" (another)");
    let error =
        store_measured(&cache, &backend, &elsewhere, std::slice::from_ref(&good)).unwrap_err();
    assert!(error.to_string().contains("taken on"), "{error}");
    assert_eq!(
        store_measured(&cache, &backend, &fingerprint, &[good]).unwrap(),
        1
    );
}

/// Validated stores through the C ABI: poisoned records given to `mucudnnTunerStore` (a zero,
/// negative, infinite or missing time, an algorithm number the backend does not have, a
/// workspace past the machine's memory, a negative workspace, another device) are refused with
/// INVALID_ARGUMENT and the record's index, nothing of the batch is stored, and the cache
/// still tunes. A stride past a C int is INVALID_ARGUMENT too.
#[test]
fn poisoned_stores_through_the_c_abi_are_refused_and_the_cache_still_tunes() {
    use mucudnn::c_abi::{
        mucudnnGetLastError, mucudnnStatus_t as Status, mucudnnTunerCreate, mucudnnTunerDestroy,
        mucudnnTunerMeasure, mucudnnTunerMissing, mucudnnTunerStore, mucudnnTunerTune,
        mucudnnTuner_t, MUCUDNN_DEVICE_CPU,
    };
    use serde_json::{json, Value};
    use std::ffi::{CStr, CString};

    fn c(text: &str) -> CString {
        CString::new(text).unwrap()
    }
    fn last_error() -> String {
        // SAFETY: the library's last error is a NUL-terminated string it owns.
        unsafe { CStr::from_ptr(mucudnnGetLastError()) }
            .to_string_lossy()
            .into_owned()
    }
    /// Calls a function that writes a JSON string, returning it (freed here).
    fn json_out(call: impl FnOnce(*mut *mut std::os::raw::c_char) -> Status) -> Value {
        let mut out = std::ptr::null_mut();
        let status = call(&mut out);
        assert_eq!(status, Status::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        // SAFETY: the library wrote a NUL-terminated string it allocated.
        let text = unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `out` came from the library and is freed once.
        unsafe { mucudnn::c_abi::mucudnnFreeString(out) };
        serde_json::from_str(&text).unwrap()
    }

    let dir = std::env::temp_dir().join(format!("mucudnn-poisoned-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let options = |file: &str| c(&json!({"cache": dir.join(file)}).to_string());
    let create = |file: &str| {
        let mut tuner: mucudnnTuner_t = std::ptr::null_mut();
        // SAFETY: valid out pointer and options string.
        let status =
            unsafe { mucudnnTunerCreate(&mut tuner, MUCUDNN_DEVICE_CPU, options(file).as_ptr()) };
        assert_eq!(status, Status::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        tuner
    };
    let (measurer, target) = (create("measurer.sqlite"), create("target.sqlite"));
    let problem = json!({"n": 4, "c": 3, "h": 6, "w": 6, "k": 4, "r": 3, "s": 3, "pad_h": 1,
        "pad_w": 1, "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1,
        "dtype": "fp32", "layout": "nchw"});
    let layers = c(&json!([{"layer": "a", "problem": problem}]).to_string());
    // SAFETY (every call below): valid tuner, NUL-terminated strings, valid out pointers.
    let tasks = json_out(|out| unsafe {
        mucudnnTunerMissing(measurer, layers.as_ptr(), std::ptr::null(), out)
    });
    let tasks = c(&tasks.to_string());
    let doc = json_out(|out| unsafe {
        mucudnnTunerMeasure(measurer, tasks.as_ptr(), std::ptr::null(), out)
    });
    let store = |doc: &Value| -> (Status, u64) {
        let text = c(&doc.to_string());
        let mut stored = 0u64;
        let status = unsafe { mucudnnTunerStore(target, text.as_ptr(), &mut stored) };
        (status, stored)
    };
    let missing_after = || -> usize {
        json_out(|out| unsafe {
            mucudnnTunerMissing(target, layers.as_ptr(), std::ptr::null(), out)
        })
        .as_array()
        .unwrap()
        .len()
    };
    let all_missing = missing_after();
    assert!(all_missing > 0);

    // The second task's first measurement is poisoned; its index counts the first task's.
    let first_task = doc["measured"][0]["measurements"].as_array().unwrap().len();
    let poisoned = |field: &str, value: Value| {
        let mut bad = doc.clone();
        bad["measured"][1]["measurements"][0][field] = value;
        bad
    };
    let cases = [
        (
            poisoned("time_ms", json!(0.0)),
            "time_ms must be a positive finite number, got 0",
        ),
        (poisoned("time_ms", json!(-1.5)), "got -1.5"),
        (poisoned("time_ms", Value::Null), "measured_json"), // NaN is written as null
        (poisoned("algo", json!(999)), "algorithm 999 is not a"),
        (
            poisoned("workspace_bytes", json!(u64::MAX)),
            "more than the device's",
        ),
        (poisoned("workspace_bytes", json!(-1)), "measured_json"),
    ];
    for (bad, expect) in &cases {
        let (status, stored) = store(bad);
        let error = last_error();
        assert_eq!(
            status,
            Status::MUCUDNN_STATUS_INVALID_ARGUMENT,
            "{expect}: {error}"
        );
        assert!(error.contains(expect), "{expect:?} not in {error}");
        if !expect.starts_with("measured_json") {
            assert!(error.contains(&format!("record {first_task} (")), "{error}");
        }
        assert_eq!(stored, 0);
        assert_eq!(
            missing_after(),
            all_missing,
            "nothing of the batch was stored"
        );
    }
    let mut foreign = doc.clone();
    foreign["fingerprint"]["name"] = json!("some other CPU");
    let (status, _) = store(&foreign);
    assert_eq!(status, Status::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert!(
        last_error().contains("taken on some other CPU"),
        "{}",
        last_error()
    );

    // The good batch is stored, and the cache tunes from it without measuring.
    let (status, stored) = store(&doc);
    assert_eq!(status, Status::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
    assert_eq!(stored as usize, doc["measured"].as_array().unwrap().len());
    assert_eq!(missing_after(), 0);
    let name = c("a");
    let problem_text = c(&problem.to_string());
    let tuned = json_out(|out| unsafe {
        mucudnnTunerTune(
            target,
            name.as_ptr(),
            problem_text.as_ptr(),
            std::ptr::null(),
            out,
        )
    });
    assert_eq!(tuned["measured"], 0, "{tuned}");
    // Splits name the CPU's algorithms.
    for split in tuned["splits"].as_array().unwrap() {
        let split = split.as_str().unwrap();
        assert!(
            ["@direct", "@im2col-batched", "@im2col-per-image"]
                .iter()
                .any(|name| split.contains(name)),
            "{split}"
        );
    }

    // Item 5: a stride of 2^62 is a bad argument, refused before any conversion.
    let mut huge = problem.clone();
    huge["stride_h"] = json!(1i64 << 62);
    let huge = c(&huge.to_string());
    let mut out = std::ptr::null_mut();
    let status = unsafe {
        mucudnnTunerTune(
            target,
            name.as_ptr(),
            huge.as_ptr(),
            std::ptr::null(),
            &mut out,
        )
    };
    assert_eq!(
        status,
        Status::MUCUDNN_STATUS_INVALID_ARGUMENT,
        "{}",
        last_error()
    );
    assert!(last_error().contains("stride_h"), "{}", last_error());

    for tuner in [measurer, target] {
        assert_eq!(mucudnnTunerDestroy(tuner), Status::MUCUDNN_STATUS_SUCCESS);
    }
    std::fs::remove_dir_all(&dir).ok();
}
