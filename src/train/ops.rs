//! The host kernels of the non-convolution layers, forward and backward: ReLU, 2x2 max-pool,
//! a linear (fully connected) layer, and softmax cross-entropy. Plain loops over NCHW slices;
//! next to the convolutions they are a small part of a step. The GPU replica does the same with
//! cuDNN and cuBLAS, so these are also its reference.

/// `x = max(x, 0)` in place.
pub fn relu(x: &mut [f32]) {
    for v in x {
        *v = v.max(0.0);
    }
}

/// ReLU's backward in place: `dy` becomes zero where the ReLU's output `y` is not positive.
pub fn relu_backward(y: &[f32], dy: &mut [f32]) {
    // Written as a select (not a conditional store) so it vectorises.
    for (g, &out) in dy.iter_mut().zip(y) {
        *g = if out > 0.0 { *g } else { 0.0 };
    }
}

/// 2x2 max-pool, stride 2, over `x = [n, c, h, w]` (odd sizes rounded down). Returns the
/// pooled values and, for each, the index in `x` of the maximum (the first one on ties).
pub fn max_pool2x2(x: &[f32], dims: [usize; 4]) -> (Vec<f32>, Vec<u32>) {
    let [n, c, h, w] = dims;
    let (ph, pw) = (h / 2, w / 2);
    let mut out = vec![0.0; n * c * ph * pw];
    let mut argmax = vec![0u32; n * c * ph * pw];
    if ph == 0 || pw == 0 {
        return (out, argmax);
    }
    let rows = out.chunks_exact_mut(pw).zip(argmax.chunks_exact_mut(pw));
    for (index, (out_row, arg_row)) in rows.enumerate() {
        let (plane, row) = (index / ph, index % ph);
        let top_start = plane * h * w + 2 * row * w;
        let top = &x[top_start..top_start + 2 * pw];
        let bottom = &x[top_start + w..top_start + w + 2 * pw];
        for (col, (value, arg)) in out_row.iter_mut().zip(arg_row.iter_mut()).enumerate() {
            let candidates = [
                (top[2 * col], 0),
                (top[2 * col + 1], 1),
                (bottom[2 * col], w),
                (bottom[2 * col + 1], w + 1),
            ];
            let mut best = candidates[0];
            for candidate in &candidates[1..] {
                if candidate.0 > best.0 {
                    best = *candidate;
                }
            }
            *value = best.0;
            *arg = (top_start + 2 * col + best.1) as u32;
        }
    }
    (out, argmax)
}

/// Max-pool's backward: each output gradient goes to the input position that won.
pub fn max_pool2x2_backward(d_out: &[f32], argmax: &[u32], input_len: usize) -> Vec<f32> {
    let mut dx = vec![0.0; input_len];
    for (&g, &index) in d_out.iter().zip(argmax) {
        dx[index as usize] += g;
    }
    dx
}

/// `y = x W^T + b` for `x = [n, features]`, `W = [outputs, features]` row-major.
pub fn linear(x: &[f32], weight: &[f32], bias: &[f32], n: usize) -> Vec<f32> {
    let outputs = bias.len();
    let features = weight.len() / outputs.max(1);
    let mut y = Vec::with_capacity(n * outputs);
    for row in x.chunks_exact(features.max(1)).take(n) {
        for (w_row, &b) in weight.chunks_exact(features.max(1)).zip(bias) {
            let dot: f32 = row.iter().zip(w_row).map(|(a, b)| a * b).sum();
            y.push(dot + b);
        }
    }
    y
}

/// The linear layer's backward: `(dx, dW, db)` from its input `x` and output gradient `dy`.
pub fn linear_backward(
    x: &[f32],
    weight: &[f32],
    dy: &[f32],
    n: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let outputs = dy.len().checked_div(n).unwrap_or(0);
    let features = x.len().checked_div(n).unwrap_or(0);
    let mut dx = vec![0.0; n * features];
    let mut dw = vec![0.0; weight.len()];
    let mut db = vec![0.0; outputs];
    if features == 0 || outputs == 0 {
        return (dx, dw, db);
    }
    let rows = x
        .chunks_exact(features)
        .zip(dx.chunks_exact_mut(features))
        .zip(dy.chunks_exact(outputs));
    for ((x_row, dx_row), dy_row) in rows {
        let weights = weight
            .chunks_exact(features)
            .zip(dw.chunks_exact_mut(features));
        for (((w_row, dw_row), &g), db_k) in weights.zip(dy_row).zip(db.iter_mut()) {
            *db_k += g;
            for (((dw_f, &x_f), dx_f), &w_f) in dw_row
                .iter_mut()
                .zip(x_row)
                .zip(dx_row.iter_mut())
                .zip(w_row)
            {
                *dw_f += g * x_f;
                *dx_f += g * w_f;
            }
        }
    }
    (dx, dw, db)
}

