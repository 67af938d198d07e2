//! The CPU backend as the profiler sees it: times [`cpu`](super::cpu)'s algorithms on random
//! data with the host clock.

use super::cpu::{self, AlignedWorkspace, CpuAlgo, Element};
use super::verify::{self, Arithmetic, Fault, HostReference};
use super::{
    check_key, median_time, Backend, BackendError, Decision, MeasureSettings, Measured, MemoryUse,
    Selection, TimingSettings,
};
use crate::backend::cudnn::host::random_values;
use crate::device::DeviceFingerprint;
use crate::solver::spatial::{split_axis, timing_chunks, AxisGeometry, Chunk};
use crate::solver::Operand;
use crate::solver::{
    Algo, AlgoKind, ConvOp, ConvProblem, DType, MeasureKey, Measurement, SizeVerification, Skipped,
    SplitDim, Verification,
};
use half::{bf16, f16};
use std::time::Instant;

/// Random operands for one full-batch problem, in its dtype.
enum Operands {
    F32([Vec<f32>; 3]),
    F16([Vec<f16>; 3]),
    Bf16([Vec<bf16>; 3]),
}

impl Operands {
    fn bytes(&self) -> u64 {
        fn of<T>(buffers: &[Vec<T>; 3]) -> u64 {
            buffers
                .iter()
                .map(|b| (b.len() * std::mem::size_of::<T>()) as u64)
                .sum()
        }
        match self {
            Operands::F32(b) => of(b),
            Operands::F16(b) => of(b),
            Operands::Bf16(b) => of(b),
        }
    }
}

/// The CPU backend's reference candidate for verification: direct loops over the sum, in the
/// order the f64 reference walks it.
pub const REFERENCE: CpuAlgo = CpuAlgo::Direct;

/// Times the CPU algorithms. Operand buffers are made once per problem and reused until
/// [`Backend::release`].
pub struct CpuBackend {
    fingerprint: DeviceFingerprint,
    operands: Option<(ConvProblem, Operands)>,
    workspace: AlignedWorkspace,
    memory: MemoryUse,
    /// A test's wrong candidate ([`CpuBackend::with_fault`]).
    fault: Option<Fault>,
}

/// One size's comparison of every candidate with the reference, piece by piece (the
/// micro-batch, or each timing chunk of a spatial size): the reference's output of each piece is
/// kept when it runs (first), every other candidate's compared with it.
struct Check {
    verify: bool,
    fault: Option<Fault>,
    /// The micro-batch problem (a fault's rows are counted in it).
    problem: ConvProblem,
    op: ConvOp,
    size: i64,
    /// What a correct candidate's error stays within here ([`verify::tolerance`]).
    tolerance: f64,
    /// The reference's output per piece; `None` where it is not finite.
    references: Vec<Option<HostReference>>,
    /// The candidate being compared: its largest error so far, and whether every piece could
    /// be compared.
    error: f64,
    comparable: bool,
}

impl Check {
    /// The check of `op` at `size` (a micro-batch of `problem`, or a chunk size of it), whose
    /// sums are at most as long as at micro-batch `reduction_size`.
    fn new(
        how: &MeasureSettings,
        fault: Option<Fault>,
        problem: ConvProblem,
        op: ConvOp,
        size: i64,
        reduction_size: i64,
    ) -> Check {
        Check {
            verify: how.verify,
            fault,
            problem,
            op,
            size,
            tolerance: verify::tolerance(&problem, op, reduction_size, Arithmetic::Fma),
            references: Vec::new(),
            error: 0.0,
            comparable: true,
        }
    }

    /// Starts comparing the next candidate.
    fn start(&mut self) {
        self.error = 0.0;
        self.comparable = true;
    }

    /// `algo`'s output of piece `piece`, after it ran: corrupted first if a test's fault hits
    /// it, then kept (the reference, the first time) or compared.
    fn observe<T: Element>(&mut self, algo: CpuAlgo, piece: usize, out: &mut [T]) {
        if let Some(fault) = self.fault.filter(|f| f.hits(self.op, algo.id(), self.size)) {
            fault.corrupt(&self.problem, out);
        }
        if !self.verify {
            return;
        }
        if algo == REFERENCE && self.references.len() == piece {
            // The reference itself: kept, its error 0 (nothing to compare).
            let kept = HostReference::new(out);
            self.comparable &= kept.is_some();
            self.references.push(kept);
            return;
        }
        match self.references.get(piece) {
            Some(Some(reference)) => self.error = self.error.max(reference.relative_error(out)),
            _ => self.comparable = false,
        }
    }

