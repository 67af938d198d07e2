//! The calling thread's current CUDA context, given back: every mucudnn call that binds a
//! device's context (to make a handle, prepare, run or destroy plans) runs inside a
//! [`SavedContext`], so a caller (PyTorch on `cuda:0` calling a layer on `cuda:1`, a C program
//! with a context of its own) finds its own context current afterwards, on the error paths
//! too.
//!
//! The save-and-restore logic is written over [`ContextSlot`] so that it is tested on the CPU
//! with a stand-in; [`DriverContext`] is the real slot (`cuCtxGetCurrent` / `cuCtxSetCurrent`).

use super::{driver, drv_err, CudnnError};
use cudarc::driver::sys as drv_sys;
use std::io::Write;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::ptr;

/// Where a thread's current context lives: the driver, or a test's stand-in.
pub trait ContextSlot {
    type Context: Copy;
    /// The context current on this thread (possibly none).
    fn current(&self) -> Result<Self::Context, CudnnError>;
    /// Makes `context` current on this thread.
    fn make_current(&self, context: Self::Context) -> Result<(), CudnnError>;
}

/// The CUDA driver's per-thread current context.
#[derive(Clone, Copy, Debug, Default)]
pub struct DriverContext;

impl ContextSlot for DriverContext {
    type Context = drv_sys::CUcontext;

    fn current(&self) -> Result<Self::Context, CudnnError> {
        driver()?;
        let mut saved = ptr::null_mut();
        // SAFETY: the driver gate has passed; one output pointer to a live local.
        unsafe { drv_sys::cuCtxGetCurrent(&mut saved) }
            .result()
            .map_err(drv_err("cuCtxGetCurrent"))?;
        Ok(saved)
    }

    fn make_current(&self, context: Self::Context) -> Result<(), CudnnError> {
        driver()?;
        // SAFETY: the driver gate has passed; `context` was current on this thread when it was
        // saved (or is null, which unbinds).
        unsafe { drv_sys::cuCtxSetCurrent(context) }
            .result()
            .map_err(drv_err("cuCtxSetCurrent"))
    }
}

/// Restores this thread's current context, as it was when the guard was made, when dropped.
pub struct SavedContext<S: ContextSlot = DriverContext> {
    slot: S,
    saved: S::Context,
}

/// The guard over the driver's current context.
pub type CurrentContextGuard = SavedContext<DriverContext>;

impl<S: ContextSlot> std::fmt::Debug for SavedContext<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedContext").finish_non_exhaustive()
    }
}

impl<S: ContextSlot> SavedContext<S> {
    /// Saves `slot`'s current context until the guard is dropped.
    pub fn save(slot: S) -> Result<Self, CudnnError> {
        let saved = slot.current()?;
        Ok(SavedContext { slot, saved })
    }
}

impl<S: ContextSlot> Drop for SavedContext<S> {
    fn drop(&mut self) {
        if let Err(e) = self.slot.make_current(self.saved) {
            let _ = writeln!(
                std::io::stderr(),
                "mucudnn: warning: restoring the caller's CUDA context failed: {e}"
            );
        }
    }
}

/// Saves this thread's current CUDA context (possibly none) until the guard is dropped.
pub fn save_current_context() -> Result<CurrentContextGuard, CudnnError> {
    SavedContext::save(DriverContext)
}

/// A value's last field, filled by its `Drop` with the caller's current context
/// ([`Self::save`]): the context is made current again when this field drops, after every
/// field before it (a cuDNN plan or handle, a cudarc stream, event or context binds its
/// device's context to be destroyed) is gone.
pub struct RestoreAfterFields<S: ContextSlot = DriverContext> {
    slot: S,
    saved: Option<SavedContext<S>>,
}

impl<S: ContextSlot + Default> Default for RestoreAfterFields<S> {
    fn default() -> Self {
        RestoreAfterFields {
            slot: S::default(),
            saved: None,
        }
    }
}

impl<S: ContextSlot + Clone> RestoreAfterFields<S> {
    /// Saves this thread's current context (without a driver there is none, and nothing of
    /// the value's could be bound either).
    pub fn save(&mut self) {
        self.saved = SavedContext::save(self.slot.clone()).ok();
    }
}

/// A value whose destruction binds a device's context (cuDNN handles and plans bind theirs to
/// be destroyed), dropped with this thread's current context saved around it.
pub struct DropInCallerContext<T, S: ContextSlot = DriverContext> {
    value: ManuallyDrop<T>,
    slot: S,
}

impl<T, S: ContextSlot + Default> DropInCallerContext<T, S> {
    pub fn new(value: T) -> Self {
        DropInCallerContext {
            value: ManuallyDrop::new(value),
            slot: S::default(),
        }
    }
}

impl<T, S: ContextSlot> Deref for DropInCallerContext<T, S> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T, S: ContextSlot> DerefMut for DropInCallerContext<T, S> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

impl<T, S: ContextSlot> Drop for DropInCallerContext<T, S> {
    fn drop(&mut self) {
        // Without a driver there is no context to restore (and nothing of T's could be bound).
        let _saved = SavedContext::save(&self.slot).ok();
        // SAFETY: `value` is dropped exactly once, here; it is never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.value) };
    }
}

