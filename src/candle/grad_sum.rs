//! How a data-parallel candle job sums its gradients (feature `candle`): the parts that do not
//! need a GPU, shared by the host sum ([`super::ddp::sum_in_rank_order`]) and the NCCL sum on
//! candle's CUDA stream (`super::nccl`, feature `candle-cuda`).
//!
//! - [`GradSum`]: which sum a job uses (`--grad-sum host|nccl` of `examples/candle_ddp.rs`):
//!   NCCL by default on CUDA devices, the host everywhere else.
//! - [`pack`] and [`unpack`]: a model's gradient tensors as one flat f32 vector on their
//!   device (one all-reduce instead of one per tensor), and back to the parameters' shapes
//!   and dtypes. A parameter without a gradient contributes zeros.
//! - [`scale_as_host`]: a summed f32 vector times `scale`, taken in f64 and rounded to f32
//!   once, as the host sum scales.
//! - [`watch`] and [`next_step`]: waiting on an asynchronous communicator (NCCL's
//!   non-blocking one) without hanging: poll its state and the work's completion until both
//!   are done; a failed state, a failed poll or no completion within the timeout is an abort
//!   (the caller then aborts the communicator, and the job ends: `MPI_Abort`).

use candle_core::{DType, Tensor};
use std::time::{Duration, Instant};

/// Where the ranks sum their gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradSum {
    /// Copied to the host and summed over the job's [`super::ddp::Collective`] in f64 in rank
    /// order ([`super::ddp::sum_in_rank_order`]): bitwise reproducible for any process count.
    Host,
    /// An NCCL all-reduce (f32 sum) on candle's CUDA stream (`mucudnn::candle::nccl`, feature
    /// `candle-cuda`): every rank gets the same bits, but the summation order is NCCL's.
    Nccl,
}

impl GradSum {
    /// The option's text: `host` or `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            GradSum::Host => "host",
            GradSum::Nccl => "nccl",
        }
    }

    /// `host` or `nccl`.
    pub fn parse(text: &str) -> Result<GradSum, String> {
        match text {
            "host" => Ok(GradSum::Host),
            "nccl" => Ok(GradSum::Nccl),
            other => Err(format!("--grad-sum host or nccl, not {other:?}")),
        }
    }

    /// The sum a job uses: the one asked for, else NCCL on CUDA devices (one rank per process,
    /// a build with NCCL) and the host otherwise. NCCL needs a CUDA device, a build with NCCL (`nccl_built`: feature `candle-cuda`)
    /// and one rank per process (`local_ranks` 1: NCCL sums processes, not the shards one
    /// process computes in turn).
    pub fn resolve(
        requested: Option<GradSum>,
        cuda: bool,
        nccl_built: bool,
        local_ranks: usize,
    ) -> Result<GradSum, String> {
        let chosen = requested.unwrap_or(if cuda && nccl_built && local_ranks == 1 {
            GradSum::Nccl
        } else {
            GradSum::Host
        });
        if chosen == GradSum::Nccl {
            if !cuda {
                return Err("--grad-sum nccl needs --device cuda".into());
            }
            if !nccl_built {
                return Err("--grad-sum nccl needs a build with feature candle-cuda".into());
            }
            if local_ranks != 1 {
                return Err(format!(
                    "--grad-sum nccl takes one rank per process, not --local-ranks {local_ranks} \
                     (use --grad-sum host)"
                ));
            }
        }
        Ok(chosen)
    }
}

/// The gradients of `params` (from `grad`, e.g. a `GradStore`'s `get`) as one flat f32 vector
/// on the parameters' device, in `params` order; zeros for a parameter without a gradient.
/// `params` must not be empty.
pub fn pack<'a>(
    params: &[Tensor],
    grad: impl Fn(&Tensor) -> Option<&'a Tensor>,
) -> candle_core::Result<Tensor> {
    let first = params
        .first()
        .ok_or_else(|| candle_core::Error::Msg("no parameters to pack".into()))?;
    let mut parts = Vec::with_capacity(params.len());
    for param in params {
        let part = match grad(param) {
            Some(g) => {
                if g.shape() != param.shape() {
                    return Err(candle_core::Error::Msg(format!(
                        "a gradient of shape {:?} for a parameter of shape {:?}",
                        g.dims(),
                        param.dims()
                    )));
                }
                g.flatten_all()?.to_dtype(DType::F32)?
            }
            None => Tensor::zeros(param.elem_count(), DType::F32, param.device())?,
        };
        parts.push(part);
    }
    if parts
        .iter()
        .any(|p| !p.device().same_device(first.device()))
    {
        return Err(candle_core::Error::Msg(
            "the gradients are on more than one device".into(),
        ));
    }
    Tensor::cat(&parts, 0)
}

