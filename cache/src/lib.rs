//! mucudnn's persistent tuning cache: raw measurements and solved plans in one SQLite file, so
//! tuning is paid once per device, cuDNN version and convolution shape.
//!
//! Data enters as [`Measurement`]s from the profiler (per device, problem, op and micro-batch
//! size) and as [`Plan`]s from the solver; it leaves as [`OpProfile`]s ready to solve (a new
//! workspace limit needs no re-profiling) and as cached plans. Export and import speak the
//! profile interchange format, with the device fingerprint in its extension key.
//!
//! A cache is only a cache, but a file that is not a cache is not ours. Opening is the one
//! place these meet, and [`Cache::open`] keeps them apart:
//!
//! - **Not a mucudnn cache** (not SQLite, another program's database, tables that are not
//!   ours): the error [`NotACache`]. The file is left byte-for-byte unchanged, by every
//!   [`Access`]; the caller (the CLI) reports it and stops.
//! - **The process cannot open files** (out of file descriptors, EMFILE/ENFILE, or memory):
//!   the other error, [`OutOfResources`]. Nothing is wrong with the cache, and an in-memory
//!   stand-in would hide that every later cache of the process keeps nothing.
//! - **A mucudnn cache with a problem** never fails to open. Damaged: a writer moves it aside to
//!   `<file>.corrupt-<time>`, starts a fresh one and salvages every row it can still read
//!   ([`Salvage`]); a reader ([`Access::ReadOnly`]) moves nothing and sees an empty cache.
//!   Unwritable (mode bits, a read-only file system, `MUCUDNN_CACHE_READ_ONLY=1`): opened
//!   read-only, its measurements are used and new ones are not kept. From a newer mucudnn, or
//!   an unusable location: an in-memory cache. Each comes with a warning.
//!
//! Afterwards a failed read is a miss and a failed write a warning; tuning goes on. Only the
//! explicit operations that exist to change the file ([`Cache::import`], [`Cache::clear`])
//! fail when it cannot be changed. Several processes (data-parallel ranks) may tune into one
//! file at once: WAL journaling, a busy timeout and immediate transactions make their writes
//! queue instead of fail. All SQL is parameterised.

mod open;
mod schema;
mod store;

pub use open::{NotACache, OpenFailure, OutOfResources, Salvage};
pub use schema::{APPLICATION_ID, SCHEMA_VERSION};
pub use store::{EntrySummary, PlanKey};

use mucudnn_solver::{
    CandidateSet, ConvOp, ConvProblem, DeviceFingerprint, IndexLimit, MeasureKey, Measured,
    Measurement, OpKey, OpProfile, Plan, Policy, Profile, SizesKey, Skipped,
};
use open::{exhausted, Identity, OpenError};
use rusqlite::Connection;
use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};

/// Set to anything but empty or `0`, commands that would write the cache open it read-only:
/// its measurements are used, new ones are not kept (a shared team cache, a read-only mount).
pub const READ_ONLY_ENV: &str = "MUCUDNN_CACHE_READ_ONLY";

/// What a command may do to its cache file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Create, migrate, store, and move a damaged cache aside (salvaging it).
    ReadWrite,
    /// Read only: nothing is created, migrated or moved (`cache show`, `list`, `export`).
    ReadOnly,
}

fn read_only_forced() -> bool {
    std::env::var_os(READ_ONLY_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The cache file: `$MUCUDNN_CACHE`, else `$XDG_CACHE_HOME/mucudnn/cache.sqlite`, else
/// `~/.cache/mucudnn/cache.sqlite`; `None` when no home directory is known.
pub fn default_path() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(path) = var("MUCUDNN_CACHE") {
        return Some(path);
    }
    let base = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|home| home.join(".cache")))?;
    Some(base.join("mucudnn").join("cache.sqlite"))
}

