//! What a plan may use besides the fastest candidates: deterministic ones only when asked
//! (as `torch.backends.cudnn.deterministic` asks), and the bf16 backward-filter accuracy rule
//! (at most four micro-batches on cuDNN). Applied to a profile before it is solved, and to a
//! cached plan before it is used.

use crate::backend::Backend;
use crate::device::BackendKind;
use crate::solver::{
    ConvOp, ConvProblem, DType, DeviceFingerprint, OpProfile, Plan, Policy, Profile, SolveError,
    SplitDim,
};

/// The plan-cache context of plans solved from deterministic candidates only (plain plans
/// have none), so the two never stand in for each other.
pub const DETERMINISTIC_CONTEXT: &str = "deterministic";

/// Drops the measurements of candidates `backend` does not mark deterministic.
pub fn keep_deterministic(backend: &dyn Backend, profile: &mut OpProfile) {
    let op = profile.op;
    profile
        .measurements
        .retain(|m| backend.is_deterministic(op, &m.algo));
}

/// The most micro-batches a bf16 backward-filter plan may have on cuDNN. cuDNN adds each
/// micro-batch after the first into `dw` in the operands' dtype (beta = 1): k roundings where
/// PyTorch has one. Measured (docs/pytorch.md, "Half-precision weight gradients"), bf16's error
/// is 1.6x PyTorch's at k = 4 and 2.1x at k = 8, past the 2x the project allows; fp16 stays
/// below PyTorch's at every k up to 16, so it has no limit. The CPU executor sums in fp32 and
/// needs none either.
pub const BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES: i64 = 4;

/// The smallest micro-batch size a plan of `op` on `problem` may use on `device`: 1, except for
/// a bf16 backward-filter on a cuDNN device, where it is `ceil(N / 4)`. A plan whose sizes are
/// all at least `ceil(N / 4)` has at most 4 micro-batches under every policy (they sum to N),
/// and the undivided size N always stays, so the rule only removes candidates: it never makes
/// a plan slower than the best undivided one.
pub fn min_micro_batch(device: &DeviceFingerprint, problem: &ConvProblem, op: ConvOp) -> i64 {
    min_split_size(device, problem, op, SplitDim::Batch)
}

/// [`min_micro_batch`] for a split: a spatial bf16 backward-filter on cuDNN sums its chunks in
/// `dw` as micro-batches do, so its chunks are at least a quarter of the extent along the axis.
pub fn min_split_size(
    device: &DeviceFingerprint,
    problem: &ConvProblem,
    op: ConvOp,
    split: SplitDim,
) -> i64 {
    let restricted = device.backend == BackendKind::Cuda
        && problem.dtype == DType::Bf16
        && op == ConvOp::BackwardFilter;
    if restricted {
        let extent = split.extent(problem, op);
        (extent + BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES - 1)
            / BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES
    } else {
        1
    }
}

/// Drops the measurements at sizes below [`min_micro_batch`], so the solver (which stays
/// unaware of devices) picks only plans that keep `dw`'s error within the rule; a workspace
/// limit it then calls infeasible names the smallest limit that works under the rule.
pub fn keep_accurate_sizes(device: &DeviceFingerprint, profile: &mut OpProfile) {
    let min = min_split_size(device, &profile.problem, profile.op, profile.split);
    profile.measurements.retain(|m| m.micro >= min);
}

/// [`keep_accurate_sizes`] for every entry of a profile measured on the device its fingerprint
/// names (a profile without one is solved as it is: nothing says it came from cuDNN).
pub fn keep_accurate_sizes_in(profile: &mut Profile) {
    if let Some(device) = profile.fingerprint.clone() {
        for entry in &mut profile.entries {
            keep_accurate_sizes(&device, entry);
        }
    }
}

/// [`crate::solver::solve_profile`] under the rule: the profile's entries restricted by
/// [`keep_accurate_sizes_in`] (on a copy, so the caller's profile keeps every measurement).
/// Every path that solves a whole profile (the CLI, the C ABI's solve and its handle) goes
/// through here.
pub fn solve_accurately(
    profile: &Profile,
    policy: Policy,
    mode: crate::solver::Mode,
    wd: &crate::solver::WdOptions,
) -> Result<crate::solver::Solution, SolveError> {
    let mut accurate = profile.clone();
    keep_accurate_sizes_in(&mut accurate);
    crate::solver::solve_profile(&accurate, policy, mode, wd)
}