/// A flat vector of [`pack`]'s layout cut back into one tensor per parameter, each of its
/// parameter's shape and dtype (views of `flat` where no conversion is needed).
pub fn unpack(flat: &Tensor, params: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
    let total: usize = params.iter().map(Tensor::elem_count).sum();
    if flat.dims() != [total] {
        return Err(candle_core::Error::Msg(format!(
            "a flat gradient of shape {:?} for {total} parameter elements",
            flat.dims()
        )));
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(params.len());
    for param in params {
        let n = param.elem_count();
        out.push(
            flat.narrow(0, at, n)?
                .reshape(param.shape())?
                .to_dtype(param.dtype())?,
        );
        at += n;
    }
    Ok(out)
}

/// `sum * scale` computed in f64 and rounded to f32 once (as [`super::ddp::sum_in_rank_order`]
/// scales its f64 sum), on `sum`'s device; `sum` is f32.
pub fn scale_as_host(sum: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    if sum.dtype() != DType::F32 {
        return Err(candle_core::Error::Msg(format!(
            "a gradient sum of {:?}; f32 expected",
            sum.dtype()
        )));
    }
    (sum.to_dtype(DType::F64)? * scale)?.to_dtype(DType::F32)
}

/// An asynchronous communicator's state, as one poll sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommState {
    /// No error and nothing in progress (NCCL: `ncclSuccess`).
    Ready,
    /// Still working on the last call (NCCL: `ncclInProgress`).
    InProgress,
    /// Failed (NCCL: any other result, or a peer's error), with what it said.
    Failed(String),
}

/// What to do after a poll.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The communicator is ready and the work done.
    Done,
    /// Poll again.
    Poll,
    /// Give up: abort the communicator (and the job), for this reason.
    Abort(String),
}

/// The decision after a poll that found `state`, with the awaited work `done` or not, having
/// waited `waited` of `timeout`: a failure aborts at once; ready and done is done; anything
/// else polls again until the timeout, then aborts.
pub fn next_step(state: &CommState, done: bool, waited: Duration, timeout: Duration) -> Next {
    match state {
        CommState::Failed(reason) => Next::Abort(reason.clone()),
        CommState::Ready if done => Next::Done,
        _ if waited >= timeout => Next::Abort(format!(
            "{} after {:.1} s (the timeout): a peer may have failed or stalled",
            match state {
                CommState::InProgress => "still in progress",
                _ => "not complete",
            },
            waited.as_secs_f64()
        )),
        _ => Next::Poll,
    }
}

