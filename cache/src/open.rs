//! Opening a cache file without harming anything that is not ours.
//!
//! Before SQLite writes a single byte (even switching to WAL rewrites the header), the file is
//! identified from the outside: its SQLite header (mucudnn's `application_id`), else, for
//! caches written before the marker existed, its table names and `meta.schema_version`, read
//! through a read-only connection. Anything else is [`NotACache`] and is never opened for
//! writing, moved or migrated.
//!
//! A file that is ours is opened read-write, or read-only when it cannot be written (mode
//! bits, a read-only file system, `MUCUDNN_CACHE_READ_ONLY`). A damaged cache of ours is moved
//! aside by writers only, and what can still be read from it is salvaged into the fresh file
//! (see [`salvage`]).

use crate::schema::{self, APPLICATION_ID, SCHEMA_VERSION};
use rusqlite::{Connection, OpenFlags, MAIN_DB};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a writer waits for another process's transaction before giving up on one write.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// The tables and indexes a mucudnn cache may hold (any schema version).
const OUR_OBJECTS: &[&str] = &[
    "meta",
    "devices",
    "shapes",
    "measured_sizes",
    "measurements",
    "skipped",
    "seen",
    "plans",
    "seen_by_shape",
];

/// The file at `path` is not a mucudnn cache; it was left exactly as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is not a mucudnn cache ({why}); it was left untouched. Pass another --cache path (or set MUCUDNN_CACHE)", path.display())]
pub struct NotACache {
    pub path: PathBuf,
    pub why: String,
}

/// The cache at `path` cannot be opened because this process cannot open files now: it is
/// out of file descriptors (EMFILE, ENFILE) or memory (ENOMEM). That is not the cache's
/// problem, and an in-memory stand-in would hide it (every later cache of the process would
/// quietly keep nothing), so it is an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot open cache {}: {reason}; this process cannot open more files now (close some, or raise its limit: `ulimit -n`)", path.display())]
pub struct OutOfResources {
    pub path: PathBuf,
    pub reason: String,
}

/// Why [`crate::Cache::open`] failed: the only two ways it can.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenFailure {
    #[error(transparent)]
    NotACache(#[from] NotACache),
    #[error(transparent)]
    OutOfResources(#[from] OutOfResources),
}

impl OpenFailure {
    /// The cache path that could not be opened.
    pub fn path(&self) -> &Path {
        match self {
            OpenFailure::NotACache(e) => &e.path,
            OpenFailure::OutOfResources(e) => &e.path,
        }
    }
}

/// Whether `error` says the process is out of file descriptors or memory.
pub(crate) fn is_exhaustion(error: &std::io::Error) -> bool {
    const ENOMEM: i32 = 12;
    const ENFILE: i32 = 23;
    const EMFILE: i32 = 24;
    matches!(error.raw_os_error(), Some(ENOMEM | ENFILE | EMFILE))
}

/// Whether this process can open the files a cache needs now (a database, its WAL and its
/// shared-memory index: three descriptors): `Some(why)` when it cannot. Asked after an open
/// failed for a reason SQLite does not name (its "unable to open database file" is also what
/// running out of descriptors looks like), so that exhaustion is never taken for an unusable
/// location.
pub(crate) fn exhausted() -> Option<String> {
    let mut held = Vec::with_capacity(3);
    for _ in 0..3 {
        match std::fs::File::open("/dev/null") {
            Ok(file) => held.push(file),
            Err(e) if is_exhaustion(&e) => return Some(e.to_string()),
            // No /dev/null (not Unix): nothing to learn here.
            Err(_) => return None,
        }
    }
    None
}

/// What is at a cache path, judged without writing to it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Identity {
    /// Nothing, or an empty file / empty database: ours to create.
    New,
    /// A mucudnn cache (possibly damaged).
    Ours,
    /// Cannot be looked at (a directory, permissions): the caller falls back to memory.
    Unreachable(String),
}

/// What a path that exists is, when it is neither a regular file nor a directory: a FIFO, a
/// device, a socket. Opening one could block forever (a FIFO without a writer) or make SQLite
/// write beside it (`/dev/null-journal`), so it is refused before anything opens it.
fn special_file(path: &Path) -> Option<&'static str> {
    let kind = std::fs::metadata(path).ok()?.file_type();
    if kind.is_file() || kind.is_dir() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if kind.is_char_device() {
            return Some("a character device");
        }
        if kind.is_block_device() {
            return Some("a block device");
        }
        if kind.is_socket() {
            return Some("a socket");
        }
    }
    Some("a special file")
}

