//! Executing a spatial split on the CPU: one convolution run as chunks along the
//! outermost spatial dimension of its output ([`split_axis`]), each chunk with its own
//! algorithm, over the caller's whole tensors.
//!
//! The chunks come from [`spatial::chunks`]: forward and backward-data write each chunk's rows
//! of `y` / `dx` (and the rows no call writes, which are zeros in the unsplit op, as
//! `alpha * 0 + beta * out`), so every chunk uses the caller's `beta` and the result is the
//! unsplit op's bit for bit; backward-filter sums the chunks' filter gradients, the first call
//! with the caller's `beta` and the later ones with `beta = 1` (fp16/bf16: summed in fp32 and
//! rounded once, as the batch executor does).
//!
//! A chunk's operands are the rows of `x`/`dx` and `y`/`dy` it works on. When those rows are
//! one contiguous run of the tensor (batch 1 in NHWC / NDHWC / NWC, or batch 1 with one
//! channel) the call reads and writes the tensor in place; otherwise the executor stages the
//! slab in a packed buffer (gather before, scatter after), sized for the largest chunk and
//! allocated once per execution. The CPU kernels take packed tensors only; strided views
//! without staging (as cuDNN descriptors with the full strides allow) are not done here.

use super::{ExecError, HalfSum};
use crate::backend::cpu::{self, CpuAlgo, CpuError, Element};
use crate::backend::ConvOperands;
use crate::solver::spatial::{self, split_axis, Axis, AxisGeometry, Chunk, Rows};
use crate::solver::{ConvOp, ConvProblem, Layout};

/// One chunk of a spatial split as the executor takes it: its size along the split axis (rows
/// of `y`/`dy` for forward and backward-filter, of `dx` for backward-data) and its algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpatialStep {
    pub size: i64,
    pub algo: CpuAlgo,
}

/// A tensor along the split axis: `outer` runs of `rows x inner` elements.
#[derive(Clone, Copy, Debug)]
struct AxisView {
    outer: usize,
    rows: usize,
    inner: usize,
}

impl AxisView {
    /// The view of an activation tensor of `channels` channels and spatial dims `dhw`.
    fn of(layout: Layout, n: i64, channels: i64, dhw: [i64; 3], axis: Axis) -> AxisView {
        let i = match axis {
            Axis::D => 0,
            Axis::H => 1,
            Axis::W => 2,
        };
        let before: i64 = dhw[..i].iter().product();
        let after: i64 = dhw[i + 1..].iter().product();
        let (outer, inner) = match layout {
            Layout::Nchw => (n * channels * before, after),
            Layout::Nhwc => (n * before, after * channels),
        };
        AxisView {
            outer: outer as usize,
            rows: dhw[i] as usize,
            inner: inner as usize,
        }
    }

    /// The element range of `rows` when they are one contiguous run of the tensor.
    fn contiguous(&self, rows: Rows) -> Option<std::ops::Range<usize>> {
        let (first, len) = (rows.first as usize, rows.len as usize);
        (self.outer == 1 || (first == 0 && len == self.rows)).then(|| {
            first * self.inner
                ..(first + len) * self.inner + (self.outer - 1) * self.rows * self.inner
        })
    }

    fn slab_len(&self, rows: Rows) -> usize {
        self.outer * rows.len as usize * self.inner
    }

    fn gather<T: Copy>(&self, full: &[T], rows: Rows, slab: &mut [T]) {
        let run = rows.len as usize * self.inner;
        for o in 0..self.outer {
            let src = (o * self.rows + rows.first as usize) * self.inner;
            slab[o * run..][..run].copy_from_slice(&full[src..][..run]);
        }
    }

    fn scatter<T: Copy>(&self, slab: &[T], rows: Rows, full: &mut [T]) {
        let run = rows.len as usize * self.inner;
        for o in 0..self.outer {
            let dst = (o * self.rows + rows.first as usize) * self.inner;
            full[dst..][..run].copy_from_slice(&slab[o * run..][..run]);
        }
    }