/// Polls `poll` (the communicator's state, and whether the awaited work is done) until
/// [`next_step`] says done (`Ok`) or abort (`Err`, with `what` and the reason; a poll's own
/// error is an abort too). Yields the thread between polls, then sleeps briefly once the wait
/// passes a millisecond.
pub fn watch(
    what: &str,
    timeout: Duration,
    mut poll: impl FnMut() -> Result<(CommState, bool), String>,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let (state, done) = poll().map_err(|e| format!("{what}: {e}"))?;
        let waited = started.elapsed();
        match next_step(&state, done, waited, timeout) {
            Next::Done => return Ok(()),
            Next::Abort(reason) => return Err(format!("{what}: {reason}")),
            Next::Poll if waited < Duration::from_millis(1) => std::thread::yield_now(),
            Next::Poll => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candle::ddp::{sum_in_rank_order, SingleProcess};
    use candle_core::Device;
    use std::collections::HashMap;

    #[test]
    fn the_sum_is_nccl_on_cuda_and_the_host_elsewhere() {
        assert_eq!(GradSum::parse("host"), Ok(GradSum::Host));
        assert_eq!(GradSum::parse("nccl"), Ok(GradSum::Nccl));
        assert!(GradSum::parse("mpi").unwrap_err().contains("\"mpi\""));
        assert_eq!(GradSum::Nccl.name(), "nccl");
        assert_eq!(GradSum::resolve(None, true, true, 1), Ok(GradSum::Nccl));
        assert_eq!(GradSum::resolve(None, false, true, 1), Ok(GradSum::Host));
        // A build without NCCL defaults to the host sum on CUDA too.
        assert_eq!(GradSum::resolve(None, true, false, 1), Ok(GradSum::Host));
        // The host sum is always allowed, with any number of local ranks.
        assert_eq!(
            GradSum::resolve(Some(GradSum::Host), true, true, 3),
            Ok(GradSum::Host)
        );
        // Several local ranks: the default is the host sum; asking for NCCL is an error.
        assert_eq!(GradSum::resolve(None, true, true, 2), Ok(GradSum::Host));
        let cpu = GradSum::resolve(Some(GradSum::Nccl), false, true, 1).unwrap_err();
        assert!(cpu.contains("--device cuda"), "{cpu}");
        let unbuilt = GradSum::resolve(Some(GradSum::Nccl), true, false, 1).unwrap_err();
        assert!(unbuilt.contains("candle-cuda"), "{unbuilt}");
        let local = GradSum::resolve(Some(GradSum::Nccl), true, true, 2).unwrap_err();
        assert!(local.contains("--local-ranks 2"), "{local}");
    }

    fn params() -> Vec<Tensor> {
        let d = &Device::Cpu;
        vec![
            Tensor::zeros((2, 3), DType::F32, d).unwrap(),
            Tensor::zeros(4, DType::F32, d).unwrap(),
            Tensor::zeros((1, 2, 1, 1), DType::F32, d).unwrap(),
        ]
    }

    #[test]
    fn gradients_pack_into_one_vector_and_unpack_to_their_shapes() {
        let params = params();
        let d = &Device::Cpu;
        let g0 = Tensor::arange(0f32, 6.0, d)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        // A transposed (strided) gradient packs in its logical order.
        let g2 = Tensor::new(&[[[[7f32]], [[8f32]]]], d).unwrap();
        let g0_t = g0.t().unwrap().contiguous().unwrap().t().unwrap();
        assert!(!g0_t.is_contiguous());
        let grads: HashMap<usize, Tensor> = [(0, g0_t), (2, g2.clone())].into_iter().collect();
        let lookup = |p: &Tensor| {
            let index = params.iter().position(|q| q.id() == p.id())?;
            grads.get(&index)
        };
        let flat = pack(&params, lookup).unwrap();
        // The second parameter has no gradient: zeros.
        assert_eq!(
            flat.to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 3., 4., 5., 0., 0., 0., 0., 7., 8.]
        );
        let back = unpack(&flat, &params).unwrap();
        assert_eq!(back.len(), 3);
        for (b, p) in back.iter().zip(&params) {
            assert_eq!(b.dims(), p.dims());
            assert_eq!(b.dtype(), p.dtype());
        }
        assert_eq!(
            back[0].to_vec2::<f32>().unwrap(),
            g0.to_vec2::<f32>().unwrap()
        );
        assert_eq!(back[1].to_vec1::<f32>().unwrap(), vec![0f32; 4]);
        assert_eq!(
            back[2].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![7f32, 8.]
        );
        // Errors, not panics: a wrong length, a gradient of the wrong shape, no parameters.
        let short = flat.narrow(0, 0, 11).unwrap();
        assert!(unpack(&short, &params).is_err());
        let wrong = Tensor::zeros(6, DType::F32, d).unwrap();
        assert!(pack(&params, |_| Some(&wrong)).is_err());
        assert!(pack(&[], |_| None).is_err());
    }

    #[test]
    fn a_parameter_of_another_dtype_gets_its_gradient_back_in_its_dtype() {
        let d = &Device::Cpu;
        let params = vec![Tensor::zeros(3, DType::BF16, d).unwrap()];
        let g = Tensor::new(&[1.5f32, -2.0, 0.25], d)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let flat = pack(&params, |_| Some(&g)).unwrap();
        assert_eq!(flat.dtype(), DType::F32);
        let back = unpack(&flat, &params).unwrap();
        assert_eq!(back[0].dtype(), DType::BF16);
        assert_eq!(
            back[0]
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![1.5, -2.0, 0.25]
        );
    }

    #[test]
    fn scaling_rounds_as_the_host_sum_does() {
        // Values whose f32 product with an f32 scale differs from the f64 product rounded once.
        let values: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 0.001_37).collect();
        let scale = 1.0 / 96.0;
        let host = sum_in_rank_order(
            &mut SingleProcess,
            std::slice::from_ref(&values),
            1000,
            scale,
        )
        .unwrap();
        let device = scale_as_host(
            &Tensor::new(values.as_slice(), &Device::Cpu).unwrap(),
            scale,
        )
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        assert_eq!(
            device.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            host.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let single: Vec<f32> = values.iter().map(|&x| x * scale as f32).collect();
        assert_ne!(
            single, device,
            "the test's values do not tell the roundings apart"
        );
        let f16 = Tensor::new(&[1f32], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap();
        assert!(scale_as_host(&f16, 0.5).is_err());
    }

    #[test]
    fn a_failure_aborts_at_once_and_progress_waits_until_the_timeout() {
        let second = Duration::from_secs(1);
        let zero = Duration::ZERO;
        assert_eq!(next_step(&CommState::Ready, true, zero, second), Next::Done);
        // Done although the timeout passed: the work finished.
        assert_eq!(
            next_step(&CommState::Ready, true, 2 * second, second),
            Next::Done
        );
        assert_eq!(
            next_step(&CommState::InProgress, false, zero, second),
            Next::Poll
        );
        // The communicator is ready but the stream's work has not finished.
        assert_eq!(
            next_step(&CommState::Ready, false, zero, second),
            Next::Poll
        );
        assert_eq!(
            next_step(&CommState::InProgress, true, zero, second),
            Next::Poll
        );
        assert_eq!(
            next_step(
                &CommState::Failed("remote error".into()),
                false,
                zero,
                second
            ),
            Next::Abort("remote error".into())
        );
        match next_step(&CommState::InProgress, false, second, second) {
            Next::Abort(reason) => assert!(reason.contains("still in progress"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match next_step(&CommState::Ready, false, 3 * second, second) {
            Next::Abort(reason) => assert!(reason.contains("not complete"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn watching_ends_on_completion_on_failure_and_on_timeout() {
        let long = Duration::from_secs(60);
        // In progress twice, then ready but the work pending, then done.
        let mut states = vec![
            (CommState::Ready, true),
            (CommState::Ready, false),
            (CommState::InProgress, false),
            (CommState::InProgress, false),
        ];
        let mut polls = 0;
        watch("all-reduce", long, || {
            polls += 1;
            Ok(states.pop().unwrap())
        })
        .unwrap();
        assert_eq!(polls, 4);

        let mut states = vec![
            (CommState::Failed("ncclRemoteError".into()), false),
            (CommState::InProgress, false),
        ];
        let failed = watch("all-reduce", long, || Ok(states.pop().unwrap())).unwrap_err();
        assert_eq!(failed, "all-reduce: ncclRemoteError");

        let polled = watch("init", long, || Err("cuEventQuery failed".to_string()));
        assert_eq!(polled.unwrap_err(), "init: cuEventQuery failed");

        // A peer that never arrives: aborted after the timeout, not a hang.
        let started = Instant::now();
        let stalled = watch("all-reduce", Duration::from_millis(30), || {
            Ok((CommState::InProgress, false))
        })
        .unwrap_err();
        let took = started.elapsed();
        assert!(
            stalled.starts_with("all-reduce: still in progress"),
            "{stalled}"
        );
        assert!(took >= Duration::from_millis(30) && took < Duration::from_secs(10));
    }
}