    /// The verification of the candidate compared since [`Check::start`]; `None` when
    /// verification is off or a piece had no reference to compare with.
    fn finish(&self) -> Option<Verification> {
        (self.verify && self.comparable).then(|| verify::verification(self.error, self.tolerance))
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            fingerprint: crate::device::cpu_fingerprint(),
            operands: None,
            workspace: AlignedWorkspace::default(),
            memory: MemoryUse::default(),
            fault: None,
        }
    }

    /// This backend with one candidate computing wrong numbers at one size, for tests of
    /// verified tuning: after that candidate runs there, its output is corrupted as `fault`
    /// says, before it is compared with the reference (what a broken kernel would have
    /// written). Timing and every other candidate are unchanged; executing a plan is not
    /// affected.
    pub fn with_fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Records what the operands and the workspace hold now.
    fn account(&mut self) {
        let operands = self.operands.as_ref().map_or(0, |(_, o)| o.bytes());
        self.memory.hold(operands + self.workspace.len() as u64);
    }

    /// The full-batch operands of `problem`, made when the problem changes. Refused (before
    /// allocating) when they cannot fit in host memory; an allocation failure is an error.
    fn operands(&mut self, problem: &ConvProblem) -> Result<&mut Operands, BackendError> {
        let stale = self.operands.as_ref().is_none_or(|(p, _)| p != problem);
        if stale {
            self.operands = None; // free before allocating the next problem's buffers
            self.check_fits(problem)?;
            // Input, filter and output tensors of the full batch, indexed by `Operand`, made
            // one at a time (so the f32 staging of one is the only extra memory).
            fn make<T: Element>(
                problem: &ConvProblem,
                role: Operand,
                seed: u64,
            ) -> Result<Vec<T>, BackendError> {
                let len = super::operand_elements(problem, role) as usize;
                let values = random_values(problem.dtype, len, seed);
                let mut out: Vec<T> = Vec::new();
                out.try_reserve_exact(len).map_err(|_| {
                    super::out_of_memory(
                        &format!("{}: the CPU backend's {role:?} tensor", problem.describe()),
                        (len * std::mem::size_of::<T>()) as u64,
                        super::available_host_memory().unwrap_or(0),
                        "was available and the allocation failed",
                    )
                })?;
                out.extend(values.into_iter().map(T::from_f32));
                Ok(out)
            }
            fn all<T: Element>(problem: &ConvProblem) -> Result<[Vec<T>; 3], BackendError> {
                Ok([
                    make(problem, Operand::Input, 1)?,
                    make(problem, Operand::Filter, 2)?,
                    make(problem, Operand::Output, 3)?,
                ])
            }
            let operands = match problem.dtype {
                DType::Fp32 => Operands::F32(all(problem)?),
                DType::Fp16 => Operands::F16(all(problem)?),
                DType::Bf16 => Operands::Bf16(all(problem)?),
            };
            self.operands = Some((*problem, operands));
            self.account();
        }
        match self.operands.as_mut() {
            Some((_, operands)) => Ok(operands),
            None => Err(BackendError::Invalid("no operands".into())),
        }
    }
}

impl CpuBackend {
    /// Makes the workspace at least `bytes` long (the smaller one freed first, never two at
    /// once). `false` when it cannot be had: the algorithm is then unsupported at this size,
    /// as cuDNN's are (left out, not an abort).
    fn ensure_workspace(&mut self, bytes: u64) -> bool {
        if (self.workspace.len() as u64) >= bytes {
            return true;
        }
        self.workspace = AlignedWorkspace::default();
        self.account();
        let fits = super::available_host_memory().is_none_or(|a| bytes <= a);
        match fits.then(|| AlignedWorkspace::try_new(bytes)).flatten() {
            Some(workspace) => {
                self.workspace = workspace;
                self.memory.largest_workspace_bytes =
                    self.memory.largest_workspace_bytes.max(bytes);
                self.account();
                true
            }
            None => false,
        }
    }

