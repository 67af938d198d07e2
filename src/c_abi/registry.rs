//! The values C holds by handle (`mucudnnHandle_t`, `mucudnnTuner_t`): each live value is
//! registered under a token, and the token, not the value's address, is what C holds.
//!
//! A token is never reused in a process, and the tokens of one process are spread over the
//! whole 64-bit range by a keyed bijection of a counter, so a destroyed handle is refused
//! even when a new value lands at the old address, and a made-up value is refused unless it
//! hits a live token exactly (about one chance in 2^64 per live value). Tokens are never
//! dereferenced: a call looks its token up, under a lock, and reaches the value through the
//! registry.
//!
//! [`Registry`] gives one thread at a time exclusive use of a value (a handle: a second thread
//! is refused); [`Shared`] hands out the value's mutex, so concurrent calls queue (a tuner).

use super::error::{invalid, FfiError};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

/// A token for a value registered now: never 0 (NULL), never one handed out before in this
/// process. The counter goes through a bijection of `u64` keyed per process (a splitmix64
/// finaliser of the counter plus a random key), so distinct counters give distinct tokens.
pub fn new_token() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    static KEY: OnceLock<u64> = OnceLock::new();
    let key = *KEY.get_or_init(|| {
        // std's hasher keys are random per process.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(std::process::id().into());
        hasher.finish()
    });
    loop {
        let count = NEXT.fetch_add(1, Ordering::Relaxed);
        let token = mix(count.wrapping_add(key));
        // 64-bit targets only: usize holds the token whole.
        if token != 0 {
            return token as usize;
        }
    }
}

/// splitmix64's finaliser: each step (xor-shift, multiplication by an odd constant) is a
/// bijection of `u64`, so the whole is one.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn not_live(what: &str, kind: &str) -> FfiError {
    invalid(format!(
        "{what} is not a live mucudnn {kind} (never created, or already destroyed)"
    ))
}

// ---------------------------------------------------------------------------------------------
// Exclusive use (handles)

/// A registered value (the address of its box, kept as a number: the map holds no `T`) and
/// whether a call is using it.
struct Slot {
    address: usize,
    busy: bool,
}

/// The live values of type `T` by token, each with a busy flag: a token that was never
/// handed out, or was destroyed, is refused, and a value used by two threads at once is
/// refused for the second.
pub struct Registry<T> {
    live: Mutex<BTreeMap<usize, Slot>>,
    /// What the messages call a value (`handle`).
    kind: &'static str,
    _values: PhantomData<fn() -> T>,
}

/// Exclusive use of one registered value, through `Deref`/`DerefMut`; the busy flag is cleared
/// on drop (also when the code using it panics).
pub struct Entered<'r, T> {
    registry: &'r Registry<T>,
    token: usize,
    value: *mut T,
}

impl<T> std::fmt::Debug for Entered<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entered")
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl<T> std::ops::Deref for Entered<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the value is registered and marked busy for this guard's lifetime (see
        // `Registry::enter`), so it is a live `T` that only this guard reaches.
        unsafe { &*self.value }
    }
}

impl<T> std::ops::DerefMut for Entered<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only reference made through the
        // guard.
        unsafe { &mut *self.value }
    }
}

