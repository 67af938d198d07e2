//! From a caller's cuDNN descriptors to a [`ConvProblem`]: the shapes, dtype, layout, math mode
//! and convolution parameters a call describes, and whether mucudnn can run it.
//!
//! Pure: the FFI wall reads the descriptors (`read_*_descriptor`, cuDNN's Nd getters), this
//! module checks what they say. A 2-D convolution has 4-D tensors and 2 spatial dims, a 3-D one
//! 5-D tensors and 3 (depth first); other ranks are not supported. Activations must be fully
//! packed NCHW / NCDHW or NHWC / NDHWC (the batch outermost, so that a micro-batch is a pointer
//! offset), the filter in the same layout, one dtype throughout, float accumulation and
//! cross-correlation: what [`ConvProblem`] models. Anything else is
//! [`FfiError::NotSupported`] (cuDNN could run it, mucudnn does not) or
//! [`FfiError::InvalidArgument`] (the descriptors do not make one convolution).

use super::error::{invalid, FfiError};
use crate::backend::cudnn::graph_params::packed_strides;
use crate::backend::cudnn::{
    ConvolutionDescriptorInfo, DataTypeCode, FilterDescriptorInfo, TensorDescriptorInfo,
};
use crate::solver::{ConvOp, ConvProblem, DType, Layout};

/// The C names of an op's descriptors in forward roles `[input, filter, convolution, output]`
/// (as the cuDNN call names them: `dxDesc` is the input of backward-data).
pub fn descriptor_names(op: ConvOp) -> [&'static str; 4] {
    match op {
        ConvOp::Forward => ["xDesc", "wDesc", "convDesc", "yDesc"],
        ConvOp::BackwardData => ["dxDesc", "wDesc", "convDesc", "dyDesc"],
        ConvOp::BackwardFilter => ["xDesc", "dwDesc", "convDesc", "dyDesc"],
    }
}

/// Whether `info` is fully packed in `layout` (strides of size-1 dimensions do not matter).
fn packed_in(info: &TensorDescriptorInfo, layout: Layout) -> bool {
    let dims: Vec<i64> = info.dims.iter().map(|&d| i64::from(d)).collect();
    let expected = packed_strides(layout, &dims);
    info.strides.len() == dims.len()
        && (0..dims.len()).all(|i| dims[i] <= 1 || i64::from(info.strides[i]) == expected[i])
}

fn other(layout: Layout) -> Layout {
    match layout {
        Layout::Nchw => Layout::Nhwc,
        Layout::Nhwc => Layout::Nchw,
    }
}

fn check_packed(name: &str, info: &TensorDescriptorInfo, layout: Layout) -> Result<(), FfiError> {
    if packed_in(info, layout) {
        return Ok(());
    }
    let how = if packed_in(info, other(layout)) {
        format!("is packed {} but the filter is {layout}", other(layout))
    } else {
        "is not a fully packed NCHW or NHWC (NCDHW or NDHWC) tensor".to_string()
    };
    Err(FfiError::NotSupported(format!(
        "{name} (dims {:?}, strides {:?}) {how}: mucudnn needs activations and filters packed in \
         one layout (NCHW or NHWC; NCDHW or NDHWC in 3-D), so that a micro-batch is a pointer \
         offset",
        info.dims, info.strides
    )))
}

fn dtype_of(name: &str, code: DataTypeCode) -> Result<DType, FfiError> {
    code.dtype().ok_or_else(|| {
        FfiError::NotSupported(format!(
            "{name} has data type {code}; mucudnn runs CUDNN_DATA_FLOAT, CUDNN_DATA_HALF and \
             CUDNN_DATA_BFLOAT16"
        ))
    })
}

/// The tensors' rank (4 for a 2-D convolution, 5 for a 3-D one), after checking that the
/// four descriptors agree on it: every tensor that rank, the convolution two spatial dims
/// fewer.
fn check_ranks(
    op: ConvOp,
    input: &TensorDescriptorInfo,
    filter: &FilterDescriptorInfo,
    conv: &ConvolutionDescriptorInfo,
    output: &TensorDescriptorInfo,
) -> Result<usize, FfiError> {
    let [input_name, filter_name, conv_name, output_name] = descriptor_names(op);
    let rank = input.dims.len();
    if rank != 4 && rank != 5 {
        return Err(FfiError::NotSupported(format!(
            "{input_name} has {rank} dims {:?}; mucudnn runs 2-D convolutions (4-D tensors, \
             1-D as unit height) and 3-D ones (5-D tensors)",
            input.dims
        )));
    }
    for (name, dims) in [(filter_name, &filter.dims), (output_name, &output.dims)] {
        if dims.len() != rank {
            return Err(invalid(format!(
                "{name} has {} dims {dims:?}, {input_name} {rank}: one convolution's tensors \
                 have one rank",
                dims.len()
            )));
        }
    }
    let lengths = [conv.pad.len(), conv.stride.len(), conv.dilation.len()];
    if lengths.iter().any(|&l| l != rank - 2) {
        return Err(invalid(format!(
            "{conv_name} has {} spatial dims, but {rank}-D tensors need {}",
            lengths[0],
            rank - 2
        )));
    }
    Ok(rank)
}