    /// Every CPU algorithm `select` asks for at one size (the check's: a micro-batch or a
    /// chunk size): its workspace by `workspace_of`, skipped over the limit, else timed by `time`
    /// on the full-batch operands and the workspace, which hands each piece's output to the
    /// [`Check`]. With verification, the reference runs first (timed if asked for, else once
    /// by `reference`), and a candidate over its tolerance is rejected.
    fn measure_each(
        &mut self,
        problem: &ConvProblem,
        check: &mut Check,
        select: &Selection,
        workspace_of: impl Fn(CpuAlgo) -> u64,
        mut time: impl FnMut(&mut Operands, CpuAlgo, &mut [u8], &mut Check) -> Result<f64, BackendError>,
        reference: impl FnOnce(&mut Operands, &mut Check) -> Result<(), BackendError>,
    ) -> Result<Measured, BackendError> {
        let micro = check.size;
        self.operands(problem)?;
        let mut found = Measured {
            verification: if check.verify {
                SizeVerification::Verified
            } else {
                SizeVerification::Unverified
            },
            ..Measured::default()
        };
        // The reference needs no workspace; when it is not asked for, it runs once, untimed.
        debug_assert_eq!(workspace_of(REFERENCE), 0);
        if check.verify && select.decide(&Algo::Legacy(REFERENCE.id()), 0) != Decision::Time {
            check.start();
            reference(self.operands(problem)?, check)?;
        }
        for algo in CpuAlgo::ALL {
            let workspace_bytes = workspace_of(algo);
            match select.decide(&Algo::Legacy(algo.id()), workspace_bytes) {
                Decision::Leave => continue,
                Decision::Skip => {
                    found.skipped.push(Skipped {
                        micro,
                        algo: Algo::Legacy(algo.id()),
                        workspace_bytes,
                    });
                    continue;
                }
                Decision::Time => {}
            }
            if !self.ensure_workspace(workspace_bytes) {
                continue;
            }
            let mut workspace = std::mem::take(&mut self.workspace);
            check.start();
            let time_ms = time(
                self.operands(problem)?,
                algo,
                workspace.as_bytes_mut(),
                check,
            );
            self.workspace = workspace;
            let measurement = Measurement {
                micro,
                algo: Algo::Legacy(algo.id()),
                time_ms: time_ms?.max(1e-6),
                workspace_bytes,
                verification: check.finish(),
            };
            if measurement.is_rejected() {
                found.rejected.push(measurement);
            } else {
                found.measurements.push(measurement);
            }
        }
        Ok(found)
    }

    /// Each CPU algorithm at micro-batch size `micro` (checked by [`check_key`]).
    fn measure_micro_batch(
        &mut self,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let (timing, select) = (&how.timing, &how.select);
        let mut check = Check::new(how, self.fault, problem.with_batch(micro), op, micro, micro);
        let run = |operands: &mut Operands,
                   algo: CpuAlgo,
                   workspace: &mut [u8],
                   check: &mut Check,
                   timing: Option<&TimingSettings>| match operands {
            Operands::F32(b) => run_algo(problem, op, micro, algo, b, workspace, timing, check),
            Operands::F16(b) => run_algo(problem, op, micro, algo, b, workspace, timing, check),
            Operands::Bf16(b) => run_algo(problem, op, micro, algo, b, workspace, timing, check),
        };
        self.measure_each(
            problem,
            &mut check,
            select,
            |algo| cpu::workspace_bytes(&problem.with_batch(micro), op, algo),
            |operands, algo, workspace, check| run(operands, algo, workspace, check, Some(timing)),
            |operands, check| run(operands, REFERENCE, &mut [], check, None).map(drop),
        )
    }