impl<T> Registry<T> {
    pub const fn new(kind: &'static str) -> Self {
        Registry {
            live: Mutex::new(BTreeMap::new()),
            kind,
            _values: PhantomData,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<usize, Slot>> {
        // The lock is never held across user code, so a poisoned map is still consistent.
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Boxes `value` and registers it; the token (as a pointer) is what C holds.
    pub fn insert(&self, value: T) -> *mut T {
        let token = new_token();
        let address = Box::into_raw(Box::new(value)) as usize;
        self.lock().insert(
            token,
            Slot {
                address,
                busy: false,
            },
        );
        token as *mut T
    }

    /// Marks the value of `token` busy and gives exclusive access to it until the returned
    /// guard is dropped. `what` names the argument in messages.
    pub fn enter(&self, token: *mut T, what: &str) -> Result<Entered<'_, T>, FfiError> {
        if token.is_null() {
            return Err(invalid(format!("{what} is NULL")));
        }
        let token = token as usize;
        let mut live = self.lock();
        match live.get_mut(&token) {
            None => Err(not_live(what, self.kind)),
            Some(slot) if slot.busy => Err(invalid(format!(
                "{what} is in use by another thread (a {} is used by one thread at a time)",
                self.kind
            ))),
            Some(slot) => {
                // From here until the guard drops, `remove` refuses the value and `enter`
                // refuses a second user: the guard's access is exclusive.
                slot.busy = true;
                Ok(Entered {
                    registry: self,
                    token,
                    value: slot.address as *mut T,
                })
            }
        }
    }

    /// Unregisters and drops the value of `token` (refused while it is in use).
    pub fn remove(&self, token: *mut T, what: &str) -> Result<(), FfiError> {
        if token.is_null() {
            return Err(invalid(format!("{what} is NULL")));
        }
        let value = {
            let mut live = self.lock();
            match live.get(&(token as usize)) {
                None => return Err(not_live(what, self.kind)),
                Some(slot) if slot.busy => {
                    return Err(invalid(format!(
                        "{what} is in use by another thread and cannot be destroyed now"
                    )))
                }
                Some(_) => live.remove(&(token as usize)).expect("present").address as *mut T,
            }
        };
        // SAFETY: `value` came from `Box::into_raw` in `insert` and was registered until just
        // now; it was not busy, and no longer being registered, nobody else can reach it.
        drop(unsafe { Box::from_raw(value) });
        Ok(())
    }

    /// How many values are live (for tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for Entered<'_, T> {
    fn drop(&mut self) {
        if let Some(slot) = self.registry.lock().get_mut(&self.token) {
            slot.busy = false;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared use (tuners)

/// The live values of type `T` by token, each behind its own mutex: a call clones the value's
/// `Arc` out of the map and locks it (waiting for another thread's call to finish); removing
/// takes it out of the map, and the value is dropped when the last call using it returns.
pub struct Shared<T> {
    live: Mutex<BTreeMap<usize, Arc<Mutex<T>>>>,
    /// What the messages call a value (`tuner`).
    kind: &'static str,
}

impl<T> Shared<T> {
    pub const fn new(kind: &'static str) -> Self {
        Shared {
            live: Mutex::new(BTreeMap::new()),
            kind,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<usize, Arc<Mutex<T>>>> {
        // Never held across user code or a value's call, so a poisoned map is still
        // consistent.
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `value`; the returned token is what C holds.
    pub fn insert(&self, value: T) -> usize {
        let token = new_token();
        self.lock().insert(token, Arc::new(Mutex::new(value)));
        token
    }

    /// Runs `f` on the value of `token`, locked for this call. `what` names the argument.
    pub fn with<R>(
        &self,
        token: usize,
        what: &str,
        f: impl FnOnce(&mut T) -> Result<R, FfiError>,
    ) -> Result<R, FfiError> {
        if token == 0 {
            return Err(invalid(format!("{what} is NULL")));
        }
        let shared = self
            .lock()
            .get(&token)
            .cloned()
            .ok_or_else(|| not_live(what, self.kind))?;
        // A panic inside an earlier call (reported as an internal error) leaves the value
        // usable.
        let mut value = shared.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut value)
    }

    /// Unregisters the value of `token`; it is dropped once no call uses it.
    pub fn remove(&self, token: usize, what: &str) -> Result<(), FfiError> {
        if token == 0 {
            return Err(invalid(format!("{what} is NULL")));
        }
        let removed = self.lock().remove(&token);
        // Dropped outside the map's lock: a tuner's drop frees plans and handles.
        removed.map(drop).ok_or_else(|| not_live(what, self.kind))
    }

    /// How many values are live (for tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_never_reused_nor_null() {
        let tokens: Vec<usize> = (0..10_000).map(|_| new_token()).collect();
        let distinct: std::collections::BTreeSet<usize> = tokens.iter().copied().collect();
        assert_eq!(distinct.len(), tokens.len());
        assert!(!distinct.contains(&0));
        // Spread over the range, not a count from 1: the small values a C caller could make up
        // (1, 0x40, 0x1000, ...) are not tokens.
        assert!(tokens.iter().filter(|&&t| t < (1 << 40)).count() < 10);
        // The mixing is a bijection: distinct inputs, distinct outputs.
        let mixed: std::collections::BTreeSet<u64> = (0..100_000u64).map(mix).collect();
        assert_eq!(mixed.len(), 100_000);
    }

    #[test]
    fn registry_refuses_stale_foreign_and_busy_tokens() {
        let registry: Registry<String> = Registry::new("handle");
        let token = registry.insert("handle".to_string());
        assert_eq!(registry.len(), 1);
        {
            let mut value = registry.enter(token, "handle").unwrap();
            value.push('!');
            let busy = registry.enter(token, "handle").unwrap_err();
            assert!(
                busy.to_string().contains("in use by another thread"),
                "{busy}"
            );
            let busy = registry.remove(token, "handle").unwrap_err();
            assert!(
                busy.to_string().contains("cannot be destroyed now"),
                "{busy}"
            );
        }
        {
            let value = registry.enter(token, "handle").unwrap();
            assert_eq!(*value, "handle!");
        }
        let foreign = 0x1000 as *mut String;
        let err = registry.enter(foreign, "handle").unwrap_err();
        assert!(
            err.to_string().contains("not a live mucudnn handle"),
            "{err}"
        );
        assert!(registry
            .enter(std::ptr::null_mut(), "handle")
            .unwrap_err()
            .to_string()
            .ends_with("is NULL"));
        registry.remove(token, "handle").unwrap();
        assert!(registry.is_empty());
        // Destroyed: refused, not dereferenced.
        assert!(registry.enter(token, "handle").is_err());
        assert!(registry.remove(token, "handle").is_err());
    }

    /// A value made after one was destroyed (at the same address or not) never answers to the
    /// destroyed one's token, and no made-up value reaches a live one.
    #[test]
    fn create_destroy_create_and_made_up_tokens_are_refused() {
        let registry: Registry<u64> = Registry::new("handle");
        let shared: Shared<u64> = Shared::new("tuner");
        for round in 0..100u64 {
            let first = registry.insert(round);
            registry.remove(first, "handle").unwrap();
            let second = registry.insert(round + 1);
            assert_ne!(first, second);
            let stale = registry.enter(first, "handle").unwrap_err().to_string();
            assert!(stale.contains("not a live mucudnn handle"), "{stale}");
            assert_eq!(*registry.enter(second, "handle").unwrap(), round + 1);
            registry.remove(second, "handle").unwrap();

            let first = shared.insert(round);
            shared.remove(first, "tuner").unwrap();
            let second = shared.insert(round + 1);
            let stale = shared.with(first, "tuner", |v| Ok(*v)).unwrap_err();
            assert!(
                stale.to_string().contains("not a live mucudnn tuner"),
                "{stale}"
            );
            assert_eq!(shared.with(second, "tuner", |v| Ok(*v)).unwrap(), round + 1);
            shared.remove(second, "tuner").unwrap();
        }
        // Made-up values, with values live: random ones, small ones and addresses.
        let live = shared.insert(7);
        let entered = registry.insert(7);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut made_up: Vec<usize> = (0..10_000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as usize
            })
            .collect();
        made_up.extend(1..=4096);
        made_up.push(&live as *const usize as usize);
        for value in made_up {
            if value == live || value == entered as usize {
                continue;
            }
            assert!(shared.with(value, "tuner", |v| Ok(*v)).is_err());
            assert!(registry.enter(value as *mut u64, "handle").is_err());
        }
        assert_eq!(shared.len(), 1);
        assert_eq!(registry.len(), 1);
        shared.remove(live, "tuner").unwrap();
        registry.remove(entered, "handle").unwrap();
    }

    #[test]
    fn busy_flag_is_cleared_when_the_user_panics() {
        let registry: Registry<u32> = Registry::new("handle");
        let token = registry.insert(1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _value = registry.enter(token, "handle").unwrap();
            panic!("inside");
        }));
        assert!(result.is_err());
        drop(registry.enter(token, "handle").unwrap());
        registry.remove(token, "handle").unwrap();
    }
}