/// Identifies the file at `path` without modifying it.
pub(crate) fn identify(path: &Path) -> Result<Identity, OpenFailure> {
    let refuse = |why: String| {
        OpenFailure::from(NotACache {
            path: path.to_path_buf(),
            why,
        })
    };
    let out_of = |reason: String| {
        OpenFailure::from(OutOfResources {
            path: path.to_path_buf(),
            reason,
        })
    };
    // Before any open: a FIFO would block the open itself.
    if let Some(what) = special_file(path) {
        return Err(refuse(format!("it is {what}, not a regular file")));
    }
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Nothing there; a new cache needs descriptors too.
            return match exhausted() {
                Some(reason) => Err(out_of(reason)),
                None => Ok(Identity::New),
            };
        }
        Err(e) if is_exhaustion(&e) => return Err(out_of(e.to_string())),
        Err(e) => {
            return Ok(Identity::Unreachable(format!(
                "cannot read {}: {e}",
                path.display()
            )))
        }
    };
    match file.metadata() {
        Ok(meta) if meta.is_dir() => {
            return Ok(Identity::Unreachable(format!(
                "{} is a directory",
                path.display()
            )))
        }
        Ok(meta) if meta.len() == 0 => return Ok(Identity::New),
        Ok(_) => {}
        Err(e) => {
            return Ok(Identity::Unreachable(format!(
                "cannot read {}: {e}",
                path.display()
            )))
        }
    }
    let mut header = Vec::with_capacity(100);
    if let Err(e) = file.by_ref().take(100).read_to_end(&mut header) {
        return Ok(Identity::Unreachable(format!(
            "cannot read {}: {e}",
            path.display()
        )));
    }
    if header.len() < 100 || &header[..16] != b"SQLite format 3\0" {
        return Err(refuse("it is not an SQLite database".into()));
    }
    let application_id = u32::from_be_bytes([header[68], header[69], header[70], header[71]]);
    if application_id == APPLICATION_ID {
        return Ok(Identity::Ours);
    }
    if application_id != 0 {
        return Err(refuse(format!(
            "it is the SQLite database of another program (application id {application_id:#010x})"
        )));
    }
    // No marker: an empty database, a cache written before the marker, or someone else's.
    let conn = open_read_only(path).map_err(|e| match exhausted() {
        // Not the file's fault: nothing could be opened.
        Some(reason) => out_of(reason),
        None => refuse(format!(
            "an SQLite database without mucudnn's marker that cannot be read ({e})"
        )),
    })?;
    let objects: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY name")
        .and_then(|mut stmt| {
            stmt.query_map([], |row| row.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .map_err(|e| {
            refuse(format!(
                "an SQLite database without mucudnn's marker whose schema cannot be read ({e})"
            ))
        })?;
    if objects.is_empty() {
        return Ok(Identity::New);
    }
    let foreign: Vec<&str> = objects
        .iter()
        .map(String::as_str)
        .filter(|name| !OUR_OBJECTS.contains(name))
        .collect();
    if !foreign.is_empty() {
        return Err(refuse(format!(
            "it holds tables mucudnn does not use: {}",
            foreign.join(", ")
        )));
    }
    match schema::stored_version(&conn) {
        Ok(Some(_)) => Ok(Identity::Ours),
        Ok(None) => Err(refuse(
            "it has no mucudnn schema version in a `meta` table".into(),
        )),
        Err(e) => Err(refuse(format!("its `meta` table cannot be read ({e})"))),
    }
}

/// A read-only connection that never writes the file: not even its WAL index, when the
/// directory cannot hold one (then the file is read as immutable).
pub(crate) fn open_read_only(path: &Path) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let probe = |conn: &Connection| {
        conn.query_row("SELECT count(*) FROM sqlite_master", [], |row| {
            row.get::<_, i64>(0)
        })
    };
    // A WAL-mode file with no WAL beside it has nothing outside the file to read: read it as
    // immutable, so that no `-wal` or `-shm` file is left next to it.
    if wal_mode_without_wal(path) {
        let uri = format!("file:{}?immutable=1", uri_path(path));
        let immutable = Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI)
            .and_then(|conn| probe(&conn).map(|_| conn));
        match immutable {
            Ok(conn) => return Ok(conn),
            // Still no WAL: no writer came between, the file itself cannot be read (damaged).
            // Opening it normally would only leave `-wal` and `-shm` files beside it.
            Err(e) if wal_mode_without_wal(path) => return Err(e),
            // A writer may have started a WAL meanwhile: read it the ordinary way.
            Err(_) => {}
        }
    }
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    match probe(&conn) {
        Ok(_) => Ok(conn),
        Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::CannotOpen) => {
            // A WAL file in a directory we cannot write: no shared-memory index can be made.
            let uri = format!("file:{}?immutable=1", uri_path(path));
            let conn = Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI)?;
            probe(&conn)?;
            Ok(conn)
        }
        Err(e) => Err(e),
    }
}