    /// Each CPU algorithm on chunks of `size` rows (checked by [`check_key`]), at the start,
    /// middle and end of the split axis ([`timing_chunks`]): the slowest time, the largest
    /// workspace; verified chunk by chunk. A size whose chunks have no call (every window in
    /// the padding) costs only the zero fill: it is recorded at the clock's resolution with no
    /// workspace.
    fn measure_chunks(
        &mut self,
        problem: &ConvProblem,
        op: ConvOp,
        size: i64,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let (timing, select) = (&how.timing, &how.select);
        let chunks = timing_chunks(&AxisGeometry::of(problem, split_axis(problem)), op, size);
        // A chunk's sums are no longer than the whole batch's.
        let mut check = Check::new(how, self.fault, *problem, op, size, problem.n);
        let run = |operands: &mut Operands,
                   algo: CpuAlgo,
                   workspace: &mut [u8],
                   check: &mut Check,
                   timing: Option<&TimingSettings>|
         -> Result<f64, BackendError> {
            let mut slowest = 0.0f64;
            for (piece, chunk) in chunks.iter().enumerate() {
                let time = match operands {
                    Operands::F32(b) => run_chunk(
                        problem,
                        op,
                        chunk,
                        algo,
                        b,
                        workspace,
                        timing,
                        (check, piece),
                    ),
                    Operands::F16(b) => run_chunk(
                        problem,
                        op,
                        chunk,
                        algo,
                        b,
                        workspace,
                        timing,
                        (check, piece),
                    ),
                    Operands::Bf16(b) => run_chunk(
                        problem,
                        op,
                        chunk,
                        algo,
                        b,
                        workspace,
                        timing,
                        (check, piece),
                    ),
                }?;
                slowest = slowest.max(time);
            }
            Ok(slowest)
        };
        self.measure_each(
            problem,
            &mut check,
            select,
            |algo| {
                chunks
                    .iter()
                    .map(|c| cpu::chunk_workspace_bytes(problem, op, algo, c))
                    .max()
                    .unwrap_or(0)
            },
            |operands, algo, workspace, check| run(operands, algo, workspace, check, Some(timing)),
            |operands, check| run(operands, REFERENCE, &mut [], check, None).map(drop),
        )
    }
}

/// Runs one algorithm on one spatial chunk, timed per `timing` (`None`: once, untimed), then
/// hands its output to the check as piece `piece`: the chunk's packed slabs
/// ([`cpu::chunk_buffer_lens`]) are the leading elements of the full-batch buffers (the CPU
/// kernels take packed slabs; the executor stages them when they are not contiguous, a copy
/// not timed here).
#[allow(clippy::too_many_arguments)]
fn run_chunk<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    chunk: &Chunk,
    algo: CpuAlgo,
    buffers: &mut [Vec<T>; 3],
    workspace: &mut [u8],
    timing: Option<&TimingSettings>,
    (check, piece): (&mut Check, usize),
) -> Result<f64, BackendError> {
    let [(_, la), (_, lb), (_, lo)] = cpu::chunk_buffer_lens(problem, op, chunk)?;
    let [x, w, y] = buffers;
    let (a, b, out): (&[T], &[T], &mut [T]) = match op {
        ConvOp::Forward => (&x[..la], &w[..lb], &mut y[..lo]),
        ConvOp::BackwardData => (&w[..la], &y[..lb], &mut x[..lo]),
        ConvOp::BackwardFilter => (&x[..la], &y[..lb], &mut w[..lo]),
    };
    let mut call =
        |out: &mut [T]| cpu::run_chunk(problem, op, algo, chunk, 1.0, a, b, 0.0, out, workspace);
    let ms = timed(timing, || call(out))?;
    check.observe(algo, piece, out);
    Ok(ms)
}

/// `call` timed per `timing` ([`median_time`]), or run once and reported as 0 ms when `timing`
/// is `None` (the reference, run only to be compared with).
fn timed(
    timing: Option<&TimingSettings>,
    mut call: impl FnMut() -> Result<(), cpu::CpuError>,
) -> Result<f64, BackendError> {
    let Some(timing) = timing else {
        call()?;
        return Ok(0.0);
    };
    median_time(timing, |iterations| -> Result<f64, BackendError> {
        let start = Instant::now();
        for _ in 0..iterations {
            call()?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e3)
    })
}

/// Host bytes the CPU backend holds for `problem`'s operands at their peak: the three
/// full-batch tensors in its dtype, plus the f32 staging of the largest while it is made.
fn operand_host_bytes(problem: &ConvProblem) -> u128 {
    let staging = [Operand::Input, Operand::Filter, Operand::Output]
        .into_iter()
        .map(|role| super::operand_elements(problem, role) * 4)
        .max()
        .unwrap_or(0);
    super::operand_bytes(problem) + staging
}

