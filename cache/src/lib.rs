//! mucudnn's persistent tuning cache: raw measurements and solved plans in one SQLite file, so
//! tuning is paid once per device, cuDNN version and convolution shape.
//!
//! Data enters as [`Measurement`]s from the profiler (per device, problem, op and micro-batch
//! size) and as [`Plan`]s from the solver; it leaves as [`OpProfile`]s ready to solve (a new
//! workspace limit needs no re-profiling) and as cached plans. Export and import speak the
//! profile interchange format, with the device fingerprint in its extension key.
//!
//! A cache is only a cache. [`Cache::open`] never fails: a corrupt or unreadable file is moved
//! aside and replaced (with a warning), an unwritable location or a file from a newer mucudnn
//! falls back to an in-memory cache (with a warning). Afterwards a failed read is a miss and a
//! failed write a warning; tuning goes on. Several processes (data-parallel ranks) may tune
//! into one file at once: WAL journaling, a busy timeout and immediate transactions make their
//! writes queue instead of fail. All SQL is parameterised.

mod schema;
mod store;

pub use schema::SCHEMA_VERSION;
pub use store::{EntrySummary, PlanKey};

use mucudnn_solver::{
    AlgoKind, CandidateSet, ConvOp, ConvProblem, DeviceFingerprint, Measurement, OpProfile, Plan,
    Policy, Profile,
};
use rusqlite::{Connection, OpenFlags};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a writer waits for another process's transaction before giving up on one write.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

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
}

/// The tuning cache. Not `Sync`: open one per thread (they may share a file).
pub struct Cache {
    conn: Connection,
    location: Location,
    warnings: RefCell<Vec<String>>,
    /// Print warnings to stderr as they happen (on by default).
    echo: bool,
}

impl Cache {
    /// Opens (creating if needed) the cache at `path`. Never fails; see the module docs.
    pub fn open(path: &Path) -> Cache {
        let mut warnings = Vec::new();
        let location = Location::File(path.to_path_buf());
        match open_file(path) {
            Ok(conn) => return Cache::from_parts(conn, location, warnings),
            Err(OpenError::Unusable(reason)) => {
                let aside = set_aside(path);
                warnings.push(match &aside {
                    Ok(moved) => format!(
                        "cache {} is unreadable ({reason}); moved it to {} and started a fresh one",
                        path.display(),
                        moved.display()
                    ),
                    Err(e) => format!(
                        "cache {} is unreadable ({reason}) and could not be moved aside: {e}",
                        path.display()
                    ),
                });
                if aside.is_ok() {
                    match open_file(path) {
                        Ok(conn) => return Cache::from_parts(conn, location, warnings),
                        Err(e) => warnings.push(format!(
                            "a fresh cache at {} failed too: {e}",
                            path.display()
                        )),
                    }
                }
            }
            Err(e) => warnings.push(format!("cannot use cache {}: {e}", path.display())),
        }
        let reason = warnings.last().cloned().unwrap_or_default();
        warnings.push("keeping tuning results in memory for this run".into());
        Cache::from_parts(memory_connection(), Location::Memory { reason }, warnings)
    }