/// The file's header says WAL mode (bytes 18 and 19 are 2) and there is no non-empty `-wal`.
fn wal_mode_without_wal(path: &Path) -> bool {
    let mut header = [0u8; 20];
    let wal_header = std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .is_ok()
        && header[18] == 2
        && header[19] == 2;
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_empty = std::fs::metadata(PathBuf::from(wal)).map_or(true, |m| m.len() == 0);
    wal_header && wal_empty
}

/// `path` percent-encoded for an SQLite `file:` URI.
fn uri_path(path: &Path) -> String {
    let mut out = String::new();
    for byte in path.as_os_str().as_encoded_bytes() {
        match byte {
            b'?' | b'#' | b'%' | 0..=0x20 | 0x7f.. => out.push_str(&format!("%{byte:02X}")),
            _ => out.push(*byte as char),
        }
    }
    out
}

/// Why a file of ours could not be opened read-write.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    /// The file is damaged: a writer moves it aside (and salvages what it can).
    #[error("{0}")]
    Unusable(String),
    /// The file cannot be written: open it read-only.
    #[error("{0}")]
    ReadOnly(String),
    /// The location cannot be used at all (no directory, a newer schema): use memory.
    #[error("{0}")]
    Location(String),
}

/// Opens (creating if needed) a cache of ours read-write, migrated and checked.
pub(crate) fn open_read_write(path: &Path) -> Result<Connection, OpenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| OpenError::Location(format!("cannot create {}: {e}", dir.display())))?;
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let mut conn = Connection::open_with_flags(path, flags).map_err(|e| classify(path, e))?;
    // SQLite quietly opens a file it may not write read-only.
    if conn.is_readonly(MAIN_DB).unwrap_or(false) {
        return Err(OpenError::ReadOnly(format!(
            "{} cannot be written",
            path.display()
        )));
    }
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
        other => OpenError::Location(other.to_string()),
    })?;
    // A damaged file can open and migrate yet fail on its pages: check before trusting it.
    quick_check(&conn).map_err(|e| match e {
        CheckError::Sqlite(e) => classify(path, e),
        CheckError::Damaged(report) => OpenError::Unusable(format!("integrity check: {report}")),
    })?;
    Ok(conn)
}

/// Opens a cache of ours read-only. `Ok(None)`: there is nothing to read (no tables yet).
pub(crate) fn open_existing_read_only(path: &Path) -> Result<Option<Connection>, OpenError> {
    let conn = open_read_only(path).map_err(|e| classify(path, e))?;
    let version = schema::stored_version(&conn).map_err(|e| classify(path, e))?;
    match version {
        None => Ok(None),
        Some(v) if v > SCHEMA_VERSION => Err(OpenError::Location(
            schema::SchemaError::TooNew { found: v }.to_string(),
        )),
        Some(v) if v < SCHEMA_VERSION => Err(OpenError::Location(format!(
            "{} has schema version {v}; a command that writes the cache upgrades it to {SCHEMA_VERSION}",
            path.display()
        ))),
        Some(_) => {
            quick_check(&conn).map_err(|e| match e {
                CheckError::Sqlite(e) => classify(path, e),
                CheckError::Damaged(report) => {
                    OpenError::Unusable(format!("integrity check: {report}"))
                }
            })?;
            Ok(Some(conn))
        }
    }
}

enum CheckError {
    Sqlite(rusqlite::Error),
    Damaged(String),
}

fn quick_check(conn: &Connection) -> Result<(), CheckError> {
    let check: String = conn
        .query_row("PRAGMA quick_check", [], |row| row.get(0))
        .map_err(CheckError::Sqlite)?;
    if check == "ok" {
        Ok(())
    } else {
        Err(CheckError::Damaged(check))
    }
}

fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// Corruption means "move the file aside"; no write permission means "read it only"; anything
/// else (no directory, a full disk) means "use memory".
fn classify(path: &Path, error: rusqlite::Error) -> OpenError {
    use rusqlite::ErrorCode::*;
    match error.sqlite_error_code() {
        Some(NotADatabase | DatabaseCorrupt) => OpenError::Unusable(error.to_string()),
        Some(ReadOnly | PermissionDenied) if path.exists() => {
            OpenError::ReadOnly(format!("{} cannot be written: {error}", path.display()))
        }
        Some(ReadOnly | CannotOpen | PermissionDenied) => {
            OpenError::Location(format!("{} cannot be written: {error}", path.display()))
        }
        _ => OpenError::Location(error.to_string()),
    }
}

/// Renames `path` and its WAL files to `path.corrupt-<unix seconds>` (and `-wal`, `-shm`), so
/// that committed transactions still in the WAL stay readable for salvage and inspection.
pub(crate) fn set_aside(path: &Path) -> std::io::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let with = |base: &Path, suffix: &str| {
        let mut name = base.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    let mut target = with(path, &format!(".corrupt-{stamp}"));
    let mut extra = 1;
    while target.exists() {
        target = with(path, &format!(".corrupt-{stamp}-{extra}"));
        extra += 1;
    }
    std::fs::rename(path, &target)?;
    for suffix in ["-wal", "-shm"] {
        let side = with(path, suffix);
        if side.exists() && std::fs::rename(&side, with(&target, suffix)).is_err() {
            let _ = std::fs::remove_file(side);
        }
    }
    Ok(target)
}

/// What salvaging a damaged cache kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Salvage {
    /// Where the damaged file was moved.
    pub moved_to: PathBuf,
    /// Rows copied into the fresh cache, per table, in copy order.
    pub rows_kept: Vec<(&'static str, usize)>,
    /// Rows read but refused by the fresh cache (they referenced a lost device or shape, or
    /// held values of the wrong type).
    pub rows_refused: usize,
    /// Tables (or parts of them) that could not be read.
    pub unreadable: Vec<String>,
}

impl Salvage {
    pub fn total_kept(&self) -> usize {
        self.rows_kept.iter().map(|(_, n)| n).sum()
    }

    /// Measurement rows kept.
    pub fn measurements_kept(&self) -> usize {
        self.rows_kept
            .iter()
            .find(|(table, _)| *table == "measurements")
            .map_or(0, |(_, n)| *n)
    }
}

/// How the rows of a table that a scan could not pass are reached one key at a time.
#[derive(Clone, Copy)]
enum Probe {
    /// By rowid (`id`), for every id up to the largest one read.
    Rowid,
    /// By (device_id, shape_id) prefix, for every device and shape salvaged.
    DeviceShape,
    /// Scans only.
    None,
}

/// Tables in dependency order, with the columns that order their rows (the primary key) and
/// how to reach rows past a damaged page.
const SALVAGE_TABLES: &[(&str, &str, Probe)] = &[
    ("devices", "id", Probe::Rowid),
    ("shapes", "id", Probe::Rowid),
    (
        "measured_sizes",
        "device_id, shape_id, op, split, micro, kind",
        Probe::DeviceShape,
    ),
    (
        "measurements",
        "device_id, shape_id, op, split, micro, algo, engine",
        Probe::DeviceShape,
    ),
    (
        "skipped",
        "device_id, shape_id, op, split, micro, algo, engine",
        Probe::DeviceShape,
    ),
    ("seen", "device_id, layer, shape_id, n, op", Probe::None),
    (
        "plans",
        "device_id, shape_id, n, op, policy, candidates, mode, limit_bytes, context",
        Probe::DeviceShape,
    ),
];

