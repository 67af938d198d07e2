//! The cache's contract: what is stored comes back; a new limit is solved from cached
//! measurements; export -> clear -> import -> solve gives identical plans; a corrupt file, an
//! unwritable location and a newer schema never stop tuning; and 8 processes writing one file
//! at once lose nothing.

use mucudnn_cache::{Access, Cache, Location, PlanKey, READ_ONLY_ENV};
use mucudnn_solver::{
    interchange, solve_profile, Algo, AlgoKind, BackendKind, CandidateSet, ConvOp, ConvProblem,
    DeviceFingerprint, EngineName, MeasureKey, Measured, Measurement, Mode, OpKey, Policy, Profile,
    SizeVerification, SizesKey, SplitDim, Verification, WdOptions,
};
use std::path::{Path, PathBuf};
use std::process::Command;

fn h100() -> DeviceFingerprint {
    DeviceFingerprint {
        backend: BackendKind::Cuda,
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: Some((9, 0)),
        driver_version: Some(13000),
        cudnn_version: Some(91900),
    }
}

fn fixture() -> Profile {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/h100-alexnet-profile.json"
    );
    interchange::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("mucudnn-cache-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn m(micro: i64, algo: u32, time_ms: f64, workspace_bytes: u64) -> Measurement {
    Measurement {
        micro,
        algo: Algo::Legacy(algo),
        time_ms,
        workspace_bytes,
        verification: None,
    }
}

fn verified(m: Measurement, max_rel_error: f64) -> Measurement {
    Measurement {
        verification: Some(Verification {
            max_rel_error,
            tolerance: 1e-5,
        }),
        ..m
    }
}

/// A size measured with verification keeps its errors and its rejected candidates (with an
/// infinite error, for an output with NaN): a rejection is never a measurement, in a lookup,
/// a profile or an export, and survives reopening. A size measured without verification is
/// listed for a verifying tune; an imported one is verified when its records carry their
/// errors, else used as imported. A forged row, accepted but over its tolerance, is unusable.
#[test]
fn verified_sizes_keep_errors_and_rejections_apart() {
    let dir = temp_dir("verified");
    let path = dir.join("cache.sqlite");
    let device = h100();
    let problem = ConvProblem::new(8, 16, 12, 12, 16, 3, 3);
    let op = ConvOp::Forward;
    let key = |micro| MeasureKey::batch(problem, op, micro, AlgoKind::Legacy);
    let sizes = SizesKey::new(problem, op, SplitDim::Batch, AlgoKind::Legacy);
    let at_4 = Measured {
        measurements: vec![
            verified(m(4, 0, 1.0, 0), 0.0),
            verified(m(4, 1, 0.6, 64), 2e-7),
        ],
        rejected: vec![
            verified(m(4, 6, 0.1, 128), 0.31),
            verified(m(4, 7, 0.2, 128), f64::INFINITY),
        ],
        skipped: Vec::new(),
        verification: SizeVerification::Verified,
    };
    {
        let cache = Cache::open(&path).unwrap().quiet();
        cache.store_size(&device, "l", &key(4), &at_4);
        cache.store_measurements(&device, "l", &key(8), &[m(8, 0, 2.0, 0)]);
    }
    let cache = Cache::open(&path).unwrap().quiet();
    assert_eq!(cache.measured(&device, &key(4)), Some(at_4.clone()));
    assert_eq!(
        cache.measurements(&device, &key(4)),
        Some(at_4.measurements.clone())
    );
    let unverified = cache.measured(&device, &key(8)).unwrap();
    assert_eq!(unverified.verification, SizeVerification::Unverified);
    assert_eq!(cache.unverified_sizes(&device, &sizes, &[4, 8]), [8]);
    assert!(cache.missing_sizes(&device, &sizes, &[4, 8]).is_empty());
    let entry = cache
        .op_profile(
            &device,
            "l",
            &OpKey::new(problem, op, SplitDim::Batch),
            Policy::Undivided,
            CandidateSet::Legacy,
        )
        .unwrap();
    assert_eq!(entry.measurements, [m(8, 0, 2.0, 0)]);
    let summary = &cache.entries().unwrap()[0];
    assert_eq!((summary.measurements, summary.rejected), (3, 2));
    let exported = cache.export(Some(&device)).unwrap();
    let records: Vec<&Measurement> = exported[0].entries[0].measurements.iter().collect();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| !r.is_rejected()));
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());

    // Imports: a profile with every error is verified, one without is imported.
    let other = ConvProblem::new(8, 16, 12, 12, 32, 3, 3);
    let mut profile = exported[0].clone();
    profile.entries = vec![mucudnn_solver::OpProfile {
        layer: "imported".into(),
        problem: other,
        op,
        split: SplitDim::Batch,
        measurements: vec![verified(m(2, 0, 1.0, 0), 0.0), m(4, 0, 1.0, 0)],
        skipped: Vec::new(),
        rejected: Vec::new(),
    }];
    cache.import(&profile, &device, false).unwrap();
    let state = |micro| {
        cache
            .measured(
                &device,
                &MeasureKey::batch(other, op, micro, AlgoKind::Legacy),
            )
            .unwrap()
            .verification
    };
    assert_eq!(state(2), SizeVerification::Verified);
    assert_eq!(state(4), SizeVerification::Imported);
    let other_sizes = SizesKey::new(other, op, SplitDim::Batch, AlgoKind::Legacy);
    assert!(cache
        .unverified_sizes(&device, &other_sizes, &[2, 4])
        .is_empty());

    // A row marked accepted with an error over its tolerance is skipped, with a warning.
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE measurements SET max_rel_error = 0.5 WHERE algo = 1 AND rejected = 0",
        [],
    )
    .unwrap();
    drop(conn);
    let cache = Cache::open(&path).unwrap().quiet();
    assert_eq!(
        cache.measurements(&device, &key(4)),
        Some(vec![at_4.measurements[0]])
    );
    assert!(
        cache.warnings()[0].contains("skipped 1 cached row"),
        "{:?}",
        cache.warnings()
    );
    std::fs::remove_dir_all(&dir).ok();
}

fn engine(micro: i64, name: &str, time_ms: f64, workspace_bytes: u64) -> Measurement {
    Measurement {
        micro,
        algo: Algo::Engine(EngineName::new(name).unwrap()),
        time_ms,
        workspace_bytes,
        verification: None,
    }
}

