//! From a caller's cuDNN descriptors to a [`ConvProblem`]: the shapes, dtype, layout, math mode
//! and convolution parameters a call describes, and whether mucudnn can run it.
//!
//! Pure: the FFI wall reads the descriptors (`read_*_descriptor`), this module checks what they
//! say. Activations must be fully packed NCHW or NHWC (the batch outermost, so that a
//! micro-batch is a pointer offset), the filter in the same layout, one dtype throughout,
//! float accumulation and cross-correlation: what [`ConvProblem`] models. Anything else is
//! [`FfiError::NotSupported`] (cuDNN could run it, mucudnn does not) or
//! [`FfiError::InvalidArgument`] (the descriptors do not make one convolution).

use super::error::{invalid, FfiError};
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

/// The element strides of a fully packed `[n, c, h, w]` tensor in `layout`.
fn packed_strides(dims: [i32; 4], layout: Layout) -> [i64; 4] {
    let [_, c, h, w] = dims.map(i64::from);
    match layout {
        Layout::Nchw => [c * h * w, h * w, w, 1],
        Layout::Nhwc => [h * w * c, 1, w * c, c],
    }
}

/// Whether `info` is fully packed in `layout` (strides of size-1 dimensions do not matter).
fn packed_in(info: &TensorDescriptorInfo, layout: Layout) -> bool {
    let expected = packed_strides(info.dims, layout);
    (0..4).all(|i| info.dims[i] <= 1 || i64::from(info.strides[i]) == expected[i])
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
        "is not a fully packed NCHW or NHWC tensor".to_string()
    };
    Err(FfiError::NotSupported(format!(
        "{name} (dims {:?}, strides {:?}) {how}: mucudnn needs activations and filters packed in \
         one layout (NCHW or NHWC), so that a micro-batch is a pointer offset",
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
    let [n, c, h, w] = input.dims.map(i64::from);
    let [k, c_per_group, r, s] = filter.dims.map(i64::from);
    let groups = i64::from(conv.groups);
    if groups < 1 || c_per_group * groups != c {
        return Err(invalid(format!(
            "{input_name} has {c} channels, but {filter_name} has {c_per_group} per group and \
             {conv_name} {groups} group(s)"
        )));
    }
    let problem = ConvProblem {
        pad_h: i64::from(conv.pad[0]),
        pad_w: i64::from(conv.pad[1]),
        stride_h: i64::from(conv.stride[0]),
        stride_w: i64::from(conv.stride[1]),
        dilation_h: i64::from(conv.dilation[0]),
        dilation_w: i64::from(conv.dilation[1]),
        groups,
        dtype,
        layout,
        math,
        ..ConvProblem::new(n, c, h, w, k, r, s)
    };
    problem.validate().map_err(|e| {
        invalid(format!(
            "{input_name}, {filter_name} and {conv_name} do not describe a valid convolution: {e}"
        ))
    })?;
    let (p, q) = problem.output_hw();
    let expected = [n, k, p, q];
    if output.dims.map(i64::from) != expected {
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
    use crate::solver::MathMode;

    fn tensor(dtype: DType, layout: Layout, dims: [i32; 4]) -> TensorDescriptorInfo {
        let strides = packed_strides(dims, layout).map(|s| s as i32);
        TensorDescriptorInfo {
            data_type: DataTypeCode::of(dtype),
            dims,
            strides,
        }
    }

    fn filter(dtype: DType, layout: Layout, dims: [i32; 4]) -> FilterDescriptorInfo {
        FilterDescriptorInfo {
            data_type: DataTypeCode::of(dtype),
            layout: Some(layout),
            format_code: match layout {
                Layout::Nchw => 0,
                Layout::Nhwc => 1,
            },
            dims,
        }
    }

    fn conv(pad: i32, stride: i32, dilation: i32, groups: i32) -> ConvolutionDescriptorInfo {
        ConvolutionDescriptorInfo {
            pad: [pad, pad],
            stride: [stride, stride],
            dilation: [dilation, dilation],
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
            tensor(DType::Fp32, layout, [32, 96, 27, 27]),
            filter(DType::Fp32, layout, [256, 96, 5, 5]),
            conv(2, 1, 1, 1),
            tensor(DType::Fp32, layout, [32, 256, 27, 27]),
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
        let x = tensor(DType::Fp16, Layout::Nhwc, [8, 6, 9, 10]);
        let w = filter(DType::Fp16, Layout::Nhwc, [4, 3, 3, 3]);
        let c = ConvolutionDescriptorInfo {
            pad: [1, 2],
            stride: [2, 1],
            dilation: [1, 2],
            math: Some(MathMode::TensorOp),
            math_code: 1,
            ..conv(0, 1, 1, 2)
        };
        let y = tensor(DType::Fp16, Layout::Nhwc, [8, 4, 5, 10]);
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

    #[test]
    fn size_one_dimensions_take_any_stride() {
        // One input channel: PyTorch describes it with NCHW strides even for channels_last.
        let mut x = tensor(DType::Fp32, Layout::Nhwc, [4, 1, 8, 8]);
        x.strides = [64, 64, 8, 1];
        let w = filter(DType::Fp32, Layout::Nhwc, [2, 1, 3, 3]);
        let y = tensor(DType::Fp32, Layout::Nhwc, [4, 2, 6, 6]);
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
        strided.strides = [256 * 27 * 32, 27 * 32, 32, 1];
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
