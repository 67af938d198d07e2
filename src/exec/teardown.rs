//! When the cuDNN objects of a prepared plan may be destroyed.
//!
//! A plan run on a caller's stream (PyTorch's, candle's) queues kernels there and returns at
//! once; the plan's execution plans and descriptors must outlive those kernels. Waiting for
//! mucudnn's own stream says nothing about the caller's. So every call on a caller's stream
//! records a fence (a CUDA event) on that stream after its last micro-batch, one fence per
//! stream, re-recorded by later calls, and teardown waits for each fence before anything is
//! destroyed.
//!
//! A call on a stream that is being captured into a CUDA graph queues nothing: the graph holds
//! the kernels and their arguments and may replay them at any time, as often as its owner
//! likes, long after the plan set was released. No event can say when that ends (an event
//! recorded in a capture is a graph node, and waiting for one is an error), so a plan that ran
//! under capture is *parked*: never destroyed, its memory held until the process exits. The
//! same holds, conservatively, when a fence could not be recorded or waited for.
//!
//! This module is the decision alone, plain Rust over a [`Fence`] trait, so CI tests it with a
//! fake fence; the cuDNN wall provides the real one (`StreamFence`, a CUDA event) and the
//! capture query (`StreamSession::is_capturing`). Waiting happens only at teardown, never
//! during a call: the per-call cost is a capture query and an event record.

/// A marker of the work queued on one stream up to some point (a CUDA event; a fake in tests).
pub trait Fence {
    /// Blocks until the marked work has finished; an error leaves that unknown.
    fn wait(&self) -> Result<(), String>;
}

/// What teardown may do with a plan's cuDNN objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disposal {
    /// Every call's work has finished (or none was queued): destroy them.
    Destroy,
    /// Never destroy them (leak until the process exits): a captured graph may still run
    /// them, or it could not be established that their work finished.
    Park { reason: String },
}

/// At most this many streams keep a fence of their own; a call on yet another stream first
/// waits for the oldest fence and takes it over (a host wait, only in that unusual pattern).
pub const MAX_FENCED_STREAMS: usize = 64;

/// Where a plan's work may still be: the fences of the caller streams it ran on, and whether it
/// ever ran under capture. `K` identifies a stream, `F` is its fence.
#[derive(Debug)]
pub struct Teardown<K, F> {
    fences: Vec<(K, F)>,
    park: Option<String>,
}

impl<K, F> Default for Teardown<K, F> {
    fn default() -> Self {
        Teardown {
            fences: Vec::new(),
            park: None,
        }
    }
}

impl<K: PartialEq, F: Fence> Teardown<K, F> {
    /// The plan is about to run on a stream that is being captured: it must never be
    /// destroyed. Called before queueing anything, so a call that fails half-way is covered.
    pub fn captured(&mut self) {
        self.park
            .get_or_insert_with(|| "it ran on a stream captured into a CUDA graph".into());
    }

    /// A fence could not be recorded after work was queued: that work's end is unknown.
    pub fn lost(&mut self, why: &str) {
        self.park
            .get_or_insert_with(|| format!("a CUDA event could not be recorded ({why})"));
    }

    /// Whether teardown will park the plan whatever happens next.
    pub fn is_parked(&self) -> bool {
        self.park.is_some()
    }

    /// The fence of stream `key`, to be recorded after queueing work there: the stream's own
    /// if it has one, else a new one from `make`. Beyond [`MAX_FENCED_STREAMS`] streams, the
    /// oldest stream's fence is waited for and taken over.
    pub fn fence_for<E>(
        &mut self,
        key: K,
        make: impl FnOnce() -> Result<F, E>,
    ) -> Result<&mut F, E> {
        if let Some(at) = self.fences.iter().position(|(k, _)| *k == key) {
            return Ok(&mut self.fences[at].1);
        }
        if self.fences.len() >= MAX_FENCED_STREAMS {
            let (_, oldest) = self.fences.remove(0);
            match oldest.wait() {
                Ok(()) => {
                    self.fences.push((key, oldest));
                    return Ok(&mut self.fences.last_mut().expect("just pushed").1);
                }
                Err(e) => {
                    self.lost(&e);
                    // The fence is dropped (a CUDA event may be destroyed while pending).
                }
            }
        }
        let fence = make()?;
        self.fences.push((key, fence));
        Ok(&mut self.fences.last_mut().expect("just pushed").1)
    }

    /// Number of streams with a fence.
    pub fn fenced_streams(&self) -> usize {
        self.fences.len()
    }