/// Legacy algorithms and engine configurations are measured, stored and found separately:
/// a size measured for one kind is still missing for the other, storing one kind keeps the
/// other's rows, and a profile of `all` needs both.
#[test]
fn engine_configurations_are_a_separate_kind() {
    let cache = Cache::in_memory();
    let device = h100();
    let problem = ConvProblem::new(4, 8, 9, 9, 8, 3, 3);
    let op = ConvOp::Forward;
    for micro in [1, 2, 4] {
        let legacy = [m(micro, 1, 1.0, 0)];
        cache.store_measurements(
            &device,
            "l",
            &MeasureKey::batch(problem, op, micro, AlgoKind::Legacy),
            &legacy,
        );
    }
    assert_eq!(
        cache.missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Engine),
            &[1, 2, 4]
        ),
        vec![1, 2, 4]
    );
    assert!(cache
        .op_profile(
            &device,
            "l",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::All
        )
        .is_none());
    for micro in [1, 2, 4] {
        let engines = [
            engine(micro, "eng38_k2=8_k13=1", 0.5, 1024),
            engine(micro, "eng0", 2.0, 0),
            // A legacy row handed in with the engines is not stored as an engine.
            m(micro, 7, 0.1, 0),
        ];
        cache.store_measurements(
            &device,
            "l",
            &MeasureKey::batch(problem, op, micro, AlgoKind::Engine),
            &engines,
        );
    }
    let found = cache
        .measurements(
            &device,
            &MeasureKey::batch(problem, op, 2, AlgoKind::Engine),
        )
        .unwrap();
    assert_eq!(
        found,
        vec![
            engine(2, "eng0", 2.0, 0),
            engine(2, "eng38_k2=8_k13=1", 0.5, 1024)
        ]
    );
    assert_eq!(
        cache.measurements(
            &device,
            &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy)
        ),
        Some(vec![m(2, 1, 1.0, 0)])
    );
    let count = |set| {
        cache
            .op_profile(
                &device,
                "l",
                &OpKey::batch(problem, op),
                Policy::PowerOfTwo,
                set,
            )
            .unwrap()
            .measurements
            .len()
    };
    assert_eq!(
        (
            count(CandidateSet::Legacy),
            count(CandidateSet::Engines),
            count(CandidateSet::All)
        ),
        (3, 6, 9)
    );
    // Re-measuring the engines at one size leaves the legacy rows alone.
    cache.store_measurements(
        &device,
        "l",
        &MeasureKey::batch(problem, op, 4, AlgoKind::Engine),
        &[],
    );
    assert_eq!(count(CandidateSet::All), 7);
    // Export and import keep both kinds.
    let exported = cache.export(None).unwrap();
    let text = interchange::to_json_string(&exported[0]);
    assert!(text.contains("\"engine\":\"eng38_k2=8_k13=1\""), "{text}");
    let other = Cache::in_memory();
    other
        .import(&interchange::from_json_str(&text).unwrap(), &device, false)
        .unwrap();
    // (A size measured with nothing supported has no record to export, so size 4's engines
    // are missing after the round trip: the interchange format cannot say "none".)
    for micro in [1, 2] {
        assert_eq!(
            other.measurements(
                &device,
                &MeasureKey::batch(problem, op, micro, AlgoKind::Engine)
            ),
            cache.measurements(
                &device,
                &MeasureKey::batch(problem, op, micro, AlgoKind::Engine)
            )
        );
    }
    assert_eq!(
        other.missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &[1, 2, 4]
        ),
        Vec::<i64>::new()
    );
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
}

#[test]
fn measurements_round_trip_and_serve_every_batch_size() {
    let dir = temp_dir("round-trip");
    let cache = Cache::open(&dir.join("c.sqlite")).unwrap();
    assert_eq!(cache.location(), &Location::File(dir.join("c.sqlite")));
    let device = h100();
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(8, 16, 14, 14, 32, 3, 3)
    };
    let op = ConvOp::Forward;
    assert_eq!(
        cache.measurements(
            &device,
            &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy)
        ),
        None
    );
    assert_eq!(
        cache.missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &[1, 2, 4, 8]
        ),
        vec![1, 2, 4, 8]
    );
    for micro in [1, 2, 4, 8] {
        let ms = [
            m(micro, 0, 0.1 * micro as f64, 0),
            m(micro, 1, 0.05 * micro as f64, 1000 * micro as u64),
        ];
        cache.store_measurements(
            &device,
            "net.conv",
            &MeasureKey::batch(problem, op, micro, AlgoKind::Legacy),
            &ms,
        );
    }
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy)
            )
            .unwrap()[1],
        m(4, 1, 0.2, 4000)
    );
    // Measured with no supported algorithm is not the same as never measured.
    let other = ConvOp::BackwardData;
    cache.store_measurements(
        &device,
        "net.conv",
        &MeasureKey::batch(problem, other, 1, AlgoKind::Legacy),
        &[],
    );
    assert_eq!(
        cache.measurements(
            &device,
            &MeasureKey::batch(problem, other, 1, AlgoKind::Legacy)
        ),
        Some(vec![])
    );
    assert_eq!(
        cache.missing_sizes(
            &device,
            &SizesKey::batch(problem, other, AlgoKind::Legacy),
            &[1, 2]
        ),
        vec![2]
    );

    let profile = cache
        .op_profile(
            &device,
            "net.conv",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy,
        )
        .unwrap();
    assert_eq!(profile.measurements.len(), 8);
    profile.validate().unwrap();
    // A smaller mini-batch reuses the micro-batch measurements; a larger one is incomplete.
    let half = problem.with_batch(4);
    assert_eq!(
        cache
            .op_profile(
                &device,
                "net.conv",
                &OpKey::batch(half, op),
                Policy::PowerOfTwo,
                CandidateSet::Legacy
            )
            .unwrap()
            .measurements
            .len(),
        6
    );
    assert!(cache
        .op_profile(
            &device,
            "net.conv",
            &OpKey::batch(problem.with_batch(16), op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_none());
    // Another device, another shape: misses.
    let mut a100 = h100();
    a100.name = "NVIDIA A100".into();
    assert!(cache
        .op_profile(
            &a100,
            "net.conv",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_none());
    assert!(cache
        .op_profile(
            &device,
            "net.conv",
            &OpKey::batch(
                ConvProblem {
                    groups: 2,
                    ..problem
                },
                op
            ),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_none());
    // It persists.
    drop(cache);
    let cache = Cache::open(&dir.join("c.sqlite")).unwrap();
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::batch(problem, op, 8, AlgoKind::Legacy)
            )
            .unwrap()
            .len(),
        2
    );
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
    std::fs::remove_dir_all(dir).ok();
}

/// A cache that already holds rows no measurement could produce (written
/// by an older mucudnn's unchecked store, or by hand) skips them, says so once, and still
/// tunes; a cached plan solved from such a row is a miss.
#[test]
fn bad_rows_written_by_sql_are_skipped_with_one_warning() {
    let dir = temp_dir("bad-rows");
    let path = dir.join("c.sqlite");
    let device = h100();
    let problem = ConvProblem::new(4, 8, 9, 9, 8, 3, 3);
    let op = ConvOp::Forward;
    {
        let cache = Cache::open(&path).unwrap();
        for micro in [1, 2, 4] {
            let ms = [m(micro, 0, 1.0 * micro as f64, 0), m(micro, 1, 0.5, 100)];
            cache.store_measurements(
                &device,
                "l",
                &MeasureKey::batch(problem, op, micro, AlgoKind::Legacy),
                &ms,
            );
        }
    }
    // Poison: an algorithm number cuDNN's forward op does not have, a zero and a negative
    // time, a workspace past any size, and an engine name that does not parse.
    let conn = rusqlite::Connection::open(&path).unwrap();
    let rows: [(i64, i64, &str, f64, i64); 5] = [
        (2, 999, "", 0.01, 0),
        (4, 2, "", 0.0, 0),
        (1, 3, "", -1.0, 0),
        (4, 5, "", f64::INFINITY, 0),
        (2, -1, "not an engine", 0.01, 0),
    ];
    for (micro, algo, engine, time_ms, workspace) in rows {
        conn.execute(
            "INSERT INTO measurements (device_id, shape_id, op, micro, algo, engine, time_ms, workspace_bytes)
             SELECT device_id, shape_id, op, ?1, ?2, ?3, ?4, ?5 FROM measurements LIMIT 1",
            rusqlite::params![micro, algo, engine, time_ms, workspace],
        )
        .unwrap();
    }
    drop(conn);

    let cache = Cache::open(&path).unwrap().quiet();
    let entry = cache
        .op_profile(
            &device,
            "l",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy,
        )
        .expect("every size is still measured");
    // Only the good rows: two algorithms at three sizes.
    assert_eq!(entry.measurements.len(), 6, "{:?}", entry.measurements);
    assert!(entry
        .measurements
        .iter()
        .all(|x| x.algo == Algo::Legacy(0) || x.algo == Algo::Legacy(1)));
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(2, 0, 2.0, 0), m(2, 1, 0.5, 100)]
    );
    // The profile solves: the cache still tunes.
    let profile = Profile {
        device: device.name.clone(),
        cudnn_version: device.cudnn_version,
        fingerprint: Some(device.clone()),
        entries: vec![entry],
        ..Profile::default()
    };
    let mode = Mode::WorkspaceReuse {
        workspace_limit_bytes: 64 << 20,
    };
    let solution =
        solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap();
    // The whole batch with algorithm 1 (0.5 ms); the poisoned rows would have made it less.
    assert_eq!(solution.problems[0].plan.time_ms(), 0.5);
    // A plan solved from a poisoned row (algorithm 999) is a miss, not a plan to run.
    let key = PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::All, 64 << 20);
    let mut poisoned = solution.problems[0].plan.clone();
    poisoned.micro_batches[0].algo = Algo::Legacy(999);
    cache.store_plan(&device, &poisoned, &key);
    assert_eq!(cache.plan(&device, &problem, op, &key), None);
    cache.store_plan(&device, &solution.problems[0].plan, &key);
    assert_eq!(
        cache.plan(&device, &problem, op, &key).as_ref(),
        Some(&solution.problems[0].plan)
    );
    // One warning for all of it.
    let warnings = cache.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("skipped"), "{warnings:?}");
    // Export leaves them out too, so the file it writes imports again.
    let exported = cache.export(Some(&device)).unwrap();
    assert_eq!(exported[0].entries[0].measurements.len(), 6);
    let fresh = Cache::in_memory();
    assert_eq!(fresh.import(&exported[0], &device, false).unwrap(), 6);
    std::fs::remove_dir_all(&dir).ok();
}