/// Where a cache keeps its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    File(PathBuf),
    /// Nothing persists; `reason` says why (unwritable location, no home directory, ...).
    Memory {
        reason: String,
    },
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::File(path) => write!(f, "{}", path.display()),
            Location::Memory { reason } => write!(f, "in memory ({reason})"),
        }
    }
}

/// Why an explicit cache operation (export, import, clear) failed. Lookups and stores never
/// return errors: they miss or warn.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error(
        "the profile was measured on {theirs}, but this machine is {ours}; pass --force to import it as this machine's"
    )]
    ForeignDevice { theirs: String, ours: String },
    #[error("the profile has no device fingerprint and names device {name:?}; pass --force to import it as this machine's")]
    UnknownDevice { name: String },
    #[error(transparent)]
    Profile(#[from] mucudnn_solver::ProfileError),
    /// A record no measurement on this device could produce; nothing was imported.
    #[error("{0}; nothing was imported")]
    Record(#[from] mucudnn_solver::RefusedRecord),
    /// The cache cannot be changed (read-only, or an in-memory fallback): nothing was done.
    #[error("the cache {location} cannot be written ({reason}); nothing was {what}")]
    NotWritable {
        location: String,
        reason: String,
        what: &'static str,
    },
}

/// The tuning cache. Not `Sync`: open one per thread (they may share a file).
pub struct Cache {
    conn: Connection,
    location: Location,
    /// Why writes are not kept (read-only file, in-memory fallback); `None` when they are.
    unwritable: Option<String>,
    /// Writes are skipped (the connection is read-only or stands in for a file not created).
    read_only: bool,
    salvage: Option<Salvage>,
    warnings: RefCell<Vec<String>>,
    /// Print warnings to stderr as they happen (on by default).
    echo: bool,
    /// Rows that failed the record check were skipped and said so (once per cache).
    bad_rows_warned: Cell<bool>,
}

impl Cache {
    /// Opens (creating if needed) the cache at `path` for reading and writing. Fails only when
    /// the file is not a mucudnn cache, or the process cannot open files; see the module docs.
    pub fn open(path: &Path) -> Result<Cache, OpenFailure> {
        Cache::open_with(path, Access::ReadWrite)
    }

    /// Opens the cache at `path`. Fails only when the file is not a mucudnn cache, which is
    /// then left unchanged, or when this process cannot open files now ([`OutOfResources`]);
    /// any problem of a mucudnn cache is a warning (module docs).
    pub fn open_with(path: &Path, access: Access) -> Result<Cache, OpenFailure> {
        let identity = open::identify(path)?;
        if let Identity::Unreachable(reason) = identity {
            return Cache::fallback_for(
                path,
                vec![format!("cannot use cache {}: {reason}", path.display())],
                access,
            );
        }
        if access == Access::ReadOnly {
            return Cache::read_only_file(path, &identity, None, Vec::new());
        }
        if read_only_forced() {
            let reason = format!("{READ_ONLY_ENV} is set");
            return Cache::read_only_file(path, &identity, Some(reason), Vec::new());
        }
        let mut warnings = Vec::new();
        let location = Location::File(path.to_path_buf());
        match open::open_read_write(path) {
            Ok(conn) => return Ok(Cache::from_parts(conn, location, warnings)),
            Err(OpenError::ReadOnly(reason)) => {
                return Cache::read_only_file(path, &identity, Some(reason), warnings)
            }
            Err(OpenError::Unusable(reason)) => match open::set_aside(path) {
                Ok(moved) => match open::open_read_write(path) {
                    Ok(conn) => {
                        let salvage = open::salvage(&moved, &conn, moved.clone());
                        warnings.push(format!(
                            "cache {} is damaged ({reason}); moved it to {}, started a fresh one \
                             and salvaged {} of its rows ({} measurements){}",
                            path.display(),
                            moved.display(),
                            salvage.total_kept(),
                            salvage.measurements_kept(),
                            if salvage.unreadable.is_empty() {
                                String::new()
                            } else {
                                format!("; unreadable: {}", salvage.unreadable.join("; "))
                            }
                        ));
                        let mut cache = Cache::from_parts(conn, location, warnings);
                        cache.salvage = Some(salvage);
                        return Ok(cache);
                    }
                    Err(e) => warnings.push(format!(
                        "cache {} is damaged ({reason}); moved it to {}, but a fresh cache \
                         failed too: {e}",
                        path.display(),
                        moved.display()
                    )),
                },
                Err(e) => warnings.push(format!(
                    "cache {} is damaged ({reason}) and could not be moved aside: {e}",
                    path.display()
                )),
            },
            Err(OpenError::Location(reason)) => {
                warnings.push(format!("cannot use cache {}: {reason}", path.display()))
            }
        }
        Cache::fallback_for(path, warnings, access)
    }

    /// A cache of ours at `path` that will not be written: `why` says why (`None`: the caller
    /// only reads). A missing or empty file reads as an empty cache and is not created.
    fn read_only_file(
        path: &Path,
        identity: &Identity,
        why: Option<String>,
        mut warnings: Vec<String>,
    ) -> Result<Cache, OpenFailure> {
        let location = Location::File(path.to_path_buf());
        let conn = match identity {
            Identity::New => Ok(None),
            _ => open::open_existing_read_only(path),
        };
        let conn = match conn {
            Ok(Some(conn)) => conn,
            Ok(None) => memory_connection(),
            Err(OpenError::Unusable(reason)) => {
                warnings.push(format!(
                    "cache {} is damaged ({reason}); reading it as empty (a command that \
                     writes the cache moves it aside and salvages what it can)",
                    path.display()
                ));
                memory_connection()
            }
            Err(e) => {
                warnings.push(format!("cannot read cache {}: {e}", path.display()));
                let access = if why.is_some() {
                    Access::ReadWrite
                } else {
                    Access::ReadOnly
                };
                return Cache::fallback_for(path, warnings, access);
            }
        };
        if let Some(reason) = &why {
            warnings.push(format!(
                "cache {} is read-only ({reason}): its measurements are used, new ones will \
                 not be kept",
                path.display()
            ));
        }
        let mut cache = Cache::from_parts(conn, location, warnings);
        cache.read_only = true;
        cache.unwritable = Some(why.unwrap_or_else(|| "opened read-only".into()));
        Ok(cache)
    }

    /// An in-memory cache standing in for `path`, which cannot be used; unless the process is
    /// out of file descriptors or memory now: a location that "cannot be used" may be only
    /// that (SQLite says "unable to open database file" for both), and a stand-in would hide
    /// it, so that is an error ([`OutOfResources`]).
    fn fallback_for(
        path: &Path,
        warnings: Vec<String>,
        access: Access,
    ) -> Result<Cache, OpenFailure> {
        if let Some(reason) = exhausted() {
            return Err(OutOfResources {
                path: path.to_path_buf(),
                reason,
            }
            .into());
        }
        Ok(Cache::fallback(warnings, access))
    }

    /// An in-memory cache standing in for a location that cannot be used.
    fn fallback(mut warnings: Vec<String>, access: Access) -> Cache {
        let reason = warnings.last().cloned().unwrap_or_default();
        if access == Access::ReadWrite {
            warnings.push("keeping tuning results in memory for this run".into());
        }
        let mut cache = Cache::from_parts(
            memory_connection(),
            Location::Memory {
                reason: reason.clone(),
            },
            warnings,
        );
        cache.unwritable = Some(reason);
        cache
    }

    /// Opens `explicit`, else [`default_path`], else an in-memory cache, for reading and
    /// writing.
    pub fn open_default(explicit: Option<&Path>) -> Result<Cache, OpenFailure> {
        Cache::open_default_with(explicit, Access::ReadWrite)
    }

    /// Opens `explicit`, else [`default_path`], else an in-memory cache.
    pub fn open_default_with(
        explicit: Option<&Path>,
        access: Access,
    ) -> Result<Cache, OpenFailure> {
        match explicit.map(Path::to_path_buf).or_else(default_path) {
            Some(path) => Cache::open_with(&path, access),
            None => Ok(Cache::fallback(
                vec!["no cache location (set MUCUDNN_CACHE or HOME)".into()],
                access,
            )),
        }
    }

    /// A cache that keeps nothing after the process ends.
    pub fn in_memory() -> Cache {
        Cache::from_parts(
            memory_connection(),
            Location::Memory {
                reason: "requested".into(),
            },
            Vec::new(),
        )
    }

    fn from_parts(conn: Connection, location: Location, warnings: Vec<String>) -> Cache {
        let cache = Cache {
            conn,
            location,
            unwritable: None,
            read_only: false,
            salvage: None,
            warnings: RefCell::new(Vec::new()),
            echo: true,
            bad_rows_warned: Cell::new(false),
        };
        for warning in warnings {
            cache.warn(warning);
        }
        cache
    }

    /// Stop printing warnings to stderr (they are still collected, see [`Cache::warnings`]).
    pub fn quiet(mut self) -> Self {
        self.echo = false;
        self
    }

    pub fn location(&self) -> &Location {
        &self.location
    }

    /// True when the cache file is read but never written (see [`Access`] and
    /// [`READ_ONLY_ENV`]); stores are then skipped.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// What was salvaged when this open found the cache damaged and replaced it.
    pub fn salvage(&self) -> Option<&Salvage> {
        self.salvage.as_ref()
    }

    /// Fails when what is written would not be kept in the cache's file.
    fn writable(&self, what: &'static str) -> Result<(), CacheError> {
        match &self.unwritable {
            None => Ok(()),
            Some(reason) => Err(CacheError::NotWritable {
                location: self.location.to_string(),
                reason: reason.clone(),
                what,
            }),
        }
    }

    /// Every warning so far (opening problems, failed writes).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.borrow().clone()
    }

    fn warn(&self, message: String) {
        let message = shortened(message);
        if self.echo {
            eprintln!("mucudnn: warning: {message}");
        }
        self.warnings.borrow_mut().push(message);
    }

    /// Runs a write (skipped on a read-only cache); a failure becomes a warning.
    fn write<T>(
        &self,
        what: &str,
        write: impl FnOnce(&Connection) -> Result<T, rusqlite::Error>,
    ) -> Option<T> {
        if self.read_only {
            return None;
        }
        write(&self.conn)
            .map_err(|e| self.warn(format!("cache write failed ({what}): {e}")))
            .ok()
    }

    /// Says once that rows failing the record check were skipped (lookups count them).
    fn skipped_rows(&self, skipped: usize) {
        if skipped > 0 && !self.bad_rows_warned.replace(true) {
            self.warn(format!(
                "skipped {skipped} cached row(s) that no measurement could produce (a candidate \
                 the device does not have, a time that is not positive and finite, a shape or \
                 workspace this mucudnn cannot read); they are not used, and measuring again \
                 replaces them"
            ));
        }
    }

    /// Runs a read; a failure is a miss (with a warning, since it means a damaged file).
    fn read<T>(&self, what: &str, result: Result<T, rusqlite::Error>) -> Option<T> {
        result
            .map_err(|e| {
                self.warn(format!(
                    "cache read failed ({what}): {e}; treating it as a miss"
                ))
            })
            .ok()
    }

    /// The measurements of `key`'s candidates (its shape: the batch size is ignored; a spatial
    /// size is a chunk's rows along the split axis), if that kind was measured at that size
    /// on `device`. An empty list means measured, with no supported candidate. Rows of one
    /// split never answer a lookup of the other; candidates rejected for wrong results are
    /// never among them.
    pub fn measurements(
        &self,
        device: &DeviceFingerprint,
        key: &MeasureKey,
    ) -> Option<Vec<Measurement>> {
        self.size_rows(device, key).map(|m| m.measurements)
    }

    /// The measurements, rejected candidates and verification state of `key`'s size.
    fn size_rows(&self, device: &DeviceFingerprint, key: &MeasureKey) -> Option<Measured> {
        let mut skipped = 0;
        let found = self
            .read(
                "measurements",
                store::size_rows(&self.conn, device, key, &mut skipped),
            )
            .flatten();
        self.skipped_rows(skipped);
        found
    }

    /// Records the measurements of `key`'s candidates, taken without verification (replacing
    /// earlier ones of that kind and size; measurements of another kind or size are ignored),
    /// and that the named problem was tuned on `device`. Every candidate was timed: the size is
    /// complete for every workspace limit.
    pub fn store_measurements(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        key: &MeasureKey,
        measurements: &[Measurement],
    ) {
        self.store_measured(device, layer, key, measurements, &[]);
    }

    /// As [`Cache::store_measurements`], with the candidates `skipped` for their workspace
    /// (not timed): the size is complete only for limits below each skipped workspace, and
    /// [`Cache::missing_sizes_within`] lists it for larger ones.
    pub fn store_measured(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        key: &MeasureKey,
        measurements: &[Measurement],
        skipped: &[Skipped],
    ) {
        let measured = Measured {
            measurements: measurements.to_vec(),
            skipped: skipped.to_vec(),
            ..Measured::default()
        };
        self.store_size(device, layer, key, &measured);
    }

    /// Records everything measured of `key` (replacing what was stored of that kind and
    /// size): the measurements, the skipped candidates, the candidates rejected for wrong
    /// results (kept with their error, never returned as measurements) and how the size was
    /// verified; and that the named problem was tuned on `device`.
    pub fn store_size(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        key: &MeasureKey,
        measured: &Measured,
    ) {
        self.write("measurements", |conn| {
            store::store_measurements(conn, device, layer, key, measured)
        });
    }

    /// What is cached of `key`, if that size was measured: the timed measurements, the
    /// candidates skipped for their workspace, those rejected for wrong results, and how the
    /// size was verified. A skipped candidate is never a measurement; it is what a tune under a
    /// larger limit still has to time. A rejected one is never a measurement either.
    pub fn measured(&self, device: &DeviceFingerprint, key: &MeasureKey) -> Option<Measured> {
        let mut measured = self.size_rows(device, key)?;
        let mut skipped = self.read("skipped", store::skipped(&self.conn, device, key))?;
        // A candidate both timed and skipped (rows written by hand or by an older store) is a
        // measurement: a profile may not hold it twice.
        let timed = &measured.measurements;
        skipped.retain(|x| !timed.iter().any(|m| m.algo == x.algo));
        measured.skipped = skipped;
        Some(measured)
    }

    /// The sizes among `sizes` whose measurements of `key` were taken without verification
    /// ([`SizeVerification::Unverified`](mucudnn_solver::SizeVerification::Unverified)): a tune
    /// that verifies measures them again.
    pub fn unverified_sizes(
        &self,
        device: &DeviceFingerprint,
        key: &SizesKey,
        sizes: &[i64],
    ) -> Vec<i64> {
        self.read(
            "unverified sizes",
            store::unverified_sizes(&self.conn, device, key),
        )
        .map(|unverified| {
            sizes
                .iter()
                .copied()
                .filter(|s| unverified.contains(s))
                .collect()
        })
        // A failed read is a miss.
        .unwrap_or_else(|| sizes.to_vec())
    }

    /// The sizes among `sizes` that a tune under a workspace limit of `limit` bytes (`None`:
    /// none) still has to measure for `key`: never measured, or measured under a smaller
    /// limit that skipped a candidate fitting `limit`.
    pub fn missing_sizes_within(
        &self,
        device: &DeviceFingerprint,
        key: &SizesKey,
        sizes: &[i64],
        limit: Option<u64>,
    ) -> Vec<i64> {
        let missing = self.missing_sizes(device, key, sizes);
        let incomplete = self
            .read(
                "skipped sizes",
                store::sizes_skipped_within(&self.conn, device, key, limit),
            )
            // A failed read is a miss.
            .unwrap_or_else(|| sizes.to_vec());
        sizes
            .iter()
            .copied()
            .filter(|s| missing.contains(s) || incomplete.contains(s))
            .collect()
    }

    /// The sizes among `sizes` at which `key`'s candidates have not been measured on
    /// `device`.
    pub fn missing_sizes(
        &self,
        device: &DeviceFingerprint,
        key: &SizesKey,
        sizes: &[i64],
    ) -> Vec<i64> {
        self.read(
            "measured sizes",
            store::measured_sizes(&self.conn, device, key),
        )
        .map(|measured| {
            sizes
                .iter()
                .copied()
                .filter(|s| !measured.contains(s))
                .collect()
        })
        .unwrap_or_else(|| sizes.to_vec())
    }

    /// Everything cached for `key` on `device` at the sizes the policy allows of the split's
    /// extent ([`SplitDim::extent`](mucudnn_solver::SplitDim::extent)) whose calls fit 32-bit
    /// indexing ([`IndexLimit`]), among `candidates`, as a profile entry named `layer`, if
    /// every kind in the set was measured at every such size.
    pub fn op_profile(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        key: &OpKey,
        policy: Policy,
        candidates: CandidateSet,
    ) -> Option<OpProfile> {
        let extent = key.extent();
        // Only sizes whose calls fit 32-bit indexing are ever measured (and solved with).
        let largest = IndexLimit::CUDNN
            .largest_size(&key.problem, key.op, key.split)
            .ok()?;
        let sizes: Vec<i64> = policy
            .sizes(extent)
            .into_iter()
            .filter(|&size| size <= largest)
            .collect();
        for &kind in candidates.kinds() {
            if !self
                .missing_sizes(device, &key.of_kind(kind), &sizes)
                .is_empty()
            {
                return None;
            }
        }
        let mut skipped = 0;
        let measurements = self.read(
            "profile",
            store::measurements_up_to(&self.conn, device, key, candidates, &mut skipped),
        );
        self.skipped_rows(skipped);
        let measurements = measurements?;
        let measurements = measurements
            .into_iter()
            .filter(|m| policy.allows(m.micro, extent) && m.micro <= largest)
            .collect();
        self.write("seen", |conn| {
            store::mark_seen(conn, device, layer, &key.problem, key.op)
        });
        Some(OpProfile {
            layer: layer.to_string(),
            problem: key.problem,
            op: key.op,
            split: key.split,
            measurements,
            skipped: Vec::new(),
            rejected: Vec::new(),
        })
    }

    /// A plan solved earlier for exactly this problem, op, policy and constraint.
    pub fn plan(
        &self,
        device: &DeviceFingerprint,
        problem: &ConvProblem,
        op: ConvOp,
        key: &PlanKey,
    ) -> Option<Plan> {
        let mut skipped = 0;
        let plan = self
            .read(
                "plan",
                store::plan(&self.conn, device, problem, op, key, &mut skipped),
            )
            .flatten();
        self.skipped_rows(skipped);
        plan
    }

    pub fn store_plan(&self, device: &DeviceFingerprint, plan: &Plan, key: &PlanKey) {
        self.write("plan", |conn| store::store_plan(conn, device, plan, key));
    }

    /// One row per named problem and op tuned, per device.
    pub fn entries(&self) -> Result<Vec<EntrySummary>, CacheError> {
        let mut skipped = 0;
        let entries = store::entries(&self.conn, &mut skipped)?;
        self.skipped_rows(skipped);
        Ok(entries)
    }

    /// The cached measurements of every named problem, one profile per device (with its
    /// fingerprint), optionally only `device`'s.
    pub fn export(&self, device: Option<&DeviceFingerprint>) -> Result<Vec<Profile>, CacheError> {
        let mut skipped = 0;
        let profiles = store::export(&self.conn, device, &mut skipped)?;
        self.skipped_rows(skipped);
        Ok(profiles)
    }

    /// Imports a profile. Its fingerprint (or, for a profile without one, its device name and
    /// cuDNN version) must be `local`'s unless `force`, in which case the measurements are
    /// stored as `local`'s. All or nothing: every record must pass
    /// [`RecordCheck::batch_split`](mucudnn_solver::RecordCheck::batch_split) for `local` (even when
    /// forced), else the first bad one is named by its index and nothing is stored. Returns
    /// the number of measurements stored.
    pub fn import(
        &self,
        profile: &Profile,
        local: &DeviceFingerprint,
        force: bool,
    ) -> Result<usize, CacheError> {
        self.writable("imported")?;
        profile.validate()?;
        if !force {
            check_device(profile, local)?;
        }
        let check = mucudnn_solver::RecordCheck {
            device: local,
            memory_bytes: None,
        };
        check.batch_split(profile.entries.iter().flat_map(|entry| {
            entry.measurements.iter().map(move |m| {
                (
                    entry.layer.as_str(),
                    &entry.problem,
                    entry.op,
                    entry.split,
                    m,
                )
            })
        }))?;
        Ok(store::import(&self.conn, profile, local)?)
    }

    /// Deletes every measurement and plan (the schema stays).
    pub fn clear(&self) -> Result<(), CacheError> {
        self.writable("cleared")?;
        Ok(store::clear(&self.conn)?)
    }
}