    /// Decides at teardown: park if the plan ever ran under capture or lost track of its work,
    /// else wait for every stream's fence (each once) and destroy; a failed wait parks.
    pub fn dispose(&mut self) -> Disposal {
        if let Some(reason) = &self.park {
            return Disposal::Park {
                reason: reason.clone(),
            };
        }
        for (_, fence) in &self.fences {
            if let Err(e) = fence.wait() {
                return Disposal::Park {
                    reason: format!("waiting for its last call's CUDA event failed ({e})"),
                };
            }
        }
        Disposal::Destroy
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// A fence that logs its waits into a shared journal and fails when told to.
    struct FakeFence {
        id: usize,
        fail: bool,
        journal: Rc<RefCell<Vec<usize>>>,
    }

    impl Fence for FakeFence {
        fn wait(&self) -> Result<(), String> {
            self.journal.borrow_mut().push(self.id);
            if self.fail {
                Err("CUDA_ERROR_LAUNCH_FAILED".into())
            } else {
                Ok(())
            }
        }
    }

    struct Bench {
        journal: Rc<RefCell<Vec<usize>>>,
        made: usize,
        teardown: Teardown<u64, FakeFence>,
    }

    impl Bench {
        fn new() -> Self {
            Bench {
                journal: Rc::default(),
                made: 0,
                teardown: Teardown::default(),
            }
        }

        /// A call on `stream` that is not captured: returns the id of the fence recorded.
        fn call(&mut self, stream: u64, fail: bool) -> usize {
            let id = self.made;
            let journal = self.journal.clone();
            let made = &mut self.made;
            let fence = self
                .teardown
                .fence_for(stream, || {
                    *made += 1;
                    Ok::<_, String>(FakeFence { id, fail, journal })
                })
                .unwrap();
            fence.id
        }

        fn waits(&self) -> Vec<usize> {
            self.journal.borrow().clone()
        }
    }

    #[test]
    fn a_plan_never_run_is_destroyed_without_waiting() {
        let mut b = Bench::new();
        assert_eq!(b.teardown.dispose(), Disposal::Destroy);
        assert!(b.waits().is_empty());
    }

    #[test]
    fn teardown_waits_for_the_fence_of_every_stream_once() {
        let mut b = Bench::new();
        // Streams 7 and 9 (PyTorch's current stream, a side stream), then 7 again: the same
        // fence is re-recorded, not a new one made.
        assert_eq!(b.call(7, false), 0);
        assert_eq!(b.call(9, false), 1);
        assert_eq!(b.call(7, false), 0);
        assert_eq!(b.made, 2);
        assert_eq!(b.teardown.fenced_streams(), 2);
        // Nothing waited during calls.
        assert!(b.waits().is_empty());
        assert_eq!(b.teardown.dispose(), Disposal::Destroy);
        assert_eq!(b.waits(), vec![0, 1]);
    }

    #[test]
    fn a_plan_run_under_capture_is_parked_for_good() {
        let mut b = Bench::new();
        b.call(7, false);
        b.teardown.captured();
        // Later ordinary calls (the graph is replayed, eager steps run) do not undo it.
        b.call(7, false);
        b.call(9, false);
        assert!(b.teardown.is_parked());
        match b.teardown.dispose() {
            Disposal::Park { reason } => assert!(reason.contains("CUDA graph"), "{reason}"),
            other => panic!("{other:?}"),
        }
        // Parking waits for nothing (waiting during another thread's capture is unsafe).
        assert!(b.waits().is_empty());
    }

    #[test]
    fn a_failed_wait_or_a_lost_record_parks() {
        let mut b = Bench::new();
        b.call(7, false);
        b.call(9, true);
        match b.teardown.dispose() {
            Disposal::Park { reason } => {
                assert!(reason.contains("CUDA_ERROR_LAUNCH_FAILED"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let mut b = Bench::new();
        b.call(7, false);
        b.teardown.lost("CUDA_ERROR_INVALID_HANDLE");
        assert!(matches!(b.teardown.dispose(), Disposal::Park { .. }));
        assert!(b.waits().is_empty());
    }

    #[test]
    fn streams_beyond_the_cap_take_over_the_oldest_fence_after_waiting() {
        let mut b = Bench::new();
        for stream in 0..MAX_FENCED_STREAMS as u64 {
            b.call(stream, false);
        }
        assert!(b.waits().is_empty());
        // One more stream: fence 0 (stream 0's) is waited for and now serves the new stream.
        assert_eq!(b.call(1000, false), 0);
        assert_eq!(b.waits(), vec![0]);
        assert_eq!(b.made, MAX_FENCED_STREAMS);
        assert_eq!(b.teardown.fenced_streams(), MAX_FENCED_STREAMS);
        // Stream 0 again gets a fence of its own (stream 1's, the oldest now, after a wait).
        assert_eq!(b.call(0, false), 1);
        assert_eq!(b.waits(), vec![0, 1]);
        assert_eq!(b.teardown.dispose(), Disposal::Destroy);
        assert_eq!(b.waits().len(), 2 + MAX_FENCED_STREAMS);
    }
}