/// Import is all or nothing: a record no measurement on this device could produce is named by
/// its index, and nothing of the profile is stored, even with `force`.
#[test]
fn import_refuses_a_bad_record_by_index() {
    let device = h100();
    let mut profile = fixture();
    let cache = Cache::in_memory();
    let (entry, index) = (7, 2);
    let before: usize = profile.entries[..entry]
        .iter()
        .map(|e| e.measurements.len())
        .sum();
    profile.entries[entry].measurements[index].algo = Algo::Legacy(999);
    for force in [false, true] {
        let error = cache
            .import(&profile, &device, force)
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with(&format!("record {} (", before + index)),
            "{error}"
        );
        assert!(error.contains("algorithm 999 is not a"), "{error}");
        assert!(error.ends_with("nothing was imported"), "{error}");
        assert!(cache.export(None).unwrap().is_empty());
    }
}

#[test]
fn plans_are_keyed_by_policy_and_constraint() {
    let cache = Cache::in_memory();
    let device = h100();
    let profile = fixture();
    let entry = &profile.entries[3];
    let plan = mucudnn_solver::solve_wr(entry, Policy::PowerOfTwo, 64 << 20).unwrap();
    let key = PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::All, 64 << 20);
    assert_eq!(cache.plan(&device, &entry.problem, entry.op, &key), None);
    cache.store_plan(&device, &plan, &key);
    assert_eq!(
        cache.plan(&device, &entry.problem, entry.op, &key),
        Some(plan.clone())
    );
    for other in [
        PlanKey::reuse(Policy::All, CandidateSet::All, 64 << 20),
        PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::Legacy, 64 << 20),
        PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::All, 32 << 20),
        PlanKey {
            policy: Policy::PowerOfTwo,
            candidates: CandidateSet::All,
            mode: Mode::WorkspaceDivision {
                total_workspace_bytes: 64 << 20,
            },
            context: "x".into(),
        },
    ] {
        assert_eq!(
            cache.plan(&device, &entry.problem, entry.op, &other),
            None,
            "{other:?}"
        );
    }
    assert_eq!(
        cache.plan(&device, &entry.problem.with_batch(128), entry.op, &key),
        None
    );
}

#[test]
fn a_new_limit_is_solved_from_cached_measurements() {
    let cache = Cache::in_memory();
    let device = h100();
    let profile = fixture();
    cache.import(&profile, &device, true).unwrap();
    for limit in [8u64 << 20, 64 << 20, 512 << 20] {
        for entry in &profile.entries {
            let cached = cache
                .op_profile(
                    &device,
                    &entry.layer,
                    &OpKey::batch(entry.problem, entry.op),
                    Policy::PowerOfTwo,
                    CandidateSet::Legacy,
                )
                .unwrap();
            let from_cache = mucudnn_solver::solve_wr(&cached, Policy::PowerOfTwo, limit).unwrap();
            let direct = mucudnn_solver::solve_wr(entry, Policy::PowerOfTwo, limit).unwrap();
            assert_eq!(from_cache, direct, "{} at {limit}", entry.name());
        }
    }
}