    /// Opens `explicit`, else [`default_path`], else an in-memory cache.
    pub fn open_default(explicit: Option<&Path>) -> Cache {
        match explicit.map(Path::to_path_buf).or_else(default_path) {
            Some(path) => Cache::open(&path),
            None => Cache::from_parts(
                memory_connection(),
                Location::Memory { reason: "no cache path: set MUCUDNN_CACHE or HOME".into() },
                vec!["no cache location (set MUCUDNN_CACHE or HOME); keeping tuning results in memory".into()],
            ),
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
            warnings: RefCell::new(Vec::new()),
            echo: true,
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

    /// Every warning so far (opening problems, failed writes).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.borrow().clone()
    }

    fn warn(&self, message: String) {
        if self.echo {
            eprintln!("mucudnn: warning: {message}");
        }
        self.warnings.borrow_mut().push(message);
    }

    /// Runs a write; a failure becomes a warning.
    fn write<T>(&self, what: &str, result: Result<T, rusqlite::Error>) -> Option<T> {
        result
            .map_err(|e| self.warn(format!("cache write failed ({what}): {e}")))
            .ok()
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

    /// The measurements of `kind`'s candidates for `problem` (its shape; the batch size is
    /// ignored) at micro-batch `micro`, if that kind was measured at that size on `device`. An
    /// empty list means measured, with no supported candidate.
    pub fn measurements(
        &self,
        device: &DeviceFingerprint,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        kind: AlgoKind,
    ) -> Option<Vec<Measurement>> {
        self.read(
            "measurements",
            store::measurements(&self.conn, device, problem, op, micro, kind),
        )
        .flatten()
    }

    /// Records the measurements of `kind`'s candidates at one micro-batch size (replacing
    /// earlier ones of that kind; measurements of another kind or size are ignored), and that
    /// the named problem was tuned on `device`.
    #[allow(clippy::too_many_arguments)]
    pub fn store_measurements(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        kind: AlgoKind,
        measurements: &[Measurement],
    ) {
        self.write(
            "measurements",
            store::store_measurements(
                &self.conn,
                device,
                layer,
                problem,
                op,
                micro,
                kind,
                measurements,
            ),
        );
    }

    /// The sizes among `sizes` at which `kind`'s candidates have not been measured for
    /// `problem` and `op` on `device`.
    pub fn missing_sizes(
        &self,
        device: &DeviceFingerprint,
        problem: &ConvProblem,
        op: ConvOp,
        kind: AlgoKind,
        sizes: &[i64],
    ) -> Vec<i64> {
        self.read(
            "measured sizes",
            store::measured_sizes(&self.conn, device, problem, op, kind),
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

    /// Everything cached for `problem` and `op` on `device` at sizes the policy allows, among
    /// `candidates`, as a profile entry named `layer`, if every kind in the set was measured
    /// at every allowed size.
    pub fn op_profile(
        &self,
        device: &DeviceFingerprint,
        layer: &str,
        problem: &ConvProblem,
        op: ConvOp,
        policy: Policy,
        candidates: CandidateSet,
    ) -> Option<OpProfile> {
        let sizes = policy.sizes(problem.n);
        for &kind in candidates.kinds() {
            if !self
                .missing_sizes(device, problem, op, kind, &sizes)
                .is_empty()
            {
                return None;
            }
        }
        let measurements = self.read(
            "profile",
            store::measurements_up_to(&self.conn, device, problem, op, problem.n, candidates),
        )?;
        let measurements = measurements
            .into_iter()
            .filter(|m| policy.allows(m.micro, problem.n))
            .collect();
        self.write(
            "seen",
            store::mark_seen(&self.conn, device, layer, problem, op),
        );
        Some(OpProfile {
            layer: layer.to_string(),
            problem: *problem,
            op,
            measurements,
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
        self.read("plan", store::plan(&self.conn, device, problem, op, key))
            .flatten()
    }

    pub fn store_plan(&self, device: &DeviceFingerprint, plan: &Plan, key: &PlanKey) {
        self.write("plan", store::store_plan(&self.conn, device, plan, key));
    }

    /// One row per named problem and op tuned, per device.
    pub fn entries(&self) -> Result<Vec<EntrySummary>, CacheError> {
        Ok(store::entries(&self.conn)?)
    }

    /// The cached measurements of every named problem, one profile per device (with its
    /// fingerprint), optionally only `device`'s.
    pub fn export(&self, device: Option<&DeviceFingerprint>) -> Result<Vec<Profile>, CacheError> {
        Ok(store::export(&self.conn, device)?)
    }

    /// Imports a profile. Its fingerprint (or, for a profile without one, its device name and
    /// cuDNN version) must be `local`'s unless `force`, in which case the measurements are
    /// stored as `local`'s. Returns the number of measurements stored.
    pub fn import(
        &self,
        profile: &Profile,
        local: &DeviceFingerprint,
        force: bool,
    ) -> Result<usize, CacheError> {
        profile.validate()?;
        if !force {
            match &profile.fingerprint {
                Some(theirs) if theirs != local => {
                    return Err(CacheError::ForeignDevice {
                        theirs: theirs.to_string(),
                        ours: local.to_string(),
                    })
                }
                Some(_) => {}
                None if profile.device == local.name
                    && profile.cudnn_version == local.cudnn_version => {}
                None => {
                    return Err(CacheError::UnknownDevice {
                        name: profile.device.clone(),
                    })
                }
            }
        }
        Ok(store::import(&self.conn, profile, local)?)
    }

    /// Deletes every measurement and plan (the schema stays).
    pub fn clear(&self) -> Result<(), CacheError> {
        Ok(store::clear(&self.conn)?)
    }
}

#[derive(Debug, thiserror::Error)]
enum OpenError {
    /// The file exists but is not a usable SQLite cache: move it aside.
    #[error("{0}")]
    Unusable(String),
    /// The location cannot be used at all (permissions, a newer schema): fall back to memory.
    #[error("{0}")]
    Location(String),
}

fn open_file(path: &Path) -> Result<Connection, OpenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| OpenError::Location(format!("cannot create {}: {e}", dir.display())))?;
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let mut conn = Connection::open_with_flags(path, flags).map_err(|e| classify(path, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| classify(path, e))?;
    // Switching to WAL needs a moment without other writers; retry while they are busy.
    let mut attempts = 0;
    loop {
        match conn.query_row("PRAGMA journal_mode = WAL", [], |row| {
            row.get::<_, String>(0)
        }) {
            Ok(_) => break,
            Err(e) if is_busy(&e) && attempts < 200 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(10 + 5 * attempts));
            }
            Err(e) => return Err(classify(path, e)),
        }
    }
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| classify(path, e))?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(|e| classify(path, e))?;
    schema::migrate(&mut conn).map_err(|e| match e {
        schema::SchemaError::Sqlite(e) => classify(path, e),
        too_new => OpenError::Location(too_new.to_string()),
    })?;
    // A damaged file can open and migrate yet fail on its pages: check before trusting it.
    let check: String = conn
        .query_row("PRAGMA quick_check", [], |row| row.get(0))
        .map_err(|e| classify(path, e))?;
    if check != "ok" {
        return Err(OpenError::Unusable(format!("integrity check: {check}")));
    }
    Ok(conn)
}

fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// Corruption means "move the file aside"; anything else (permissions, disk) means "use memory".
fn classify(path: &Path, error: rusqlite::Error) -> OpenError {
    use rusqlite::ErrorCode::*;
    match error.sqlite_error_code() {
        Some(NotADatabase | DatabaseCorrupt) => OpenError::Unusable(error.to_string()),
        Some(ReadOnly | CannotOpen | PermissionDenied) => {
            OpenError::Location(format!("{} cannot be written: {error}", path.display()))
        }
        _ => OpenError::Location(error.to_string()),
    }
}

/// Renames `path` (and its WAL files) to `path.corrupt-<unix seconds>`.
fn set_aside(path: &Path) -> std::io::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut target = path.as_os_str().to_owned();
    target.push(format!(".corrupt-{stamp}"));
    let target = PathBuf::from(target);
    std::fs::rename(path, &target)?;
    for suffix in ["-wal", "-shm"] {
        let mut side = path.as_os_str().to_owned();
        side.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(side));
    }
    Ok(target)
}

fn memory_connection() -> Connection {
    let mut conn =
        Connection::open_in_memory().expect("SQLite can always open an in-memory database");
    schema::migrate(&mut conn).expect("the schema applies to an empty in-memory database");
    conn
}