/// Softmax cross-entropy over `logits = [n, classes]`: returns the summed loss, the number of
/// rows whose arg-max (the first on ties) is the label, and the gradient of the summed loss
/// with respect to the logits (`softmax - one_hot`). Labels must be below `classes`.
pub fn softmax_cross_entropy(
    logits: &[f32],
    labels: &[u32],
    classes: usize,
) -> (f64, usize, Vec<f32>) {
    let mut loss = 0.0f64;
    let mut correct = 0;
    let mut grad = vec![0.0f32; logits.len()];
    for ((row, &label), g_row) in logits
        .chunks_exact(classes)
        .zip(labels)
        .zip(grad.chunks_exact_mut(classes))
    {
        let label = label as usize;
        let mut best = 0;
        for (k, &z) in row.iter().enumerate() {
            if z > row[best] {
                best = k;
            }
        }
        correct += usize::from(best == label);
        let max = f64::from(row[best]);
        let sum: f64 = row.iter().map(|&z| (f64::from(z) - max).exp()).sum();
        let log_sum = max + sum.ln();
        loss += log_sum - f64::from(row[label]);
        for (k, (g, &z)) in g_row.iter_mut().zip(row).enumerate() {
            let p = (f64::from(z) - log_sum).exp();
            *g = (p - if k == label { 1.0 } else { 0.0 }) as f32;
        }
    }
    (loss, correct, grad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_picks_the_maximum_and_routes_the_gradient_back() {
        // One 1x1x3x5 plane: odd sizes drop the last row and column.
        #[rustfmt::skip]
        let x = [
            1.0, 5.0, 2.0, 2.0, 9.0,
            3.0, 4.0, 7.0, 2.0, 9.0,
            9.0, 9.0, 9.0, 9.0, 9.0,
        ];
        let (out, argmax) = max_pool2x2(&x, [1, 1, 3, 5]);
        assert_eq!(out, [5.0, 7.0]);
        assert_eq!(argmax, [1, 7]);
        let dx = max_pool2x2_backward(&[10.0, 20.0], &argmax, x.len());
        let mut expected = [0.0; 15];
        expected[1] = 10.0;
        expected[7] = 20.0;
        assert_eq!(dx, expected);
    }

    #[test]
    fn relu_and_its_backward() {
        let mut y = [-1.0, 0.0, 2.0];
        relu(&mut y);
        assert_eq!(y, [0.0, 0.0, 2.0]);
        let mut dy = [1.0, 1.0, 1.0];
        relu_backward(&y, &mut dy);
        assert_eq!(dy, [0.0, 0.0, 1.0]);
    }

    #[test]
    fn linear_forward_and_backward_by_hand() {
        // x = [[1, 2]], W = [[1, 0], [2, -1], [0, 3]], b = [0.5, 0, -1].
        let x = [1.0, 2.0];
        let w = [1.0, 0.0, 2.0, -1.0, 0.0, 3.0];
        let y = linear(&x, &w, &[0.5, 0.0, -1.0], 1);
        assert_eq!(y, [1.5, 0.0, 5.0]);
        let (dx, dw, db) = linear_backward(&x, &w, &[1.0, 2.0, 3.0], 1);
        assert_eq!(dx, [1.0 + 4.0, -2.0 + 9.0]);
        assert_eq!(dw, [1.0, 2.0, 2.0, 4.0, 3.0, 6.0]);
        assert_eq!(db, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_classes() {
        let (loss, correct, grad) = softmax_cross_entropy(&[0.0; 8], &[0, 3], 4);
        assert!((loss - 2.0 * 4f64.ln()).abs() < 1e-12);
        assert_eq!(correct, 1); // ties go to class 0: row 0 is right, row 1 is not
        assert_eq!(grad[0], 0.25 - 1.0);
        assert_eq!(grad[4 + 3], 0.25 - 1.0);
        assert!((grad.iter().sum::<f32>()).abs() < 1e-6);
        // Large logits do not overflow.
        let (loss, _, grad) = softmax_cross_entropy(&[1000.0, 0.0], &[1], 2);
        assert!((loss - 1000.0).abs() < 1e-9 && grad.iter().all(|g| g.is_finite()));
    }
}