#[test]
fn export_clear_import_solve_gives_identical_plans() {
    let cache = Cache::in_memory();
    let device = h100();
    let profile = fixture();
    let stored = cache.import(&profile, &device, true).unwrap();
    assert_eq!(
        stored,
        profile
            .entries
            .iter()
            .map(|e| e.measurements.len())
            .sum::<usize>()
    );
    let modes = [
        Mode::WorkspaceReuse {
            workspace_limit_bytes: 64 << 20,
        },
        Mode::WorkspaceDivision {
            total_workspace_bytes: 128 << 20,
        },
    ];
    let solve = |p: &Profile, mode| {
        solve_profile(p, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap()
    };
    let exported = cache.export(Some(&device)).unwrap();
    assert_eq!(exported.len(), 1);
    let text = interchange::to_json_string(&exported[0]);
    let before: Vec<_> = modes
        .iter()
        .map(|&mode| solve(&exported[0], mode))
        .collect();

    cache.clear().unwrap();
    assert!(cache.export(None).unwrap().is_empty());
    assert!(cache.entries().unwrap().is_empty());

    let reread = interchange::from_json_str(&text).unwrap();
    assert_eq!(reread.fingerprint.as_ref(), Some(&device));
    cache.import(&reread, &device, false).unwrap();
    let again = cache.export(Some(&device)).unwrap();
    for (mode, plans) in modes.iter().zip(&before) {
        assert_eq!(&solve(&again[0], *mode), plans, "{mode:?}");
    }
    // And the plans equal those of the original profile.
    assert_eq!(solve(&profile, modes[0]).problems, before[0].problems);
    let entries = cache.entries().unwrap();
    assert_eq!(entries.len(), 30);
    assert!(entries.iter().all(|e| e.sizes == 9 && e.measurements > 0));
}

#[test]
fn import_refuses_another_device_unless_forced() {
    let cache = Cache::in_memory();
    let profile = fixture(); // no fingerprint, device "NVIDIA H100 80GB HBM3", cuDNN 91900
    let mut other = h100();
    other.name = "NVIDIA A100-SXM4-80GB".into();
    let err = cache.import(&profile, &other, false).unwrap_err();
    assert!(err.to_string().contains("--force"), "{err}");
    // Same name and cuDNN version, no fingerprint: accepted.
    cache.import(&profile, &h100(), false).unwrap();
    // A fingerprint that differs in the driver only is still another device.
    let mut with_fingerprint = profile.clone();
    with_fingerprint.fingerprint = Some(DeviceFingerprint {
        driver_version: Some(12080),
        ..h100()
    });
    let err = cache.import(&with_fingerprint, &h100(), false).unwrap_err();
    assert!(err.to_string().contains("driver 12.8"), "{err}");
    // One that differs below what the short form shows (13000 and 13005 both read 13.0):
    // the message says every field, never the same name twice.
    with_fingerprint.fingerprint = Some(DeviceFingerprint {
        driver_version: Some(13005),
        ..h100()
    });
    let err = cache
        .import(&with_fingerprint, &h100(), false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("driver 13005, cuDNN 91900") && err.contains("driver 13000, cuDNN 91900"),
        "{err}"
    );
    assert!(cache.import(&with_fingerprint, &other, true).unwrap() > 0);
    assert!(cache
        .op_profile(
            &other,
            "alexnet.conv1",
            &OpKey::batch(profile.entries[0].problem, ConvOp::Forward),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_some());
}

/// Every file in `dir`, name -> (length, hash of the bytes).
fn snapshot(dir: &Path) -> std::collections::BTreeMap<String, (usize, u64)> {
    use std::hash::{Hash, Hasher};
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| {
            let bytes = std::fs::read(e.path()).unwrap();
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut hasher);
            (
                e.file_name().to_string_lossy().into_owned(),
                (bytes.len(), hasher.finish()),
            )
        })
        .collect()
}

/// Another program's SQLite database, even one with a table named `plans`,
/// is refused by every kind of open, and the directory is byte-for-byte as it was (no table
/// dropped, none added, no WAL switch, nothing moved aside).
#[test]
fn another_programs_database_is_refused_and_left_unchanged() {
    let dir = temp_dir("foreign");
    let sqlite = |name: &str, sql: &str| {
        let path = dir.join(name);
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(sql).unwrap();
        drop(conn);
        path
    };
    let files = [
        sqlite(
            "planner.sqlite",
            "CREATE TABLE plans (id INTEGER PRIMARY KEY, what TEXT);
             INSERT INTO plans (what) VALUES ('keep me');",
        ),
        // All our table names but no mucudnn version: still not ours.
        sqlite(
            "lookalike.sqlite",
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE devices (id INTEGER PRIMARY KEY);",
        ),
        // A mucudnn-looking file with one extra table.
        {
            let path = dir.join("extra.sqlite");
            drop(Cache::open(&path).unwrap());
            let conn = rusqlite::Connection::open(&path).unwrap();
            conn.execute_batch(
                "PRAGMA journal_mode = DELETE; PRAGMA application_id = 0;
                 CREATE TABLE notes (t TEXT); INSERT INTO notes VALUES ('mine');",
            )
            .unwrap();
            drop(conn);
            path
        },
        // Another application's marker.
        sqlite(
            "marked.sqlite",
            "PRAGMA application_id = 1234; CREATE TABLE t (x);",
        ),
        {
            let path = dir.join("profile.json");
            std::fs::write(&path, br#"{"format": "mucudnn-profile-v1", "entries": []}"#).unwrap();
            path
        },
        {
            let path = dir.join("short");
            std::fs::write(&path, b"SQLite format 3").unwrap();
            path
        },
    ];
    let before = snapshot(&dir);
    for path in &files {
        for access in [Access::ReadWrite, Access::ReadOnly] {
            let refused = Cache::open_with(path, access);
            let error = refused
                .err()
                .unwrap_or_else(|| panic!("{} was opened", path.display()));
            assert_eq!(error.path(), path);
            assert!(
                error.to_string().contains("is not a mucudnn cache"),
                "{error}"
            );
        }
        assert!(Cache::open_default(Some(path)).is_err());
    }
    assert_eq!(
        snapshot(&dir),
        before,
        "byte-for-byte unchanged, nothing added"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Reading never moves, creates or migrates anything; a damaged cache of
/// ours is read as empty (with a warning) and only a writer moves it aside.
#[test]
fn read_only_access_never_moves_or_creates_files() {
    let dir = temp_dir("read-only-access");
    let missing = dir.join("missing.sqlite");
    let cache = Cache::open_with(&missing, Access::ReadOnly).unwrap();
    assert!(cache.entries().unwrap().is_empty());
    assert!(cache.is_read_only());
    drop(cache);
    assert!(!missing.exists(), "a reader creates nothing");

    let path = dir.join("cache.sqlite");
    let cache = Cache::open(&path).unwrap();
    cache.import(&fixture(), &h100(), true).unwrap();
    drop(cache);
    let before = snapshot(&dir);
    let cache = Cache::open_with(&path, Access::ReadOnly).unwrap().quiet();
    assert_eq!(cache.entries().unwrap().len(), 30);
    assert!(!cache.export(None).unwrap().is_empty());
    // Stores are skipped and explicit writes refused.
    let problem = ConvProblem::new(2, 2, 5, 5, 2, 3, 3);
    cache.store_measurements(
        &h100(),
        "l",
        &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy),
        &[m(1, 0, 1.0, 0)],
    );
    assert!(cache
        .measurements(
            &h100(),
            &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy)
        )
        .is_none());
    assert!(cache.clear().is_err());
    assert!(cache.import(&fixture(), &h100(), true).is_err());
    drop(cache);
    assert_eq!(snapshot(&dir), before);

    // Damage the cache: a reader leaves it where it is.
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle..middle + 8192].fill(0xA5);
    std::fs::write(&path, &bytes).unwrap();
    let before = snapshot(&dir);
    let cache = Cache::open_with(&path, Access::ReadOnly).unwrap().quiet();
    assert!(
        cache.warnings().iter().any(|w| w.contains("damaged")),
        "{:?}",
        cache.warnings()
    );
    drop(cache);
    assert_eq!(snapshot(&dir), before, "a reader moves nothing");
    // A writer moves it aside.
    let cache = Cache::open(&path).unwrap().quiet();
    assert!(cache.salvage().is_some(), "{:?}", cache.warnings());
    std::fs::remove_dir_all(dir).ok();
}