/// Copies what can be read of the damaged cache at `old` into `fresh`, table by table and row
/// by row (SQLite's `.recover` idea, within SQL): each table is scanned forwards until the
/// first unreadable row, then backwards from its end; when a scan stopped early, the rows in
/// between are looked up one key (rowid, or device and shape) at a time, so a damaged page
/// costs the rows on that page, not the file. Rows that break the fresh schema (a lost device
/// or shape) are refused.
pub(crate) fn salvage(old: &Path, fresh: &Connection, moved_to: PathBuf) -> Salvage {
    let mut report = Salvage {
        moved_to,
        ..Salvage::default()
    };
    let source = match open_read_only(old) {
        Ok(conn) => conn,
        Err(e) => {
            report.unreadable.push(format!("the whole file ({e})"));
            return report;
        }
    };
    if !matches!(schema::stored_version(&source), Ok(Some(SCHEMA_VERSION))) {
        report.unreadable.push(format!(
            "the whole file (its schema is not version {SCHEMA_VERSION})"
        ));
        return report;
    }
    for &(table, order, probe) in SALVAGE_TABLES {
        let kept = salvage_table(&source, fresh, table, order, probe, &mut report);
        report.rows_kept.push((table, kept));
    }
    report
}

fn ids(conn: &Connection, table: &str) -> Vec<i64> {
    conn.prepare(&format!("SELECT id FROM {table} ORDER BY id"))
        .and_then(|mut stmt| {
            stmt.query_map([], |row| row.get::<_, i64>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()
        })
        .unwrap_or_default()
}

fn salvage_table(
    source: &Connection,
    fresh: &Connection,
    table: &str,
    order: &str,
    probe: Probe,
    report: &mut Salvage,
) -> usize {
    // Table and column names are this crate's constants, never input; values are parameters.
    let columns: Vec<String> = match fresh
        .prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))
        .and_then(|mut stmt| {
            stmt.query_map([], |row| row.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()
        }) {
        Ok(columns) if !columns.is_empty() => columns,
        _ => return 0,
    };
    let list = columns.join(", ");
    let placeholders = (1..=columns.len())
        .map(|i| format!("?{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    let insert_sql = format!("INSERT OR IGNORE INTO {table} ({list}) VALUES ({placeholders})");
    let descending = order
        .split(", ")
        .map(|c| format!("{c} DESC"))
        .collect::<Vec<_>>()
        .join(", ");
    let Ok(tx) = fresh.unchecked_transaction() else {
        return 0;
    };
    let mut kept = 0;
    let mut refused = 0;
    // Copies the rows `select` returns with `params` until the first error.
    let mut copy = |select: &str, params: &[i64]| -> rusqlite::Result<()> {
        let mut insert = tx.prepare_cached(&insert_sql)?;
        let mut stmt = source.prepare_cached(select)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
        while let Some(row) = rows.next()? {
            let values = (0..columns.len())
                .map(|i| row.get::<_, rusqlite::types::Value>(i))
                .collect::<rusqlite::Result<Vec<_>>>()?;
            match insert.execute(rusqlite::params_from_iter(values)) {
                Ok(1) => kept += 1,
                Ok(_) => {} // already copied
                Err(_) => refused += 1,
            }
        }
        Ok(())
    };
    let forward = copy(&format!("SELECT {list} FROM {table} ORDER BY {order}"), &[]);
    if let Err(e) = forward {
        report.unreadable.push(format!("part of {table} ({e})"));
        let _ = copy(
            &format!("SELECT {list} FROM {table} ORDER BY {descending}"),
            &[],
        );
        let mut failed_probes = 0;
        match probe {
            Probe::Rowid => {
                let largest = ids(&tx, table).last().copied().unwrap_or(0);
                for id in 1..=largest {
                    let select = format!("SELECT {list} FROM {table} WHERE id = ?1");
                    failed_probes += usize::from(copy(&select, &[id]).is_err());
                }
            }
            Probe::DeviceShape => {
                let select = format!(
                    "SELECT {list} FROM {table} WHERE device_id = ?1 AND shape_id = ?2 ORDER BY {order}"
                );
                for device in ids(&tx, "devices") {
                    for shape in ids(&tx, "shapes") {
                        failed_probes += usize::from(copy(&select, &[device, shape]).is_err());
                    }
                }
            }
            Probe::None => {}
        }
        if failed_probes > 0 {
            report
                .unreadable
                .push(format!("{failed_probes} key lookups in {table}"));
        }
    }
    report.rows_refused += refused;
    match tx.commit() {
        Ok(()) => kept,
        Err(e) => {
            report
                .unreadable
                .push(format!("{table}: the copy failed ({e})"));
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_paths_escape_what_a_uri_would_misread() {
        assert_eq!(
            uri_path(Path::new("/tmp/a b?c#d%e")),
            "/tmp/a%20b%3Fc%23d%25e"
        );
    }
}