/// The convolution that `op` runs with these descriptors, in forward roles: `input` is x (dx
/// for backward-data), `filter` w (dw), `output` y (dy).
pub fn problem_from_descriptors(
    op: ConvOp,
    input: &TensorDescriptorInfo,
    filter: &FilterDescriptorInfo,
    conv: &ConvolutionDescriptorInfo,
    output: &TensorDescriptorInfo,
) -> Result<ConvProblem, FfiError> {
    let [input_name, filter_name, conv_name, output_name] = descriptor_names(op);
    let dtype = dtype_of(input_name, input.data_type)?;
    for (name, code) in [
        (filter_name, filter.data_type),
        (output_name, output.data_type),
    ] {
        if dtype_of(name, code)? != dtype {
            return Err(invalid(format!(
                "{name} has data type {code}, {input_name} {}: one convolution has one data type",
                input.data_type
            )));
        }
    }
    if conv.compute_type != DataTypeCode::of(DType::Fp32) {
        return Err(FfiError::NotSupported(format!(
            "{conv_name} computes in {}; mucudnn runs float accumulation (compute type \
             CUDNN_DATA_FLOAT) only",
            conv.compute_type
        )));
    }
    if !conv.cross_correlation {
        return Err(FfiError::NotSupported(format!(
            "{conv_name} has mode CUDNN_CONVOLUTION (a flipped filter); mucudnn runs \
             CUDNN_CROSS_CORRELATION, what deep-learning frameworks call convolution"
        )));
    }
    let math = conv.math.ok_or_else(|| {
        FfiError::NotSupported(format!(
            "{conv_name} has math type {}, which this mucudnn does not know",
            conv.math_code
        ))
    })?;
    let layout = filter.layout.ok_or_else(|| {
        FfiError::NotSupported(format!(
            "{filter_name} has format {} (2 is CUDNN_TENSOR_NCHW_VECT_C); mucudnn runs \
             CUDNN_TENSOR_NCHW and CUDNN_TENSOR_NHWC",
            filter.format_code
        ))
    })?;
    let rank = check_ranks(op, input, filter, conv, output)?;
    // `[n, c, (d,) h, w]`, `[k, c / groups, (t,) r, s]`, and `[depth,] height, width` values,
    // the depth at its 2-D default when the descriptors are 4-D.
    let spatial = |values: &[i32], neutral: i64| -> [i64; 3] {
        let tail = &values[values.len().saturating_sub(3)..];
        let mut out = [neutral; 3];
        for (slot, &v) in out[3 - tail.len()..].iter_mut().zip(tail) {
            *slot = i64::from(v);
        }
        out
    };
    let (n, c) = (i64::from(input.dims[0]), i64::from(input.dims[1]));
    let [d, h, w] = spatial(&input.dims[2..], 1);
    let (k, c_per_group) = (i64::from(filter.dims[0]), i64::from(filter.dims[1]));
    let [t, r, s] = spatial(&filter.dims[2..], 1);
    let [pad_d, pad_h, pad_w] = spatial(&conv.pad, 0);
    let [stride_d, stride_h, stride_w] = spatial(&conv.stride, 1);
    let [dilation_d, dilation_h, dilation_w] = spatial(&conv.dilation, 1);
    let groups = i64::from(conv.groups);
    if groups < 1 || c_per_group * groups != c {
        return Err(invalid(format!(
            "{input_name} has {c} channels, but {filter_name} has {c_per_group} per group and \
             {conv_name} {groups} group(s)"
        )));
    }
    let problem = ConvProblem {
        pad_d,
        pad_h,
        pad_w,
        stride_d,
        stride_h,
        stride_w,
        dilation_d,
        dilation_h,
        dilation_w,
        groups,
        dtype,
        layout,
        math,
        ..ConvProblem::new_3d(n, c, d, h, w, k, t, r, s)
    };
    problem.validate().map_err(|e| {
        invalid(format!(
            "{input_name}, {filter_name} and {conv_name} do not describe a valid convolution: {e}"
        ))
    })?;
    let full = problem.output_dims();
    let expected: Vec<i64> = if rank == 5 {
        full.to_vec()
    } else {
        vec![full[0], full[1], full[3], full[4]]
    };
    let got: Vec<i64> = output.dims.iter().map(|&x| i64::from(x)).collect();
    if got != expected {
        return Err(invalid(format!(
            "{output_name} has dims {:?}, but the convolution of {} gives {expected:?}",
            output.dims,
            problem.describe()
        )));
    }
    check_packed(input_name, input, layout)?;
    check_packed(output_name, output, layout)?;
    Ok(problem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cudnn::shape::Nd;
    use crate::solver::MathMode;

    fn tensor(dtype: DType, layout: Layout, dims: &[i32]) -> TensorDescriptorInfo {
        let wide: Vec<i64> = dims.iter().map(|&d| i64::from(d)).collect();
        let strides = packed_strides(layout, &wide).map(|s| s as i32);
        TensorDescriptorInfo {
            data_type: DataTypeCode::of(dtype),
            dims: Nd::from_slice(dims),
            strides,
        }
    }

    fn filter(dtype: DType, layout: Layout, dims: &[i32]) -> FilterDescriptorInfo {
        FilterDescriptorInfo {
            data_type: DataTypeCode::of(dtype),
            layout: Some(layout),
            format_code: match layout {
                Layout::Nchw => 0,
                Layout::Nhwc => 1,
            },
            dims: Nd::from_slice(dims),
        }
    }

    fn conv(pad: i32, stride: i32, dilation: i32, groups: i32) -> ConvolutionDescriptorInfo {
        ConvolutionDescriptorInfo {
            pad: [pad, pad].into(),
            stride: [stride, stride].into(),
            dilation: [dilation, dilation].into(),
            cross_correlation: true,
            compute_type: DataTypeCode::of(DType::Fp32),
            groups,
            math: Some(MathMode::Default),
            math_code: 0,
        }
    }

    /// AlexNet conv2 (fp32 NCHW) as a framework would describe it.
    fn conv2(
        layout: Layout,
    ) -> (
        TensorDescriptorInfo,
        FilterDescriptorInfo,
        ConvolutionDescriptorInfo,
        TensorDescriptorInfo,
    ) {
        (
            tensor(DType::Fp32, layout, &[32, 96, 27, 27]),
            filter(DType::Fp32, layout, &[256, 96, 5, 5]),
            conv(2, 1, 1, 1),
            tensor(DType::Fp32, layout, &[32, 256, 27, 27]),
        )
    }

    #[test]
    fn reads_nchw_and_nhwc() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let (x, w, c, y) = conv2(layout);
            let problem = problem_from_descriptors(ConvOp::Forward, &x, &w, &c, &y).unwrap();
            assert_eq!(
                problem,
                ConvProblem {
                    pad_h: 2,
                    pad_w: 2,
                    layout,
                    ..ConvProblem::new(32, 96, 27, 27, 256, 5, 5)
                }
            );
        }
    }

    #[test]
    fn grouped_strided_dilated_half() {
        let x = tensor(DType::Fp16, Layout::Nhwc, &[8, 6, 9, 10]);
        let w = filter(DType::Fp16, Layout::Nhwc, &[4, 3, 3, 3]);
        let c = ConvolutionDescriptorInfo {
            pad: [1, 2].into(),
            stride: [2, 1].into(),
            dilation: [1, 2].into(),
            math: Some(MathMode::TensorOp),
            math_code: 1,
            ..conv(0, 1, 1, 2)
        };
        let y = tensor(DType::Fp16, Layout::Nhwc, &[8, 4, 5, 10]);
        let problem = problem_from_descriptors(ConvOp::BackwardData, &x, &w, &c, &y).unwrap();
        assert_eq!(
            problem,
            ConvProblem {
                pad_h: 1,
                pad_w: 2,
                stride_h: 2,
                stride_w: 1,
                dilation_h: 1,
                dilation_w: 2,
                groups: 2,
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..ConvProblem::new(8, 6, 9, 10, 4, 3, 3)
            }
        );
    }

    /// r3d_18's stem (3-D, fp16 NDHWC and fp32 NCDHW) as a framework would describe it with
    /// 5-D descriptors and a convolution of 3 spatial dims.
    #[test]
    fn reads_ncdhw_and_ndhwc() {
        for (dtype, layout) in [(DType::Fp32, Layout::Nchw), (DType::Fp16, Layout::Nhwc)] {
            let x = tensor(dtype, layout, &[2, 3, 16, 112, 112]);
            let w = filter(dtype, layout, &[64, 3, 3, 7, 7]);
            let c = ConvolutionDescriptorInfo {
                pad: [1, 3, 3].into(),
                stride: [1, 2, 2].into(),
                dilation: [1, 1, 1].into(),
                ..conv(0, 1, 1, 1)
            };
            let y = tensor(dtype, layout, &[2, 64, 16, 56, 56]);
            for op in ConvOp::ALL {
                let problem = problem_from_descriptors(op, &x, &w, &c, &y).unwrap();
                assert_eq!(
                    problem,
                    ConvProblem {
                        pad_d: 1,
                        pad_h: 3,
                        pad_w: 3,
                        stride_h: 2,
                        stride_w: 2,
                        dtype,
                        layout,
                        ..ConvProblem::new_3d(2, 3, 16, 112, 112, 64, 3, 7, 7)
                    }
                );
                assert!(problem.is_3d());
            }
            // NDHWC activations with an NCDHW filter: not one layout.
            let other_filter = filter(dtype, other(layout), &[64, 3, 3, 7, 7]);
            let message = problem_from_descriptors(ConvOp::Forward, &x, &other_filter, &c, &y)
                .unwrap_err()
                .to_string();
            assert!(message.contains("but the filter is"), "{message}");
        }
        // A 5-D description of a 2-D problem (depth 1, filter depth 1) is that 2-D problem.
        let x = tensor(DType::Fp32, Layout::Nchw, &[8, 6, 1, 9, 10]);
        let w = filter(DType::Fp32, Layout::Nchw, &[4, 6, 1, 3, 3]);
        let c = ConvolutionDescriptorInfo {
            pad: [0, 1, 1].into(),
            stride: [1, 1, 1].into(),
            dilation: [1, 1, 1].into(),
            ..conv(0, 1, 1, 1)
        };
        let y = tensor(DType::Fp32, Layout::Nchw, &[8, 4, 1, 9, 10]);
        let problem = problem_from_descriptors(ConvOp::Forward, &x, &w, &c, &y).unwrap();
        assert!(!problem.is_3d());
    }

    #[test]
    fn ranks_must_agree_and_be_4_or_5() {
        let x5 = tensor(DType::Fp32, Layout::Nchw, &[2, 4, 5, 6, 7]);
        let w5 = filter(DType::Fp32, Layout::Nchw, &[8, 4, 3, 3, 3]);
        let y5 = tensor(DType::Fp32, Layout::Nchw, &[2, 8, 3, 4, 5]);
        let c3 = ConvolutionDescriptorInfo {
            pad: [0, 0, 0].into(),
            stride: [1, 1, 1].into(),
            dilation: [1, 1, 1].into(),
            ..conv(0, 1, 1, 1)
        };
        assert!(problem_from_descriptors(ConvOp::Forward, &x5, &w5, &c3, &y5).is_ok());
        let invalid_argument = |e: FfiError| {
            assert!(matches!(e, FfiError::InvalidArgument(_)), "{e:?}");
            e.to_string()
        };
        // 5-D tensors with a 2-D convolution descriptor.
        let message = invalid_argument(
            problem_from_descriptors(ConvOp::Forward, &x5, &w5, &conv(0, 1, 1, 1), &y5)
                .unwrap_err(),
        );
        assert!(message.contains("2 spatial dims"), "{message}");
        // A 4-D filter with 5-D activations.
        let w4 = filter(DType::Fp32, Layout::Nchw, &[8, 4, 3, 3]);
        let message = invalid_argument(
            problem_from_descriptors(ConvOp::BackwardFilter, &x5, &w4, &c3, &y5).unwrap_err(),
        );
        assert!(message.starts_with("dwDesc has 4 dims"), "{message}");
        // A wrong output depth.
        let mut y_wrong = y5;
        y_wrong.dims[2] = 4;
        let message = invalid_argument(
            problem_from_descriptors(ConvOp::Forward, &x5, &w5, &c3, &y_wrong).unwrap_err(),
        );
        assert!(message.contains("gives [2, 8, 3, 4, 5]"), "{message}");
        // 6-D tensors (a 4-D convolution): cuDNN could describe it, mucudnn does not run it.
        let x6 = tensor(DType::Fp32, Layout::Nchw, &[2, 4, 5, 6, 7, 3]);
        let e = problem_from_descriptors(ConvOp::Forward, &x6, &w5, &c3, &y5).unwrap_err();
        assert!(matches!(e, FfiError::NotSupported(_)), "{e:?}");
        assert!(e.to_string().contains("3-D ones (5-D tensors)"), "{e}");
    }

    #[test]
    fn size_one_dimensions_take_any_stride() {
        // One input channel: PyTorch describes it with NCHW strides even for channels_last.
        let mut x = tensor(DType::Fp32, Layout::Nhwc, &[4, 1, 8, 8]);
        x.strides = [64, 64, 8, 1].into();
        let w = filter(DType::Fp32, Layout::Nhwc, &[2, 1, 3, 3]);
        let y = tensor(DType::Fp32, Layout::Nhwc, &[4, 2, 6, 6]);
        let problem = problem_from_descriptors(ConvOp::Forward, &x, &w, &conv(0, 1, 1, 1), &y);
        assert_eq!(problem.unwrap().layout, Layout::Nhwc);
    }

    fn error(
        op: ConvOp,
        parts: (
            TensorDescriptorInfo,
            FilterDescriptorInfo,
            ConvolutionDescriptorInfo,
            TensorDescriptorInfo,
        ),
    ) -> FfiError {
        let (x, w, c, y) = parts;
        problem_from_descriptors(op, &x, &w, &c, &y).unwrap_err()
    }

    #[test]
    fn what_mucudnn_does_not_run_is_not_supported() {
        let not_supported = |e: FfiError| {
            assert!(matches!(e, FfiError::NotSupported(_)), "{e:?}");
            e.to_string()
        };
        let (x, w, c, y) = conv2(Layout::Nchw);
        let mut double = x;
        double.data_type = DataTypeCode(1);
        let message = not_supported(error(ConvOp::Forward, (double, w, c, y)));
        assert!(
            message.starts_with("xDesc has data type CUDNN_DATA_DOUBLE (1)"),
            "{message}"
        );
        let half_compute = ConvolutionDescriptorInfo {
            compute_type: DataTypeCode::of(DType::Fp16),
            ..c
        };
        let message = not_supported(error(ConvOp::Forward, (x, w, half_compute, y)));
        assert!(message.contains("CUDNN_DATA_HALF"), "{message}");
        let flipped = ConvolutionDescriptorInfo {
            cross_correlation: false,
            ..c
        };
        not_supported(error(ConvOp::Forward, (x, w, flipped, y)));
        let vect = FilterDescriptorInfo {
            layout: None,
            format_code: 2,
            ..w
        };
        not_supported(error(ConvOp::Forward, (x, vect, c, y)));
        let unknown_math = ConvolutionDescriptorInfo {
            math: None,
            math_code: 9,
            ..c
        };
        not_supported(error(ConvOp::Forward, (x, w, unknown_math, y)));
        // x in NHWC with an NCHW filter.
        let (x_nhwc, ..) = conv2(Layout::Nhwc);
        let message = not_supported(error(ConvOp::Forward, (x_nhwc, w, c, y)));
        assert!(
            message.contains("packed nhwc but the filter is nchw"),
            "{message}"
        );
        // A padded row (a view of a larger tensor).
        let mut strided = y;
        strided.strides = [256 * 27 * 32, 27 * 32, 32, 1].into();
        let message = not_supported(error(ConvOp::BackwardFilter, (x, w, c, strided)));
        assert!(message.starts_with("dyDesc (dims"), "{message}");
        assert!(message.contains("not a fully packed"), "{message}");
    }

    #[test]
    fn descriptors_that_do_not_fit_together_are_invalid() {
        let invalid_argument = |e: FfiError| {
            assert!(matches!(e, FfiError::InvalidArgument(_)), "{e:?}");
            e.to_string()
        };
        let (x, w, c, y) = conv2(Layout::Nchw);
        let half_filter = FilterDescriptorInfo {
            data_type: DataTypeCode::of(DType::Fp16),
            ..w
        };
        let message = invalid_argument(error(ConvOp::BackwardData, (x, half_filter, c, y)));
        assert!(
            message.starts_with("wDesc has data type CUDNN_DATA_HALF"),
            "{message}"
        );
        let message = invalid_argument(error(ConvOp::Forward, (x, w, conv(2, 1, 1, 2), y)));
        assert!(message.contains("96 channels"), "{message}");
        let mut wrong_output = y;
        wrong_output.dims[2] = 26;
        let message = invalid_argument(error(ConvOp::Forward, (x, w, c, wrong_output)));
        assert!(
            message.starts_with("yDesc has dims [32, 256, 26, 27]"),
            "{message}"
        );
        let message = invalid_argument(error(ConvOp::Forward, (x, w, conv(0, 1, 9, 1), y)));
        assert!(
            message.contains("do not describe a valid convolution"),
            "{message}"
        );
        assert_eq!(descriptor_names(ConvOp::BackwardFilter)[1], "dwDesc");
    }
}