/// Damage of 8 KiB in a cache of many pages costs the rows on those pages,
/// not the file: the readable rows are copied into the fresh cache and counted.
#[test]
fn a_damaged_cache_is_salvaged_row_by_row() {
    let dir = temp_dir("salvage");
    let path = dir.join("cache.sqlite");
    let device = h100();
    let cache = Cache::open(&path).unwrap();
    // Many shapes with many measurements each: a file of many pages.
    let mut profile = fixture();
    let template = profile.entries.clone();
    for copy in 1..40 {
        for entry in &template {
            let mut entry = entry.clone();
            entry.layer = format!("{}.copy{copy}", entry.layer);
            entry.problem.k += copy;
            profile.entries.push(entry);
        }
    }
    let stored = cache.import(&profile, &device, true).unwrap();
    drop(cache);
    // Checkpoint the WAL into the file, as a long-lived cache would have.
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE;")
        .unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let pages = bytes.len() / 4096;
    assert!(pages > 100, "{pages} pages");
    // 8 KiB of garbage two thirds of the way in (two whole pages).
    let start = (pages * 2 / 3) * 4096;
    bytes[start..start + 8192].fill(0xA5);
    std::fs::write(&path, &bytes).unwrap();

    let cache = Cache::open(&path).unwrap().quiet();
    let salvage = cache.salvage().expect("the damage was noticed").clone();
    let warnings = cache.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("salvaged") && w.contains("measurements")),
        "{warnings:?}"
    );
    let kept = salvage.measurements_kept();
    eprintln!(
        "salvaged {kept} of {stored} measurements ({} rows in all) from a {} KiB cache with 8 KiB \
         of damage; unreadable: {:?}",
        salvage.total_kept(),
        bytes.len() / 1024,
        salvage.unreadable
    );
    // Here the two pages hold part of `shapes` (the measurements of a lost shape cannot be
    // used, so they are refused) and part of `measurements`; without salvage nothing is kept.
    assert!(
        kept * 4 >= stored * 3,
        "kept {kept} of {stored} measurements"
    );
    assert!(kept < stored + 1);
    // What was kept is really in the fresh file and serves lookups.
    drop(cache);
    let reopened = Cache::open(&path).unwrap();
    assert!(reopened.salvage().is_none());
    let exported: usize = reopened
        .export(None)
        .unwrap()
        .iter()
        .flat_map(|p| &p.entries)
        .map(|e| e.measurements.len())
        .sum();
    assert!(
        exported * 4 >= stored * 3,
        "{exported} of {stored} exported"
    );
    assert!(
        salvage.moved_to.exists(),
        "the damaged file is kept for inspection"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A cache the user cannot write is opened read-only. Root ignores mode
/// bits, so as root the file is made immutable (`chattr +i`) instead; where neither works, the
/// documented `MUCUDNN_CACHE_READ_ONLY` switch takes the same read-only path.
#[test]
fn an_unwritable_cache_is_read_only_not_lost() {
    let dir = temp_dir("unwritable-file");
    let path = dir.join("cache.sqlite");
    let cache = Cache::open(&path).unwrap();
    cache.import(&fixture(), &h100(), true).unwrap();
    drop(cache);
    let guard = ReadOnlyFile::new(&path);
    eprintln!("read-only by: {}", guard.how);
    let before = std::fs::read(&path).unwrap();
    let cache = guard.open().quiet();
    assert!(cache.is_read_only(), "{:?}", cache.warnings());
    assert_eq!(cache.location(), &Location::File(path.clone()));
    assert!(
        cache
            .warnings()
            .iter()
            .any(|w| w.contains("new ones will not be kept")),
        "{:?}",
        cache.warnings()
    );
    assert_eq!(
        cache.entries().unwrap().len(),
        30,
        "its measurements are used"
    );
    let error = cache.import(&fixture(), &h100(), true).unwrap_err();
    assert!(error.to_string().contains("cannot be written"), "{error}");
    assert!(cache.clear().is_err());
    drop(cache);
    drop(guard);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    std::fs::remove_dir_all(dir).ok();
}

/// Makes a file unwritable for this process for as long as it lives.
struct ReadOnlyFile {
    path: PathBuf,
    how: &'static str,
}

impl ReadOnlyFile {
    fn new(path: &Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let root = std::fs::metadata("/proc/self")
            .map(|m| m.uid() == 0)
            .unwrap_or(false);
        let how = if !root {
            let mut perms = std::fs::metadata(path).unwrap().permissions();
            perms.set_readonly(true);
            std::fs::set_permissions(path, perms).unwrap();
            "mode bits"
        } else if Command::new("chattr")
            .arg("+i")
            .arg(path)
            .status()
            .is_ok_and(|s| s.success())
        {
            "chattr +i"
        } else {
            READ_ONLY_ENV
        };
        ReadOnlyFile {
            path: path.to_path_buf(),
            how,
        }
    }

    fn open(&self) -> Cache {
        if self.how == READ_ONLY_ENV {
            // Only this test's thread reads the variable while it is set.
            std::env::set_var(READ_ONLY_ENV, "1");
            let cache = Cache::open(&self.path).unwrap();
            std::env::remove_var(READ_ONLY_ENV);
            cache
        } else {
            Cache::open(&self.path).unwrap()
        }
    }
}

impl Drop for ReadOnlyFile {
    fn drop(&mut self) {
        match self.how {
            "chattr +i" => {
                let _ = Command::new("chattr").arg("-i").arg(&self.path).status();
            }
            "mode bits" => {
                if let Ok(meta) = std::fs::metadata(&self.path) {
                    let mut perms = meta.permissions();
                    #[allow(clippy::permissions_set_readonly_false)]
                    perms.set_readonly(false);
                    let _ = std::fs::set_permissions(&self.path, perms);
                }
            }
            _ => {}
        }
    }
}

#[test]
fn a_damaged_database_never_stops_tuning() {
    let dir = temp_dir("truncated");
    let path = dir.join("cache.sqlite");
    let cache = Cache::open(&path).unwrap();
    cache.import(&fixture(), &h100(), true).unwrap();
    drop(cache);
    // Keep the header, damage the pages: a realistic half-written file.
    let bytes = std::fs::read(&path).unwrap();
    let mut damaged = bytes[..bytes.len() / 2].to_vec();
    damaged.extend(std::iter::repeat_n(0xA5u8, bytes.len() / 2));
    damaged[100..4096].fill(0x5A);
    std::fs::write(&path, damaged).unwrap();
    let _ = std::fs::remove_file(dir.join("cache.sqlite-wal"));
    let cache = Cache::open(&path).unwrap().quiet();
    // Whatever the damage, the cache opens and works, from a file or from memory.
    let problem = ConvProblem::new(2, 2, 5, 5, 2, 3, 3);
    cache.store_measurements(
        &h100(),
        "l",
        &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy),
        &[m(1, 0, 1.0, 0)],
    );
    assert!(cache
        .measurements(
            &h100(),
            &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy)
        )
        .is_some());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn an_unwritable_location_falls_back_to_memory() {
    let dir = temp_dir("unwritable");
    // A parent that is a regular file cannot hold a directory, even for root.
    let blocker = dir.join("not-a-directory");
    std::fs::write(&blocker, b"x").unwrap();
    let cache = Cache::open(&blocker.join("sub").join("cache.sqlite"))
        .unwrap()
        .quiet();
    assert!(
        matches!(cache.location(), Location::Memory { .. }),
        "{:?}",
        cache.location()
    );
    assert!(
        cache.warnings().iter().any(|w| w.contains("in memory")),
        "{:?}",
        cache.warnings()
    );
    let problem = ConvProblem::new(2, 2, 5, 5, 2, 3, 3);
    cache.store_measurements(
        &h100(),
        "l",
        &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy),
        &[m(1, 0, 1.0, 0)],
    );
    assert!(cache
        .measurements(
            &h100(),
            &MeasureKey::batch(problem, ConvOp::Forward, 1, AlgoKind::Legacy)
        )
        .is_some());
    // A directory where the file should be.
    let cache = Cache::open(&dir).unwrap().quiet();
    assert!(matches!(cache.location(), Location::Memory { .. }));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_file_from_a_newer_mucudnn_is_left_alone() {
    let dir = temp_dir("newer");
    let path = dir.join("cache.sqlite");
    drop(Cache::open(&path).unwrap());
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute(
            "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    let cache = Cache::open(&path).unwrap().quiet();
    assert!(matches!(cache.location(), Location::Memory { .. }));
    assert!(
        cache
            .warnings()
            .iter()
            .any(|w| w.contains("schema version 99")),
        "{:?}",
        cache.warnings()
    );
    assert!(path.exists(), "not moved aside: it is not damaged");
    std::fs::remove_dir_all(dir).ok();
}

const CHILD_ENV: &str = "MUCUDNN_CACHE_TEST_CHILD";
const ROWS_PER_CHILD: i64 = 40;

/// Not a test of its own: the body of one writer process of
/// `eight_processes_tuning_into_one_file_lose_nothing`, which runs this test binary 8 times with
/// `CHILD_ENV` set. Without it, it returns at once.
#[test]
fn concurrent_writer_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (path, index) = spec.rsplit_once('|').unwrap();
    let index: i64 = index.parse().unwrap();
    let cache = Cache::open(Path::new(path)).unwrap();
    for row in 0..ROWS_PER_CHILD {
        // A distinct shape per (child, row), several sizes, and a plan: many small transactions.
        let problem = ConvProblem::new(4, 1 + index, 8, 8, 1 + row, 3, 3);
        let layer = format!("rank{index}.layer{row}");
        for micro in [1, 2, 4] {
            let ms = [
                m(micro, 0, 1.0, 0),
                m(micro, 1, 0.5, 100),
                m(micro, 2, 0.25, 1000),
            ];
            cache.store_measurements(
                &h100(),
                &layer,
                &MeasureKey::batch(problem, ConvOp::Forward, micro, AlgoKind::Legacy),
                &ms,
            );
        }
        let profile = cache
            .op_profile(
                &h100(),
                &layer,
                &OpKey::batch(problem, ConvOp::Forward),
                Policy::PowerOfTwo,
                CandidateSet::Legacy,
            )
            .unwrap();
        let plan = mucudnn_solver::solve_wr(&profile, Policy::PowerOfTwo, 500).unwrap();
        cache.store_plan(
            &h100(),
            &plan,
            &PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::All, 500),
        );
    }
    assert!(
        cache.warnings().is_empty(),
        "writer {index}: {:?}",
        cache.warnings()
    );
    assert!(matches!(cache.location(), Location::File(_)));
}

