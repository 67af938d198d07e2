//! A call's operands grouped by role, one type for every backend and executor.

/// The operands of one convolution call by role, as cudarc's `ConvForward { conv, x, w, y }`
/// groups a call's arguments (the descriptors by role are the cuDNN wall's `ConvDescriptors`
/// or an `EnginePlan`, the CPU's a `ConvProblem`); `out = alpha * op(a, b) + beta * out`:
///
/// | op | a | b | out |
/// |---|---|---|---|
/// | forward | x | w | y |
/// | backward-data | w | dy | dx |
/// | backward-filter | x | dy | dw |
///
/// Generic over what the operands are: device views (the cuDNN wall's calls:
/// `cudnn::DeviceOperands`), device buffers (a prepared plan's full batch), host slices (the
/// CPU executor).
#[derive(Debug)]
pub struct ConvOperands<In, Out, Ws> {
    pub a: In,
    pub b: In,
    pub out: Out,
    pub workspace: Ws,
}