    /// `out = alpha * 0 + beta * out` on `rows` (rows that are zeros in the unsplit op).
    fn zero<T: Element>(&self, full: &mut [T], rows: Rows, alpha: f32, beta: f32) {
        let run = rows.len as usize * self.inner;
        for o in 0..self.outer {
            let dst = (o * self.rows + rows.first as usize) * self.inner;
            for v in &mut full[dst..][..run] {
                cpu::store1(v, 0.0, alpha, beta);
            }
        }
    }
}

/// The views of `x`/`dx` (input side) and `y`/`dy` (output side) of `problem`.
fn views(problem: &ConvProblem, axis: Axis) -> (AxisView, AxisView) {
    let p = problem;
    let (o, q, r) = p.output_dhw();
    (
        AxisView::of(p.layout, p.n, p.c, [p.d, p.h, p.w], axis),
        AxisView::of(p.layout, p.n, p.k, [o, q, r], axis),
    )
}

fn invalid(problem: &ConvProblem, op: ConvOp, reason: String) -> ExecError {
    ExecError::InvalidPlan {
        layer: problem.describe(),
        op,
        reason,
    }
}

/// The chunks of `steps` for `problem` and `op`, checked.
pub fn spatial_chunks(
    problem: &ConvProblem,
    op: ConvOp,
    steps: &[SpatialStep],
) -> Result<Vec<Chunk>, ExecError> {
    problem
        .validate()
        .map_err(|e| invalid(problem, op, e.to_string()))?;
    let geometry = AxisGeometry::of(problem, split_axis(problem));
    let sizes: Vec<i64> = steps.iter().map(|s| s.size).collect();
    if sizes.is_empty() {
        return Err(invalid(problem, op, "no chunks".into()));
    }
    spatial::chunks(&geometry, op, &sizes).ok_or_else(|| {
        invalid(
            problem,
            op,
            format!(
                "chunk sizes {sizes:?} are not positive sizes adding up to {} along {}",
                geometry.extent(op),
                split_axis(problem)
            ),
        )
    })
}

/// The workspace [`execute_spatial_cpu`] needs: the largest chunk's.
pub fn spatial_cpu_workspace_bytes(
    problem: &ConvProblem,
    op: ConvOp,
    steps: &[SpatialStep],
) -> Result<u64, ExecError> {
    let chunks = spatial_chunks(problem, op, steps)?;
    Ok(chunks
        .iter()
        .zip(steps)
        .filter(|(c, _)| c.has_call())
        .map(|(c, s)| cpu::chunk_workspace_bytes(problem, op, s.algo, c))
        .max()
        .unwrap_or(0))
}