/// Whether `plan` obeys [`min_micro_batch`] on `device`. Plans cached before the rule existed
/// may not: such a plan is a cache miss, and the layer is solved again.
pub fn plan_obeys_accuracy_rule(device: &DeviceFingerprint, plan: &Plan) -> bool {
    let min = min_split_size(device, &plan.problem, plan.op, plan.split);
    plan.micro_batches.iter().all(|mb| mb.size >= min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::{solve_wr, Algo, Measurement};

    fn device(backend: BackendKind) -> DeviceFingerprint {
        DeviceFingerprint {
            backend,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: Some((9, 0)),
            driver_version: Some(13000),
            cudnn_version: Some(91900),
        }
    }

    /// A profile where smaller micro-batches are faster per sample (the solver's favourite
    /// kind of split) and need less workspace: size m takes 0.5 m + 0.01 m² ms and 1 KiB x m.
    fn profile(n: i64, dtype: DType, op: ConvOp) -> OpProfile {
        let mut problem = ConvProblem::new(n, 64, 14, 14, 64, 3, 3);
        problem.dtype = dtype;
        problem.pad_h = 1;
        problem.pad_w = 1;
        OpProfile {
            layer: "resnet50.layer1.0.conv2".into(),
            problem,
            op,
            split: crate::solver::SplitDim::Batch,
            measurements: (1..=n)
                .map(|m| Measurement {
                    micro: m,
                    algo: Algo::Legacy(1),
                    time_ms: 0.5 * m as f64 + 0.01 * (m * m) as f64,
                    workspace_bytes: 1024 * m as u64,
                    verification: None,
                })
                .collect(),
            skipped: Vec::new(),
            rejected: Vec::new(),
        }
    }

    fn solve(device: &DeviceFingerprint, entry: &OpProfile, policy: Policy, limit: u64) -> Plan {
        let mut entry = entry.clone();
        keep_accurate_sizes(device, &mut entry);
        solve_wr(&entry, policy, limit).unwrap()
    }

    #[test]
    fn bf16_backward_filter_on_cudnn_has_at_most_four_micro_batches() {
        let cudnn = device(BackendKind::Cuda);
        for n in [1, 2, 3, 5, 7, 10, 16, 17, 31, 64] {
            let entry = profile(n, DType::Bf16, ConvOp::BackwardFilter);
            assert_eq!(
                min_micro_batch(&cudnn, &entry.problem, entry.op),
                (n + 3) / 4
            );
            let undivided = solve_wr(&entry, Policy::Undivided, u64::MAX).unwrap();
            for policy in Policy::ALL {
                let plan = solve(&cudnn, &entry, policy, u64::MAX);
                let sizes: Vec<i64> = plan.micro_batches.iter().map(|mb| mb.size).collect();
                assert!(sizes.len() <= 4, "n {n} {policy}: {sizes:?}");
                assert_eq!(sizes.iter().sum::<i64>(), n, "n {n} {policy}: {sizes:?}");
                assert!(plan_obeys_accuracy_rule(&cudnn, &plan));
                assert!(
                    plan.time_ms() <= undivided.time_ms(),
                    "n {n} {policy}: {} > {}",
                    plan.time_ms(),
                    undivided.time_ms()
                );
            }
        }
    }

    #[test]
    fn the_rule_spares_fp16_other_ops_and_the_cpu() {
        let n = 16;
        let cases = [
            (
                device(BackendKind::Cuda),
                DType::Fp16,
                ConvOp::BackwardFilter,
            ),
            (
                device(BackendKind::Cuda),
                DType::Fp32,
                ConvOp::BackwardFilter,
            ),
            (device(BackendKind::Cuda), DType::Bf16, ConvOp::Forward),
            (device(BackendKind::Cuda), DType::Bf16, ConvOp::BackwardData),
            (
                device(BackendKind::Cpu),
                DType::Bf16,
                ConvOp::BackwardFilter,
            ),
        ];
        for (device, dtype, op) in cases {
            let entry = profile(n, dtype, op);
            assert_eq!(min_micro_batch(&device, &entry.problem, op), 1);
            let plan = solve(&device, &entry, Policy::All, u64::MAX);
            // Unrestricted, this profile splits into micro-batches of 1.
            assert_eq!(plan.micro_batches.len(), n as usize, "{dtype:?} {op}");
        }
    }

    #[test]
    fn an_infeasible_limit_names_the_smallest_limit_under_the_rule() {
        let cudnn = device(BackendKind::Cuda);
        let mut entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        keep_accurate_sizes(&cudnn, &mut entry);
        // Size 1 would fit 1 KiB, but sizes below 4 are gone: the smallest limit is 4 KiB.
        for policy in [Policy::PowerOfTwo, Policy::All] {
            match solve_wr(&entry, policy, 1024) {
                Err(SolveError::Infeasible {
                    min_workspace_bytes,
                    ..
                }) => assert_eq!(min_workspace_bytes, Some(4096), "{policy}"),
                other => panic!("{policy}: {other:?}"),
            }
            let plan = solve_wr(&entry, policy, 4096).unwrap();
            assert_eq!(plan.micro_batches.len(), 4, "{policy}");
        }
    }

    #[test]
    fn a_profile_is_restricted_by_its_own_fingerprint() {
        let entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        let mut whole = Profile {
            entries: vec![entry.clone(), profile(16, DType::Bf16, ConvOp::Forward)],
            ..Profile::default()
        };
        // No fingerprint: nothing says the measurements are cuDNN's.
        keep_accurate_sizes_in(&mut whole);
        assert_eq!(whole.entries[0], entry);
        whole.fingerprint = Some(device(BackendKind::Cuda));
        keep_accurate_sizes_in(&mut whole);
        let sizes = |e: &OpProfile| e.measurements.iter().map(|m| m.micro).collect::<Vec<_>>();
        assert_eq!(sizes(&whole.entries[0]), (4..=16).collect::<Vec<_>>());
        assert_eq!(sizes(&whole.entries[1]), (1..=16).collect::<Vec<_>>());
    }

    #[test]
    fn a_plan_cached_before_the_rule_is_refused() {
        let cudnn = device(BackendKind::Cuda);
        let entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        let old = solve_wr(&entry, Policy::All, u64::MAX).unwrap();
        assert_eq!(old.micro_batches.len(), 16);
        assert!(!plan_obeys_accuracy_rule(&cudnn, &old));
        assert!(plan_obeys_accuracy_rule(&device(BackendKind::Cpu), &old));
    }
}