#[test]
fn eight_processes_tuning_into_one_file_lose_nothing() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let dir = temp_dir("concurrent");
    let path = dir.join("shared.sqlite");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..8)
        .map(|index| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "concurrent_writer_child",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, format!("{}|{index}", path.display()))
                .output_async()
        })
        .collect();
    for (index, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "writer {index} failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let cache = Cache::open(&path).unwrap();
    let entries = cache.entries().unwrap();
    assert_eq!(
        entries.len() as i64,
        8 * ROWS_PER_CHILD,
        "one entry per rank and layer"
    );
    for index in 0..8 {
        for row in 0..ROWS_PER_CHILD {
            let problem = ConvProblem::new(4, 1 + index, 8, 8, 1 + row, 3, 3);
            for micro in [1, 2, 4] {
                let got = cache.measurements(
                    &h100(),
                    &MeasureKey::batch(problem, ConvOp::Forward, micro, AlgoKind::Legacy),
                );
                assert_eq!(
                    got.map(|v| v.len()),
                    Some(3),
                    "writer {index} row {row} micro {micro}"
                );
            }
            assert!(cache
                .plan(
                    &h100(),
                    &problem,
                    ConvOp::Forward,
                    &PlanKey::reuse(Policy::PowerOfTwo, CandidateSet::All, 500)
                )
                .is_some());
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `Command::spawn` with piped output, so that children run at once and are awaited later.
trait SpawnPiped {
    fn output_async(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// Candidates skipped for their workspace are kept apart from measurements,
/// make a size incomplete only for limits that fit them, survive a reopen, and are cleared by
/// a complete store or an import of that size.
#[test]
fn skipped_candidates_are_kept_apart_from_measurements() {
    use mucudnn_solver::Skipped;
    let dir = temp_dir("skipped");
    let path = dir.join("cache.sqlite");
    let device = h100();
    let problem = ConvProblem::new(8, 16, 13, 13, 32, 3, 3);
    let op = ConvOp::Forward;
    let skip = |micro: i64, algo: u32, workspace_bytes: u64| Skipped {
        micro,
        algo: Algo::Legacy(algo),
        workspace_bytes,
    };
    {
        let cache = Cache::open(&path).unwrap().quiet();
        cache.store_measured(
            &device,
            "l",
            &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy),
            &[m(4, 0, 1.0, 0), m(4, 1, 0.5, 100)], // A candidate also timed is not stored as skipped.
            &[skip(4, 2, 5000), skip(4, 3, 90_000), skip(4, 1, 100)],
        );
    }
    let cache = Cache::open(&path).unwrap().quiet();
    let Measured {
        measurements: timed,
        skipped,
        ..
    } = cache
        .measured(
            &device,
            &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy),
        )
        .unwrap();
    assert_eq!(timed, [m(4, 0, 1.0, 0), m(4, 1, 0.5, 100)]);
    assert_eq!(skipped, [skip(4, 2, 5000), skip(4, 3, 90_000)]);
    // The timed measurements alone are what `measurements` (and the solver) see.
    assert_eq!(
        cache.measurements(
            &device,
            &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy)
        ),
        Some(timed)
    );
    let sizes = [1, 4];
    let missing = |limit| {
        cache.missing_sizes_within(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &sizes,
            limit,
        )
    };
    assert_eq!(missing(Some(4999)), [1]);
    assert_eq!(missing(Some(5000)), [1, 4]);
    assert_eq!(missing(None), [1, 4]);
    // Engines were never measured at 4: all missing, whatever the legacy rows say.
    assert_eq!(
        cache.missing_sizes_within(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Engine),
            &sizes,
            Some(0)
        ),
        [1, 4]
    );
    // A complete store of the size clears what was skipped.
    cache.store_measurements(
        &device,
        "l",
        &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy),
        &[m(4, 0, 1.0, 0), m(4, 2, 0.2, 5000)],
    );
    let Measured { skipped, .. } = cache
        .measured(
            &device,
            &MeasureKey::batch(problem, op, 4, AlgoKind::Legacy),
        )
        .unwrap();
    assert!(skipped.is_empty());
    assert_eq!(missing(None), [1]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cache written by the release before 3-D shapes (schema 3: `mucudnn tune --network
/// examples/networks/tiny.toml --batch 2 --device cpu` of 0.1.0 at 4075a30) opens under schema
/// 4: its rows read back as 2-D problems with every measurement, and a 3-D problem whose other
/// fields equal a 2-D one's is a separate shape.
#[test]
fn a_schema_3_cache_reads_as_2d_and_3d_shapes_are_separate() {
    let dir = temp_dir("schema3");
    let path = dir.join("cache.sqlite");
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/cache-schema3-tiny.sqlite"
        ),
        &path,
    )
    .unwrap();
    let cache = Cache::open(&path).unwrap();
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
    let entries = cache.entries().unwrap();
    assert!(!entries.is_empty());
    let first = &entries[0];
    assert_eq!(first.problem.spatial_dims(), 2);
    assert_eq!((first.problem.d, first.problem.t), (1, 1));
    assert!(first.sizes > 0, "{first:?}");
    let device = first.device.clone();
    let measured = cache
        .measurements(
            &device,
            &MeasureKey::batch(first.problem, first.op, 1, AlgoKind::Legacy),
        )
        .expect("the 2-D rows survive the migration");
    assert!(!measured.is_empty());
    let exported = cache.export(Some(&device)).unwrap();
    assert!(interchange::to_json_string(&exported[0]).contains(interchange::FORMAT_V1));

    // The same fields with a depth: nothing cached yet, and storing it leaves the 2-D rows.
    let deep = ConvProblem {
        d: 4,
        t: 3,
        pad_d: 1,
        ..first.problem
    };
    assert!(cache
        .measurements(
            &device,
            &MeasureKey::batch(deep, first.op, 1, AlgoKind::Legacy)
        )
        .is_none());
    cache.store_measurements(
        &device,
        "deep",
        &MeasureKey::batch(deep, first.op, 1, AlgoKind::Legacy),
        &[m(1, 0, 0.25, 0)],
    );
    let back = cache
        .measurements(
            &device,
            &MeasureKey::batch(deep, first.op, 1, AlgoKind::Legacy),
        )
        .unwrap();
    assert_eq!(back, vec![m(1, 0, 0.25, 0)]);
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::batch(first.problem, first.op, 1, AlgoKind::Legacy)
            )
            .unwrap(),
        measured
    );
    drop(cache);
    let reopened = Cache::open(&path).unwrap();
    let problems: Vec<ConvProblem> = reopened
        .entries()
        .unwrap()
        .iter()
        .map(|e| e.problem)
        .collect();
    assert!(problems.iter().any(|p| p.is_3d() && p.d == 4));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Spatial measurements (chunk sizes along the split axis) and batch measurements of one shape