/// Runs one algorithm at one micro-batch of the full buffers, at the offset the cuDNN backend
/// times it at too ([`crate::solver::timing_offset`]), timed per `timing` (`None`: once,
/// untimed), then hands its output to the check.
#[allow(clippy::too_many_arguments)]
fn run_algo<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    micro: i64,
    algo: CpuAlgo,
    buffers: &mut [Vec<T>; 3],
    workspace: &mut [u8],
    timing: Option<&TimingSettings>,
    check: &mut Check,
) -> Result<f64, BackendError> {
    let micro_problem = problem.with_batch(micro);
    let first = crate::solver::timing_offset(problem.n as usize, micro as usize);
    let [x, w, y] = buffers;
    let range = |role: Operand| {
        let step = crate::solver::Step {
            first,
            size: micro as usize,
            algo: Algo::Legacy(algo.id()),
            beta: 0.0,
        };
        let (offset, len) = step.range(role, role.elements_per_sample(problem));
        offset..offset + len
    };
    let (rx, rw, ry) = (
        range(Operand::Input),
        range(Operand::Filter),
        range(Operand::Output),
    );
    let (a, b, out): (&[T], &[T], &mut [T]) = match op {
        ConvOp::Forward => (&x[rx], &w[rw], &mut y[ry]),
        ConvOp::BackwardData => (&w[rw], &y[ry], &mut x[rx]),
        ConvOp::BackwardFilter => (&x[rx], &y[ry], &mut w[rw]),
    };
    // beta = 0: outputs are overwritten, so repeated calls stay finite, and the last call's
    // output is the one compared.
    let mut call =
        |out: &mut [T]| cpu::run(&micro_problem, op, algo, 1.0, a, b, 0.0, out, workspace);
    let ms = timed(timing, || call(out))?;
    check.observe(algo, 0, out);
    Ok(ms)
}

impl Backend for CpuBackend {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.fingerprint
    }

    fn check_fits(&self, problem: &ConvProblem) -> Result<(), BackendError> {
        let needed = operand_host_bytes(problem);
        let available = super::available_host_memory();
        let too_large =
            needed > isize::MAX as u128 || available.is_some_and(|a| needed > u128::from(a));
        if too_large {
            return Err(super::out_of_memory(
                &format!(
                    "{}: the CPU backend's full-batch buffers",
                    problem.describe()
                ),
                u64::try_from(needed).unwrap_or(u64::MAX),
                available.unwrap_or(isize::MAX as u64),
                "of host memory is available",
            ));
        }
        Ok(())
    }

    fn has_candidate(&self, _op: ConvOp, algo: &Algo) -> bool {
        algo.legacy()
            .is_some_and(|id| CpuAlgo::from_id(id).is_some())
    }

    /// The machine's physical memory (a workspace is host memory), else the most any
    /// allocation can be (`isize::MAX` bytes).
    fn memory_bytes(&self) -> Option<u64> {
        Some(super::total_host_memory().unwrap_or(isize::MAX as u64))
    }

    /// Legacy candidates only (the CPU algorithms), at a micro-batch size or on spatial
    /// chunks.
    fn supports(&self, key: &MeasureKey) -> bool {
        key.kind == AlgoKind::Legacy
    }

    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        check_key(self, key)?;
        let (problem, op, size) = (&key.problem, key.op, key.size);
        match key.split {
            SplitDim::Batch => self.measure_micro_batch(problem, op, size, how),
            SplitDim::Spatial => self.measure_chunks(problem, op, size, how),
        }
    }

    fn release(&mut self) {
        self.operands = None;
        self.workspace = AlignedWorkspace::default();
        self.memory = MemoryUse::default();
    }

    fn memory(&self) -> MemoryUse {
        self.memory
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What cannot be allocated is an error or a left-out algorithm, never
    /// an abort.
    #[test]
    fn allocation_failure_is_a_value() {
        assert!(AlignedWorkspace::try_new(u64::MAX).is_none());
        assert!(AlignedWorkspace::try_new(1 << 62).is_none());
        assert_eq!(AlignedWorkspace::try_new(10).map(|w| w.len()), Some(10));
        // Buffers past the address space are refused by check_fits, whatever the machine.
        let backend = CpuBackend::new();
        let huge = ConvProblem::new(1 << 40, 64, 64, 64, 64, 3, 3);
        let error = backend.check_fits(&huge).unwrap_err().to_string();
        assert!(error.contains("full-batch buffers need"), "{error}");
        assert!(backend
            .check_fits(&ConvProblem::new(2, 3, 8, 8, 4, 3, 3))
            .is_ok());
    }
}
