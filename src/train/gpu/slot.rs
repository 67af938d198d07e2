//! A handle that its owner uses and another thread may take away: how a failing rank aborts
//! every NCCL communicator of its process (issue 18) without racing the owners' calls.
//!
//! The owner runs each call on the handle under the slot's lock ([`AbortSlot::with`]); an
//! abort from another thread ([`AbortSlot::take_within`]) takes the handle out under the same
//! lock, so it never frees a handle while a call on it runs, and the owner's next call finds
//! the slot empty (an error, not a use after free). A call on a communicator only queues work
//! on the stream and returns, so a rank waiting for a peer waits in a stream synchronisation,
//! outside the lock, where the abort reaches it; should an owner be stuck inside a call, the
//! abort gives up after a bounded wait instead of hanging (the process-level timeout remains).
//! Pure host logic, tested without a GPU.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// The handle, or nothing once it was taken (released by its owner, or aborted).
#[derive(Debug)]
pub(crate) struct AbortSlot<T> {
    value: Mutex<Option<T>>,
}

/// [`AbortSlot::take_within`] found the handle in use for longer than it may wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Busy;

impl<T> AbortSlot<T> {
    pub(crate) fn new(value: T) -> Arc<Self> {
        Arc::new(AbortSlot {
            value: Mutex::new(Some(value)),
        })
    }

    /// A poisoned lock (a panic during a call) still holds the handle: keep using it, so that
    /// it is released exactly once.
    fn lock(&self) -> MutexGuard<'_, Option<T>> {
        self.value.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `body` on the handle under the lock; `None` when it was taken.
    pub(crate) fn with<R>(&self, body: impl FnOnce(&T) -> R) -> Option<R> {
        self.lock().as_ref().map(body)
    }

    /// Takes the handle (the owner's release), waiting for the lock.
    pub(crate) fn take(&self) -> Option<T> {
        self.lock().take()
    }

    /// Takes the handle from another thread, waiting at most `wait` for a call in progress;
    /// `Ok(None)` when it was already taken.
    pub(crate) fn take_within(&self, wait: Duration) -> Result<Option<T>, Busy> {
        let deadline = Instant::now() + wait;
        loop {
            match self.value.try_lock() {
                Ok(mut guard) => return Ok(guard.take()),
                Err(TryLockError::Poisoned(poisoned)) => return Ok(poisoned.into_inner().take()),
                Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return Err(Busy),
                Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_taken_handle_is_gone_for_every_later_call() {
        let slot = AbortSlot::new(7);
        assert_eq!(slot.with(|v| v + 1), Some(8));
        assert_eq!(slot.take_within(Duration::ZERO), Ok(Some(7)));
        assert_eq!(slot.with(|v| v + 1), None);
        assert_eq!(slot.take_within(Duration::ZERO), Ok(None));
        assert_eq!(slot.take(), None);
    }

    #[test]
    fn an_abort_waits_for_a_call_in_progress_but_not_forever() {
        let slot = AbortSlot::new("comm");
        let (entered, inside) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let slot = &slot;
            let owner = scope.spawn(move || {
                slot.with(|_| {
                    entered.send(()).unwrap();
                    released.recv().unwrap();
                })
            });
            inside.recv().unwrap();
            // The owner is inside a call: a bounded abort gives up instead of hanging.
            assert_eq!(slot.take_within(Duration::from_millis(20)), Err(Busy));
            release.send(()).unwrap();
            assert_eq!(owner.join().unwrap(), Some(()));
        });
        // Once the call returned, the abort takes the handle, exactly once.
        assert_eq!(slot.take_within(Duration::from_secs(5)), Ok(Some("comm")));
        assert_eq!(slot.take(), None);
    }

    #[test]
    fn a_panic_during_a_call_does_not_lose_the_handle() {
        let slot = AbortSlot::new(1);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            slot.with(|_| panic!("inside a call"))
        }));
        assert!(caught.is_err());
        assert_eq!(slot.take_within(Duration::ZERO), Ok(Some(1)));
    }
}