/// and op are separate rows: neither answers the other's lookups, a spatial profile solves to a
/// spatial plan, and export -> import keeps the split (a v3 file).
#[test]
fn spatial_measurements_never_answer_batch_lookups() {
    let cache = Cache::in_memory();
    let device = h100();
    // Batch 2, 9 x 5 input, 3x3 filter: 7 output rows along h.
    let problem = ConvProblem::new(2, 1, 9, 5, 1, 3, 3);
    let op = ConvOp::Forward;
    let (batch, spatial) = (SplitDim::Batch, SplitDim::Spatial);
    cache.store_measured(
        &device,
        "l",
        &MeasureKey::new(problem, op, spatial, 2, AlgoKind::Legacy),
        &[m(2, 0, 0.5, 0)],
        &[],
    );
    assert!(cache
        .measurements(
            &device,
            &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy)
        )
        .is_none());
    assert_eq!(
        cache.missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &[1, 2]
        ),
        [1, 2]
    );
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::new(problem, op, spatial, 2, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(2, 0, 0.5, 0)]
    );
    cache.store_measurements(
        &device,
        "l",
        &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy),
        &[m(2, 1, 3.0, 0)],
    );
    // Each split still reads its own row at size 2.
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::new(problem, op, spatial, 2, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(2, 0, 0.5, 0)]
    );
    assert_eq!(
        cache
            .measurements(
                &device,
                &MeasureKey::new(problem, op, batch, 2, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(2, 1, 3.0, 0)]
    );
    // A spatial chunk larger than the batch (7 rows > 2 samples) is a valid spatial row.
    for micro in [1, 4, 7] {
        cache.store_measured(
            &device,
            "l",
            &MeasureKey::new(problem, op, spatial, micro, AlgoKind::Legacy),
            &[m(micro, 0, micro as f64 * 0.25, 0)],
            &[],
        );
    }
    assert!(cache
        .op_profile(
            &device,
            "l",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_none());
    let entry = cache
        .op_profile(
            &device,
            "l",
            &OpKey::new(problem, op, spatial),
            Policy::PowerOfTwo,
            CandidateSet::Legacy,
        )
        .unwrap();
    assert_eq!(entry.split, spatial);
    assert_eq!(entry.measurements.len(), 4); // 1, 2, 4 and 7 rows
    let plan = mucudnn_solver::solve_wr(&entry, Policy::PowerOfTwo, 0).unwrap();
    assert_eq!((plan.split, plan.batch()), (spatial, 7));

    // Export carries both entries (v3); importing into an empty cache keeps them apart.
    let exported = cache.export(Some(&device)).unwrap();
    let text = interchange::to_json_string(&exported[0]);
    assert!(text.contains(interchange::FORMAT_V3), "{text}");
    let splits: Vec<SplitDim> = exported[0].entries.iter().map(|e| e.split).collect();
    assert_eq!(splits, [batch, spatial]);
    let other = Cache::in_memory();
    other
        .import(&interchange::from_json_str(&text).unwrap(), &device, false)
        .unwrap();
    assert_eq!(
        other
            .measurements(
                &device,
                &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(2, 1, 3.0, 0)]
    );
    assert_eq!(
        other
            .measurements(
                &device,
                &MeasureKey::new(problem, op, spatial, 7, AlgoKind::Legacy)
            )
            .unwrap(),
        [m(7, 0, 1.75, 0)]
    );
    assert!(other
        .measurements(
            &device,
            &MeasureKey::batch(problem, op, 7, AlgoKind::Legacy)
        )
        .is_none());
}

/// A size whose rows are all unusable is a miss, so that a tune measures it again and the new
/// rows replace them: a size whose every row had a zero, negative or infinite time, a time
/// stored as text or an op that is not one used to count as measured forever, and a tune left
/// with no usable measurement failed. Also: a workspace of 2^63 - 1 bytes is no measurement's;
/// a candidate both timed and skipped is a measurement (not "measured twice"); one shape row
/// this mucudnn cannot read (dtype `fp8`) is skipped by `entries` and `export`, with a warning,
/// where it failed them.
#[test]
fn unusable_rows_are_misses_and_one_bad_shape_row_hides_nothing() {
    use mucudnn_solver::Skipped;
    let dir = temp_dir("unusable-sizes");
    let path = dir.join("c.sqlite");
    let device = h100();
    let problem = ConvProblem::new(4, 8, 9, 9, 8, 3, 3);
    let other = ConvProblem::new(4, 8, 7, 7, 8, 3, 3);
    let op = ConvOp::Forward;
    {
        let cache = Cache::open(&path).unwrap().quiet();
        for p in [&problem, &other] {
            for micro in [1, 2, 4] {
                let ms = [m(micro, 0, micro as f64, 0), m(micro, 1, 0.5, 100)];
                cache.store_measurements(
                    &device,
                    "l",
                    &MeasureKey::batch(*p, op, micro, AlgoKind::Legacy),
                    &ms,
                );
            }
        }
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let shape_of = |p: &ConvProblem| -> i64 {
        conn.query_row(
            "SELECT id FROM shapes WHERE h = ?1",
            rusqlite::params![p.h],
            |row| row.get(0),
        )
        .unwrap()
    };
    let (s, s_other) = (shape_of(&problem), shape_of(&other));
    let sql = |statement: &str| conn.execute(statement, rusqlite::params![s]).unwrap();
    // Size 1: every time zero or negative; size 2: text; size 4: an op that is not one.
    sql(
        "UPDATE measurements SET time_ms = -time_ms WHERE shape_id = ?1 AND micro = 1 AND algo = 0",
    );
    sql("UPDATE measurements SET time_ms = 0 WHERE shape_id = ?1 AND micro = 1 AND algo = 1");
    sql("UPDATE measurements SET time_ms = 'fast' WHERE shape_id = ?1 AND micro = 2");
    sql("UPDATE measurements SET op = 'FWD' WHERE shape_id = ?1 AND micro = 4");
    // The other shape: a workspace of 2^63 - 1 bytes at size 4 (algorithm 1), and a skipped
    // row for algorithm 0 at size 4, which was timed.
    conn.execute(
        "UPDATE measurements SET workspace_bytes = ?2 WHERE shape_id = ?1 AND micro = 4 AND algo = 1",
        rusqlite::params![s_other, i64::MAX],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO skipped (device_id, shape_id, op, micro, algo, engine, workspace_bytes, split)
         SELECT device_id, shape_id, op, micro, algo, engine, 1000, split
         FROM measurements WHERE shape_id = ?1 AND micro = 4 AND algo = 0",
        rusqlite::params![s_other],
    )
    .unwrap();
    drop(conn);

    let cache = Cache::open(&path).unwrap().quiet();
    let sizes = [1, 2, 4];
    assert_eq!(
        cache.missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &sizes
        ),
        sizes,
        "every size of the poisoned shape is a miss"
    );
    assert_eq!(
        cache.measurements(
            &device,
            &MeasureKey::batch(problem, op, 2, AlgoKind::Legacy)
        ),
        None
    );
    assert!(cache
        .op_profile(
            &device,
            "l",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy
        )
        .is_none());
    // Measuring again replaces the rows.
    for micro in sizes {
        let ms = [m(micro, 0, micro as f64, 0)];
        cache.store_measurements(
            &device,
            "l",
            &MeasureKey::batch(problem, op, micro, AlgoKind::Legacy),
            &ms,
        );
    }
    assert!(cache
        .missing_sizes(
            &device,
            &SizesKey::batch(problem, op, AlgoKind::Legacy),
            &sizes
        )
        .is_empty());
    let entry = cache
        .op_profile(
            &device,
            "l",
            &OpKey::batch(problem, op),
            Policy::PowerOfTwo,
            CandidateSet::Legacy,
        )
        .expect("measured again");
    assert_eq!(entry.measurements.len(), 3, "{:?}", entry.measurements);

    // The other shape: the 2^63 - 1 B row is skipped, the size still measured by algorithm 0,
    // and algorithm 0 is a measurement, not also a skipped candidate.
    let Measured {
        measurements: timed,
        skipped,
        ..
    } = cache
        .measured(&device, &MeasureKey::batch(other, op, 4, AlgoKind::Legacy))
        .unwrap();
    assert_eq!(timed, [m(4, 0, 4.0, 0)]);
    assert_eq!(skipped, Vec::<Skipped>::new());

    // One shape row of a dtype this mucudnn does not know.
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE shapes SET dtype = 'fp8' WHERE id = ?1",
        rusqlite::params![s_other],
    )
    .unwrap();
    drop(conn);
    let cache = Cache::open(&path).unwrap().quiet();
    let entries = cache.entries().expect("the readable entries are listed");
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].problem, problem);
    let exported = cache
        .export(Some(&device))
        .expect("the readable entries export");
    assert_eq!(exported[0].entries.len(), 1);
    let warnings = cache.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("skipped 1 cached row"), "{warnings:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A cache path of 100,000 characters is not echoed whole in each warning: its middle is left
/// out, its start and end kept.
#[test]
fn a_huge_cache_path_is_shortened_in_warnings() {
    let dir = temp_dir("huge-path");
    let blocker = dir.join("not-a-directory");
    std::fs::write(&blocker, b"x").unwrap();
    let path = blocker.join("d".repeat(100_000)).join("cache.sqlite");
    let cache = Cache::open(&path).unwrap().quiet();
    assert!(matches!(cache.location(), Location::Memory { .. }));
    let warnings = cache.warnings();
    assert!(!warnings.is_empty());
    for warning in &warnings {
        assert!(
            warning.chars().count() < 1100,
            "{} characters",
            warning.len()
        );
    }
    assert!(
        warnings.iter().any(|w| w.contains("characters left out")),
        "{warnings:?}"
    );
    std::fs::remove_dir_all(dir).ok();
}