impl<S: ContextSlot> ContextSlot for &S {
    type Context = S::Context;
    fn current(&self) -> Result<Self::Context, CudnnError> {
        (**self).current()
    }
    fn make_current(&self, context: Self::Context) -> Result<(), CudnnError> {
        (**self).make_current(context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    /// A thread's current context as a number (0 = none), with a log of every change and an
    /// optional failure of the next `current()`.
    #[derive(Clone, Default)]
    struct FakeSlot {
        current: Rc<Cell<u32>>,
        sets: Rc<RefCell<Vec<u32>>>,
        fail_get: Rc<Cell<bool>>,
    }

    impl ContextSlot for FakeSlot {
        type Context = u32;
        fn current(&self) -> Result<u32, CudnnError> {
            if self.fail_get.get() {
                return Err(CudnnError::NoDevice {
                    detail: "fake".into(),
                });
            }
            Ok(self.current.get())
        }
        fn make_current(&self, context: u32) -> Result<(), CudnnError> {
            self.sets.borrow_mut().push(context);
            self.current.set(context);
            Ok(())
        }
    }

    /// What `Tuner::execute` does: save, bind the device's context, fail or succeed.
    fn run_on_device(slot: &FakeSlot, device: u32, fail: bool) -> Result<(), CudnnError> {
        let _saved = SavedContext::save(slot.clone())?;
        slot.make_current(device)?;
        if fail {
            return Err(CudnnError::NoDevice {
                detail: "the call failed".into(),
            });
        }
        Ok(())
    }

    #[test]
    fn the_callers_context_is_current_again_after_success_and_failure() {
        let slot = FakeSlot::default();
        slot.current.set(1); // the caller's device 0
        run_on_device(&slot, 2, false).unwrap();
        assert_eq!(slot.current.get(), 1);
        assert!(run_on_device(&slot, 2, true).is_err());
        assert_eq!(slot.current.get(), 1);
        assert_eq!(*slot.sets.borrow(), [2, 1, 2, 1]);
    }

    #[test]
    fn no_context_stays_no_context() {
        let slot = FakeSlot::default();
        run_on_device(&slot, 5, false).unwrap();
        assert_eq!(slot.current.get(), 0);
    }

    #[test]
    fn nested_guards_restore_in_order() {
        let slot = FakeSlot::default();
        slot.current.set(1);
        {
            let _outer = SavedContext::save(slot.clone()).unwrap();
            slot.make_current(2).unwrap();
            {
                let _inner = SavedContext::save(slot.clone()).unwrap();
                slot.make_current(3).unwrap();
            }
            assert_eq!(slot.current.get(), 2);
        }
        assert_eq!(slot.current.get(), 1);
    }

    #[test]
    fn a_failed_save_binds_nothing() {
        let slot = FakeSlot::default();
        slot.current.set(1);
        slot.fail_get.set(true);
        assert!(run_on_device(&slot, 2, false).is_err());
        assert_eq!(slot.current.get(), 1);
        assert!(slot.sets.borrow().is_empty());
    }

    /// Binds a device's context when dropped, as cuDNN handles and engine plans do.
    struct BindsOnDrop {
        slot: FakeSlot,
        device: u32,
        dropped: Rc<Cell<bool>>,
    }

    impl Drop for BindsOnDrop {
        fn drop(&mut self) {
            self.slot.make_current(self.device).unwrap();
            self.dropped.set(true);
        }
    }

    /// Fields that bind on drop, then the restore last, as `EnginePlan`, `HandleOwner` and
    /// `StreamFence` declare them.
    struct PlanLike {
        _plan: BindsOnDrop,
        _stream: BindsOnDrop,
        caller_context: RestoreAfterFields<FakeSlot>,
    }

    impl Drop for PlanLike {
        fn drop(&mut self) {
            self.caller_context.save();
            self.caller_context.slot.make_current(7).unwrap(); // the body binds too
        }
    }

    #[test]
    fn a_restore_declared_last_runs_after_every_field_binds() {
        let slot = FakeSlot::default();
        slot.current.set(3);
        let dropped = Rc::new(Cell::new(false));
        let binds = |device| BindsOnDrop {
            slot: slot.clone(),
            device,
            dropped: dropped.clone(),
        };
        let value = PlanLike {
            _plan: binds(7),
            _stream: binds(8),
            caller_context: RestoreAfterFields {
                slot: slot.clone(),
                saved: None,
            },
        };
        drop(value);
        assert_eq!(slot.current.get(), 3);
        assert_eq!(*slot.sets.borrow(), [7, 7, 8, 3]);
        // Without a saved context (a driver that failed), the fields drop and nothing is set.
        let slot = FakeSlot::default();
        slot.fail_get.set(true);
        drop(PlanLike {
            _plan: binds(7),
            _stream: binds(8),
            caller_context: RestoreAfterFields {
                slot: slot.clone(),
                saved: None,
            },
        });
        assert_eq!(*slot.sets.borrow(), [7]);
    }

    #[test]
    fn a_value_that_binds_on_drop_leaves_the_callers_context() {
        let slot = FakeSlot::default();
        slot.current.set(1);
        let dropped = Rc::new(Cell::new(false));
        let value = DropInCallerContext {
            value: ManuallyDrop::new(BindsOnDrop {
                slot: slot.clone(),
                device: 9,
                dropped: dropped.clone(),
            }),
            slot: slot.clone(),
        };
        assert_eq!(value.device, 9); // Deref reaches the value
        slot.current.set(4); // the caller moved to another context meanwhile
        drop(value);
        assert!(dropped.get());
        assert_eq!(slot.current.get(), 4);
        assert_eq!(*slot.sets.borrow(), [9, 4]);
    }
}