/// The most characters of a warning: a path can be as long as the user makes it (100,000
/// characters were echoed whole, once per warning); the start and the end say which it is.
const MAX_WARNING_CHARS: usize = 1000;

/// `message`, its middle left out when it is longer than [`MAX_WARNING_CHARS`].
fn shortened(message: String) -> String {
    let count = message.chars().count();
    if count <= MAX_WARNING_CHARS {
        return message;
    }
    let (head, tail) = (MAX_WARNING_CHARS * 3 / 4, MAX_WARNING_CHARS / 4);
    let start: String = message.chars().take(head).collect();
    let end: String = message.chars().skip(count - tail).collect();
    format!(
        "{start}[... {} characters left out ...]{end}",
        count - head - tail
    )
}

/// Whether `profile` was measured on `local`: its fingerprint must be `local`'s, or, for a
/// profile without one, its device name and cuDNN version. [`Cache::import`] checks it unless
/// forced; callers that check more (the candidates) call it first for the clearer error.
pub fn check_device(profile: &Profile, local: &DeviceFingerprint) -> Result<(), CacheError> {
    match &profile.fingerprint {
        Some(theirs) if theirs != local => {
            let (mut theirs_text, mut ours_text) = (theirs.to_string(), local.to_string());
            // Fingerprints that differ only where the short form rounds or leaves out (a
            // driver's patch level, the backend) would read "measured on X, but this machine
            // is X": then both say every field.
            if theirs_text == ours_text {
                let or_none = |v: Option<String>| v.unwrap_or_else(|| "none".into());
                let full = |f: &DeviceFingerprint| {
                    format!(
                        "{} (backend {}, compute capability {}, driver {}, cuDNN {})",
                        f.name,
                        f.backend,
                        or_none(f.compute_capability.map(|(a, b)| format!("{a}.{b}"))),
                        or_none(f.driver_version.map(|v| v.to_string())),
                        or_none(f.cudnn_version.map(|v| v.to_string())),
                    )
                };
                (theirs_text, ours_text) = (full(theirs), full(local));
            }
            Err(CacheError::ForeignDevice {
                theirs: theirs_text,
                ours: ours_text,
            })
        }
        Some(_) => Ok(()),
        None if profile.device == local.name && profile.cudnn_version == local.cudnn_version => {
            Ok(())
        }
        None => Err(CacheError::UnknownDevice {
            name: profile.device.clone(),
        }),
    }
}

fn memory_connection() -> Connection {
    let mut conn =
        Connection::open_in_memory().expect("SQLite can always open an in-memory database");
    schema::migrate(&mut conn).expect("the schema applies to an empty in-memory database");
    conn
}
