//! The spatial cases of the GPU test `spatial_plans_equal_undivided_and_the_host_reference`
//! (tests/gpu_cudnn.rs) and the chunkings it runs, shared with the cuDNN host tier
//! (tests/cudnn_host.rs), which builds the same chunk views on a device description first.

use mucudnn::solver::{ConvProblem, DType, Layout, MathMode};

/// One case: its label, the problem, and whether its chunks are strided views of the rows
/// (NCHW: each channel's chunk rows lie one channel plane apart), which no engine need take.
pub struct Case {
    pub label: &'static str,
    pub problem: ConvProblem,
    pub strided_rows: bool,
}

pub fn cases() -> Vec<Case> {
    let fp16 = |p: ConvProblem| ConvProblem {
        dtype: DType::Fp16,
        layout: Layout::Nhwc,
        math: MathMode::TensorOp,
        ..p
    };
    let case = |label, problem: ConvProblem| Case {
        label,
        problem,
        strided_rows: problem.layout == Layout::Nchw,
    };
    vec![
        case(
            "2d fp16 nhwc 3x3 pad 1",
            fp16(ConvProblem {
                pad_h: 1,
                pad_w: 1,
                ..ConvProblem::new(1, 16, 23, 20, 32, 3, 3)
            }),
        ),
        case(
            "3d fp16 ndhwc 3x3x3 pad 1 stride 2",
            fp16(ConvProblem {
                pad_d: 1,
                pad_h: 1,
                pad_w: 1,
                stride_d: 2,
                stride_h: 2,
                stride_w: 2,
                ..ConvProblem::new_3d(1, 8, 25, 10, 10, 16, 3, 3, 3)
            }),
        ),
        case(
            "2d fp32 nchw dilation 2 stride 2 pad 3",
            ConvProblem {
                pad_h: 3,
                pad_w: 1,
                stride_h: 2,
                dilation_h: 2,
                math: MathMode::Fma,
                ..ConvProblem::new(2, 8, 31, 17, 8, 3, 3)
            },
        ),
        case(
            "2d fp32 nchw 1x1 stride 3",
            ConvProblem {
                stride_h: 3,
                stride_w: 3,
                math: MathMode::Fma,
                ..ConvProblem::new(1, 8, 40, 12, 8, 1, 1)
            },
        ),
    ]
}

/// The chunk size of `extent` rows whose equal chunks tile it exactly, in at least two
/// chunks: a size the profiler times at every position a plan of it runs (start, middle,
/// end), so its configurations build there. 1 for a prime extent.
pub fn even_chunk(extent: i64) -> i64 {
    (2..=extent)
        .find(|d| extent % d == 0)
        .map_or(1, |d| extent / d)
}

/// Uneven chunkings of `extent` rows into 2, 3 and 7 chunks (`extent` >= 10).
pub fn uneven_chunkings(extent: i64) -> [Vec<i64>; 3] {
    let mut seven = vec![1, 3, 2, 1, 2, 1];
    seven.push(extent - seven.iter().sum::<i64>());
    [
        vec![extent / 3, extent - extent / 3],
        vec![2, extent / 2, extent - 2 - extent / 2],
        seven,
    ]
}