/// Runs `op` of `problem` as the spatial chunks `steps` (in order along [`split_axis`]):
/// `out = alpha * op(a, b) + beta * out` over the whole tensors, buffers as for [`cpu::run`]
/// (grouped by role), `workspace` at least [`spatial_cpu_workspace_bytes`] bytes. Everything that can fail is
/// checked before anything is written.
pub fn execute_spatial_cpu<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    steps: &[SpatialStep],
    (alpha, beta): (f32, f32),
    operands: ConvOperands<&[T], &mut [T], &mut [u8]>,
) -> Result<(), ExecError> {
    let ConvOperands {
        a,
        b,
        out,
        workspace,
    } = operands;
    let cpu_error = |source| ExecError::Cpu {
        layer: problem.describe(),
        op,
        source,
    };
    let chunks = spatial_chunks(problem, op, steps)?;
    if T::DTYPE != problem.dtype {
        return Err(cpu_error(CpuError::DTypeMismatch {
            problem: problem.dtype,
            buffer: T::DTYPE,
        }));
    }
    let expected = cpu::buffer_lens(problem, op).map_err(cpu_error)?;
    for ((name, len), actual) in expected.into_iter().zip([a.len(), b.len(), out.len()]) {
        if len != actual {
            return Err(cpu_error(CpuError::BufferLength {
                buffer: name,
                expected: len,
                actual,
            }));
        }
    }
    let needed = spatial_cpu_workspace_bytes(problem, op, steps)?;
    if (workspace.len() as u64) < needed {
        return Err(cpu_error(CpuError::WorkspaceTooSmall {
            needed,
            provided: workspace.len() as u64,
        }));
    }
    let (xv, yv) = views(problem, split_axis(problem));
    // Staging buffers for the slabs that are not contiguous, as large as the largest chunk's.
    let stage_len = |view: &AxisView, rows: fn(&Chunk) -> Rows| {
        chunks
            .iter()
            .filter(|c| c.has_call() && view.contiguous(rows(c)).is_none())
            .map(|c| view.slab_len(rows(c)))
            .max()
            .unwrap_or(0)
    };
    let input_rows = |c: &Chunk| c.input;
    let output_rows = |c: &Chunk| c.output;
    let mut x_stage = vec![T::from_f32(0.0); stage_len(&xv, input_rows)];
    let mut y_stage = vec![T::from_f32(0.0); stage_len(&yv, output_rows)];

    match op {
        ConvOp::Forward | ConvOp::BackwardData => {
            // Forward: a = x (input side), out = y; backward-data: b = dy, out = dx.
            let (read_view, write_view) = match op {
                ConvOp::Forward => (xv, yv),
                _ => (yv, xv),
            };
            let (read_stage, write_stage) = match op {
                ConvOp::Forward => (&mut x_stage, &mut y_stage),
                _ => (&mut y_stage, &mut x_stage),
            };
            for (chunk, step) in chunks.iter().zip(steps) {
                let (read_rows, write_rows) = match op {
                    ConvOp::Forward => (chunk.input, chunk.output),
                    _ => (chunk.output, chunk.input),
                };
                // Rows no call writes: a forward chunk without a call (all of it), a
                // backward-data chunk's rows that no window reaches.
                let (zero_first, zero_after_first) = match op {
                    ConvOp::Forward => (chunk.output.first, chunk.output.end()),
                    // (A backward-data chunk without a call has `input.first` at its start.)
                    _ if !chunk.has_call() => (chunk.input.first, chunk.input.end()),
                    _ => (chunk.input.first - chunk.zero_before, chunk.input.end()),
                };
                if chunk.zero_before > 0 {
                    let rows = Rows {
                        first: zero_first,
                        len: chunk.zero_before,
                    };
                    write_view.zero(out, rows, alpha, beta);
                }
                if chunk.zero_after > 0 {
                    let rows = Rows {
                        first: zero_after_first,
                        len: chunk.zero_after,
                    };
                    write_view.zero(out, rows, alpha, beta);
                }
                if !chunk.has_call() {
                    continue;
                }
                let read: &[T] = match read_view.contiguous(read_rows) {
                    Some(range) => &(if op == ConvOp::Forward { a } else { b })[range],
                    None => {
                        let full = if op == ConvOp::Forward { a } else { b };
                        let slab = &mut read_stage[..read_view.slab_len(read_rows)];
                        read_view.gather(full, read_rows, slab);
                        slab
                    }
                };
                let (ca, cb) = if op == ConvOp::Forward {
                    (read, b)
                } else {
                    (a, read)
                };
                match write_view.contiguous(write_rows) {
                    Some(range) => cpu::run_chunk(
                        problem,
                        op,
                        step.algo,
                        chunk,
                        alpha,
                        ca,
                        cb,
                        beta,
                        &mut out[range],
                        workspace,
                    )
                    .map_err(cpu_error)?,
                    None => {
                        let slab = &mut write_stage[..write_view.slab_len(write_rows)];
                        if beta != 0.0 {
                            write_view.gather(out, write_rows, slab);
                        }
                        cpu::run_chunk(
                            problem, op, step.algo, chunk, alpha, ca, cb, beta, slab, workspace,
                        )
                        .map_err(cpu_error)?;
                        write_view.scatter(slab, write_rows, out);
                    }
                }
            }
        }
        ConvOp::BackwardFilter => {
            let calls = chunks.iter().filter(|c| c.has_call()).count();
            // Half precision over several calls: summed in fp32, rounded once (as in
            // `execute_cpu`).
            let mut half_sum = (calls > 1).then(|| HalfSum::new(out, beta)).flatten();
            let mut call_beta = beta;
            for (chunk, step) in chunks.iter().zip(steps) {
                if !chunk.has_call() {
                    continue;
                }
                let x: &[T] = match xv.contiguous(chunk.input) {
                    Some(range) => &a[range],
                    None => {
                        let slab = &mut x_stage[..xv.slab_len(chunk.input)];
                        xv.gather(a, chunk.input, slab);
                        slab
                    }
                };
                let dy: &[T] = match yv.contiguous(chunk.output) {
                    Some(range) => &b[range],
                    None => {
                        let slab = &mut y_stage[..yv.slab_len(chunk.output)];
                        yv.gather(b, chunk.output, slab);
                        slab
                    }
                };
                if let Some(half) = &mut half_sum {
                    cpu::run_chunk(
                        problem,
                        op,
                        step.algo,
                        chunk,
                        alpha,
                        x,
                        dy,
                        0.0,
                        &mut half.partial,
                        workspace,
                    )
                    .map_err(cpu_error)?;
                    half.accumulate();
                    continue;
                }
                cpu::run_chunk(
                    problem, op, step.algo, chunk, alpha, x, dy, call_beta, out, workspace,
                )
                .map_err(cpu_error)?;
                call_beta = 1.0;
            }
            if let Some(half) = half_sum {
                half.finish(out);
            } else if calls == 0 {
                // Every window lies in the padding: the gradient is zero.
                for v in out.iter_mut() {
                    cpu::store1(v, 0.0, alpha, beta);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::reference::conv_f64;
    use crate::backend::cpu::AlignedWorkspace;
    use crate::solver::DType;
    use proptest::prelude::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `parts` uneven positive sizes adding up to `extent` (fewer when the extent is smaller).
    fn uneven(extent: i64, parts: i64) -> Vec<i64> {
        let parts = parts.min(extent);
        let weights: Vec<i64> = (0..parts).map(|i| [3, 1, 2][i as usize % 3]).collect();
        let total: i64 = weights.iter().sum();
        let rest = extent - parts;
        let mut sizes: Vec<i64> = weights.iter().map(|w| 1 + rest * w / total).collect();
        let sum: i64 = sizes.iter().sum();
        sizes[0] += extent - sum;
        sizes
    }

    fn extent(problem: &ConvProblem, op: ConvOp) -> i64 {
        AxisGeometry::of(problem, split_axis(problem)).extent(op)
    }

    fn run_spatial(
        problem: &ConvProblem,
        op: ConvOp,
        steps: &[SpatialStep],
        (alpha, beta): (f32, f32),
        a: &[f32],
        b: &[f32],
        out: &mut [f32],
    ) {
        let bytes = spatial_cpu_workspace_bytes(problem, op, steps).unwrap();
        let mut ws = AlignedWorkspace::new(bytes);
        execute_spatial_cpu(
            problem,
            op,
            steps,
            (alpha, beta),
            ConvOperands {
                a,
                b,
                out,
                workspace: ws.as_bytes_mut(),
            },
        )
        .unwrap();
    }

    fn shapes() -> Vec<ConvProblem> {
        let base = ConvProblem::new(2, 4, 15, 7, 4, 3, 3);
        let base3 = ConvProblem::new_3d(1, 2, 15, 4, 5, 4, 3, 3, 3);
        vec![
            // stride 2, odd sizes
            ConvProblem {
                stride_h: 2,
                stride_w: 2,
                pad_h: 1,
                pad_w: 1,
                ..base
            },
            // dilation 2
            ConvProblem {
                dilation_h: 2,
                pad_h: 2,
                pad_w: 1,
                ..base
            },
            // kernel 1: no halo
            ConvProblem { r: 1, s: 1, ..base },
            // padding larger than a chunk's halo
            ConvProblem {
                pad_h: 4,
                pad_w: 1,
                ..base
            },
            // stride larger than the span: dx rows no window reaches
            ConvProblem {
                stride_h: 3,
                r: 1,
                s: 1,
                ..base
            },
            // groups
            ConvProblem {
                groups: 2,
                pad_h: 1,
                pad_w: 1,
                stride_h: 2,
                ..base
            },
            // 3-D: depth stride 2 with padding, dilation, groups
            ConvProblem {
                stride_d: 2,
                pad_d: 1,
                pad_h: 1,
                pad_w: 1,
                ..base3
            },
            ConvProblem {
                dilation_d: 2,
                pad_d: 3,
                groups: 2,
                ..base3
            },
            // 1-D (split along the width)
            ConvProblem {
                stride_w: 2,
                pad_w: 2,
                ..ConvProblem::new_1d(2, 3, 17, 4, 3)
            },
        ]
    }

    /// Every op, algorithm and layout; 2, 3 and 7 uneven chunks against the unsplit call of the
    /// same algorithm: bitwise for forward and backward-data, within rounding for
    /// backward-filter.
    #[test]
    fn uneven_chunks_reproduce_the_unsplit_op() {
        for shape in shapes() {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                let problem = ConvProblem { layout, ..shape };
                for op in ConvOp::ALL {
                    let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(&problem, op).unwrap();
                    let (a, b) = (data(la, 1), data(lb, 2));
                    let out0 = data(lo, 3);
                    for algo in CpuAlgo::ALL {
                        // (alpha, beta): overwrite (out NaN), blend.
                        for (alpha, beta) in [(1.0f32, 0.0f32), (-1.5, 0.5)] {
                            let init: Vec<f32> = if beta == 0.0 {
                                vec![f32::NAN; lo]
                            } else {
                                out0.clone()
                            };
                            let mut whole = init.clone();
                            let mut ws =
                                AlignedWorkspace::new(cpu::workspace_bytes(&problem, op, algo));
                            cpu::run(
                                &problem,
                                op,
                                algo,
                                alpha,
                                &a,
                                &b,
                                beta,
                                &mut whole,
                                ws.as_bytes_mut(),
                            )
                            .unwrap();
                            for parts in [2, 3, 7] {
                                let sizes = uneven(extent(&problem, op), parts);
                                let steps: Vec<SpatialStep> = sizes
                                    .iter()
                                    .map(|&size| SpatialStep { size, algo })
                                    .collect();
                                let mut split = init.clone();
                                run_spatial(
                                    &problem,
                                    op,
                                    &steps,
                                    (alpha, beta),
                                    &a,
                                    &b,
                                    &mut split,
                                );
                                let what = format!(
                                    "{} {op} {algo} chunks {sizes:?} alpha {alpha} beta {beta}",
                                    problem.describe()
                                );
                                if op == ConvOp::BackwardFilter {
                                    for (i, (s, w)) in split.iter().zip(&whole).enumerate() {
                                        assert!(
                                            (s - w).abs() <= 1e-5 * w.abs().max(1.0),
                                            "{what}: element {i}: {s} vs {w}"
                                        );
                                    }
                                } else {
                                    let bits = |v: &[f32]| -> Vec<u32> {
                                        v.iter().map(|x| x.to_bits()).collect()
                                    };
                                    assert_eq!(bits(&split), bits(&whole), "{what}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Chunks with different algorithms, batch 1 NHWC (the slabs are read and written in
    /// place) and NCHW (staged).
    #[test]
    fn mixed_algorithms_and_in_place_slabs() {
        for layout in [Layout::Nhwc, Layout::Nchw] {
            let problem = ConvProblem {
                pad_h: 1,
                pad_w: 1,
                layout,
                ..ConvProblem::new(1, 3, 13, 6, 5, 3, 3)
            };
            for op in ConvOp::ALL {
                let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(&problem, op).unwrap();
                let (a, b) = (data(la, 4), data(lb, 5));
                let sizes = uneven(extent(&problem, op), 3);
                let steps: Vec<SpatialStep> = sizes
                    .iter()
                    .zip(CpuAlgo::ALL)
                    .map(|(&size, algo)| SpatialStep { size, algo })
                    .collect();
                let mut split = vec![f32::NAN; lo];
                run_spatial(&problem, op, &steps, (1.0, 0.0), &a, &b, &mut split);
                let want = conv_f64(
                    &problem,
                    op,
                    &a.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                    &b.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                )
                .unwrap();
                for (s, w) in split.iter().zip(&want) {
                    assert!((f64::from(*s) - w).abs() <= 1e-4 * w.abs().max(1.0), "{op}");
                }
            }
        }
    }

    /// fp16 and bf16: forward and backward-data chunks equal the unsplit op bitwise;
    /// backward-filter sums its chunks in fp32 and rounds once, so it is within a few units
    /// in the last place of the unsplit op (which also rounds once).
    #[test]
    fn half_precision_chunks_reproduce_the_unsplit_op() {
        fn check<T: Element + PartialEq + std::fmt::Debug>(dtype: DType, ulp: f32) {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                let problem = ConvProblem {
                    pad_h: 1,
                    pad_w: 1,
                    stride_h: 2,
                    dtype,
                    layout,
                    ..ConvProblem::new(2, 4, 15, 7, 4, 3, 3)
                };
                for op in ConvOp::ALL {
                    let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(&problem, op).unwrap();
                    let half = |v: Vec<f32>| -> Vec<T> { v.into_iter().map(T::from_f32).collect() };
                    let (a, b) = (half(data(la, 6)), half(data(lb, 7)));
                    for algo in CpuAlgo::ALL {
                        let mut whole = vec![T::from_f32(0.0); lo];
                        let mut ws =
                            AlignedWorkspace::new(cpu::workspace_bytes(&problem, op, algo));
                        cpu::run(
                            &problem,
                            op,
                            algo,
                            1.0,
                            &a,
                            &b,
                            0.0,
                            &mut whole,
                            ws.as_bytes_mut(),
                        )
                        .unwrap();
                        let steps: Vec<SpatialStep> = uneven(extent(&problem, op), 3)
                            .into_iter()
                            .map(|size| SpatialStep { size, algo })
                            .collect();
                        let bytes = spatial_cpu_workspace_bytes(&problem, op, &steps).unwrap();
                        let mut ws = AlignedWorkspace::new(bytes);
                        let mut split = vec![T::from_f32(f32::NAN); lo];
                        execute_spatial_cpu(
                            &problem,
                            op,
                            &steps,
                            (1.0, 0.0),
                            ConvOperands {
                                a: &a,
                                b: &b,
                                out: &mut split,
                                workspace: ws.as_bytes_mut(),
                            },
                        )
                        .unwrap();
                        let what = format!("{} {op} {algo}", problem.describe());
                        if op == ConvOp::BackwardFilter {
                            for (s, w) in split.iter().zip(&whole) {
                                let (s, w) = (s.to_f32(), w.to_f32());
                                assert!(
                                    (s - w).abs() <= 4.0 * ulp * w.abs().max(1.0),
                                    "{what}: {s} vs {w}"
                                );
                            }
                        } else {
                            assert_eq!(split, whole, "{what}");
                        }
                    }
                }
            }
        }
        check::<half::f16>(DType::Fp16, 1.0 / 1024.0);
        check::<half::bf16>(DType::Bf16, 1.0 / 128.0);
    }

    #[test]
    fn bad_chunkings_are_errors() {
        let problem = ConvProblem {
            pad_h: 1,
            ..ConvProblem::new(1, 2, 8, 5, 2, 3, 3)
        };
        let (x, w) = (vec![0.0f32; 80], vec![0.0f32; 36]);
        let mut y = vec![0.0f32; 2 * 8 * 3];
        let algo = CpuAlgo::Direct;
        for sizes in [vec![], vec![4, 3], vec![4, 5], vec![0, 8], vec![-1, 9]] {
            let steps: Vec<SpatialStep> = sizes
                .iter()
                .map(|&size| SpatialStep { size, algo })
                .collect();
            let err = execute_spatial_cpu(
                &problem,
                ConvOp::Forward,
                &steps,
                (1.0, 0.0),
                ConvOperands {
                    a: &x,
                    b: &w,
                    out: &mut y,
                    workspace: &mut [],
                },
            );
            assert!(
                matches!(err, Err(ExecError::InvalidPlan { .. })),
                "{sizes:?}: {err:?}"
            );
        }
        let steps = [SpatialStep { size: 8, algo }];
        let err = execute_spatial_cpu(
            &problem,
            ConvOp::Forward,
            &steps,
            (1.0, 0.0),
            ConvOperands {
                a: &x[1..],
                b: &w,
                out: &mut y,
                workspace: &mut [],
            },
        );
        assert!(matches!(err, Err(ExecError::Cpu { .. })));
        let steps = [SpatialStep {
            size: 8,
            algo: CpuAlgo::Im2colGemm,
        }];
        let err = execute_spatial_cpu(
            &problem,
            ConvOp::Forward,
            &steps,
            (1.0, 0.0),
            ConvOperands {
                a: &x,
                b: &w,
                out: &mut y,
                workspace: &mut [],
            },
        );
        assert!(matches!(
            err,
            Err(ExecError::Cpu {
                source: CpuError::WorkspaceTooSmall { .. },
                ..
            })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Random small shapes (2-D and 3-D, both layouts) and random chunkings against the
        /// float64 reference.
        #[test]
        fn random_shapes_and_chunkings_match_the_reference(
            three_d in any::<bool>(),
            nhwc in any::<bool>(),
            n in 1i64..3, groups in 1i64..3, cg in 1i64..3, kg in 1i64..3,
            extent in 1i64..12, other in 1i64..6,
            filter in 1i64..4, pad in 0i64..4, stride in 1i64..4, dilation in 1i64..3,
            op_index in 0usize..3,
            algo_index in 0usize..3,
            cuts in proptest::collection::vec(0.0f64..1.0, 0..6),
        ) {
            let layout = if nhwc { Layout::Nhwc } else { Layout::Nchw };
            let (c, k) = (groups * cg, groups * kg);
            let mut problem = if three_d {
                ConvProblem::new_3d(n, c, extent, other, 3, k, filter, 2, 1)
            } else {
                ConvProblem::new(n, c, extent, other, k, filter, 1)
            };
            problem.groups = groups;
            problem.layout = layout;
            if three_d {
                (problem.pad_d, problem.stride_d, problem.dilation_d) = (pad, stride, dilation);
            } else {
                (problem.pad_h, problem.stride_h, problem.dilation_h) = (pad, stride, dilation);
            }
            prop_assume!(problem.validate().is_ok());
            let op = ConvOp::ALL[op_index];
            let e = extent_of(&problem, op);
            let mut bounds: Vec<i64> = cuts.iter().map(|f| (f * e as f64) as i64).filter(|&b| b > 0 && b < e).collect();
            bounds.sort_unstable();
            bounds.dedup();
            let mut sizes = Vec::new();
            let mut last = 0;
            for b in bounds.into_iter().chain([e]) {
                sizes.push(b - last);
                last = b;
            }
            let steps: Vec<SpatialStep> = sizes
                .iter()
                .enumerate()
                .map(|(i, &size)| SpatialStep { size, algo: CpuAlgo::ALL[(algo_index + i) % 3] })
                .collect();
            let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(&problem, op).unwrap();
            let (a, b) = (data(la, 7), data(lb, 8));
            let mut got = vec![f32::NAN; lo];
            run_spatial(&problem, op, &steps, (1.0, 0.0), &a, &b, &mut got);
            let widen = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            let want = conv_f64(&problem, op, &widen(&a), &widen(&b)).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert!((f64::from(*g) - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "{} {op} {sizes:?}: element {i}: {g} vs {w}", problem.describe());
            }
        }
    }

    fn extent_of(problem: &ConvProblem, op: ConvOp) -> i64 {
        extent(problem, op)
    }
}
