//! The cache's SQLite schema and its migrations.
//!
//! `meta.schema_version` says which version a file has; [`migrate`] brings any older file up to
//! [`SCHEMA_VERSION`] inside one immediate transaction, so concurrent openers serialise on it
//! and each migration runs once. A file from a newer mucudnn is refused (the caller falls back to
//! memory rather than damage it), and so is a database that holds tables but no version (it is
//! not ours). Every file written is marked with [`APPLICATION_ID`] in its SQLite header.
//!
//! Layout: a measurement belongs to a device, a convolution *shape* (every problem field except
//! the batch size), an op, a split (`batch`, or `spatial`: the size is then a chunk's rows along
//! the output's outermost spatial axis, at the problem's batch) and the micro-batch size it was
//! timed at: a micro-batch of 32 costs
//! the same whether it is part of a batch of 64 or 256, so one measurement serves every
//! mini-batch. `measured_sizes` records that a (device, shape, op, micro) was measured, so an
//! algorithm-free size is told apart from one never measured. `seen` remembers the named
//! problems (with their batch size) that were tuned, for listing and export. Plans are keyed by
//! device, the full problem, op, policy and constraint.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

/// The schema this build reads and writes.
pub const SCHEMA_VERSION: i64 = 6;

/// SQLite's `application_id` header field in every cache this build writes ("muCD"): a file
/// is recognised as mucudnn's before anything is written to it.
pub const APPLICATION_ID: u32 = 0x6D75_4344;

const V1: &str = "
CREATE TABLE IF NOT EXISTS devices (
    id INTEGER PRIMARY KEY,
    backend TEXT NOT NULL,
    name TEXT NOT NULL,
    cc_major INTEGER,
    cc_minor INTEGER,
    driver_version INTEGER,
    cudnn_version INTEGER,
    -- every field above, canonically joined: NULL-safe uniqueness
    fingerprint TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS shapes (
    id INTEGER PRIMARY KEY,
    c INTEGER NOT NULL, h INTEGER NOT NULL, w INTEGER NOT NULL,
    k INTEGER NOT NULL, r INTEGER NOT NULL, s INTEGER NOT NULL,
    pad_h INTEGER NOT NULL, pad_w INTEGER NOT NULL,
    stride_h INTEGER NOT NULL, stride_w INTEGER NOT NULL,
    dilation_h INTEGER NOT NULL, dilation_w INTEGER NOT NULL,
    groups INTEGER NOT NULL,
    dtype TEXT NOT NULL, layout TEXT NOT NULL, math TEXT NOT NULL,
    UNIQUE (c, h, w, k, r, s, pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w,
            groups, dtype, layout, math)
);
CREATE TABLE IF NOT EXISTS measured_sizes (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    micro INTEGER NOT NULL,
    measured_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, micro)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS measurements (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    micro INTEGER NOT NULL,
    algo INTEGER NOT NULL,
    time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, micro, algo)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seen (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    layer TEXT NOT NULL,
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    n INTEGER NOT NULL,
    op TEXT NOT NULL,
    last_used INTEGER NOT NULL,
    -- tuning order, for listing and export
    seq INTEGER NOT NULL,
    PRIMARY KEY (device_id, layer, shape_id, n, op)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS plans (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    n INTEGER NOT NULL,
    op TEXT NOT NULL,
    policy TEXT NOT NULL,
    mode TEXT NOT NULL,
    limit_bytes INTEGER NOT NULL,
    -- for workspace division: a digest of every (problem, op) solved together; '' for reuse
    context TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, n, op, policy, mode, limit_bytes, context)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_by_shape ON seen (device_id, shape_id, op);
";

/// Version 2: candidates are legacy algorithms or graph-API engine configurations. A
/// measurement's key gains `engine` (the configuration's name; '' for a legacy algorithm,
/// whose `algo` is then its number; `algo` is -1 for an engine), and a measured size is
/// recorded per candidate `kind` ('legacy' or 'engine'), since either set can be measured
/// without the other. Version-1 rows are all legacy and are kept. A plan's key gains the
/// candidate set it was chosen from; version-1 plans are dropped (they are re-solved from the
/// kept measurements in microseconds).
const V2: &str = "
CREATE TABLE measured_sizes_v2 (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    micro INTEGER NOT NULL,
    kind TEXT NOT NULL,
    measured_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, micro, kind)
) WITHOUT ROWID;
INSERT INTO measured_sizes_v2 (device_id, shape_id, op, micro, kind, measured_at)
    SELECT device_id, shape_id, op, micro, 'legacy', measured_at FROM measured_sizes;
DROP TABLE measured_sizes;
ALTER TABLE measured_sizes_v2 RENAME TO measured_sizes;
CREATE TABLE measurements_v2 (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    micro INTEGER NOT NULL,
    algo INTEGER NOT NULL,
    engine TEXT NOT NULL,
    time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, micro, algo, engine)
) WITHOUT ROWID;
INSERT INTO measurements_v2 (device_id, shape_id, op, micro, algo, engine, time_ms, workspace_bytes)
    SELECT device_id, shape_id, op, micro, algo, '', time_ms, workspace_bytes FROM measurements;
DROP TABLE measurements;
ALTER TABLE measurements_v2 RENAME TO measurements;
DROP TABLE plans;
CREATE TABLE plans (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    n INTEGER NOT NULL,
    op TEXT NOT NULL,
    policy TEXT NOT NULL,
    -- the candidate set the plan was chosen from: legacy, engines or all
    candidates TEXT NOT NULL,
    mode TEXT NOT NULL,
    limit_bytes INTEGER NOT NULL,
    context TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, n, op, policy, candidates, mode, limit_bytes, context)
) WITHOUT ROWID;
";

/// Version 3: measuring under a workspace limit does not time a candidate
/// whose workspace exceeds it. `skipped` records those candidates, with their workspace and no
/// time, at a size whose `measured_sizes` row says it was measured: the size is complete for
/// every limit below each skipped workspace, and a tune under a larger limit times exactly the
/// skipped candidates that fit it. Older caches have no skipped rows: their sizes were measured
/// without a limit and are complete for every limit.
const V3: &str = "
CREATE TABLE IF NOT EXISTS skipped (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    micro INTEGER NOT NULL,
    -- as in measurements: a legacy algorithm's number and '', or -1 and an engine's name
    algo INTEGER NOT NULL,
    engine TEXT NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, micro, algo, engine)
) WITHOUT ROWID;
";

/// Version 4: shapes of 1, 2 or 3 spatial dimensions. A shape gains the depth
/// fields `d`, `t`, `pad_d`, `stride_d` and `dilation_d`, part of its uniqueness; the rows of
/// older caches are 2-D and take the 2-D values (1, 1, 0, 1, 1), keeping their ids, so every
/// measurement, plan and `seen` row stays attached to its shape. SQLite cannot change a
/// table's UNIQUE constraint, so the table is rebuilt inside the migration's transaction
/// (SQLite's documented procedure: foreign keys off around the transaction, checked with
/// `foreign_key_check` before the commit).
const V4: &str = "
CREATE TABLE shapes_v4 (
    id INTEGER PRIMARY KEY,
    c INTEGER NOT NULL, d INTEGER NOT NULL DEFAULT 1, h INTEGER NOT NULL, w INTEGER NOT NULL,
    k INTEGER NOT NULL, t INTEGER NOT NULL DEFAULT 1, r INTEGER NOT NULL, s INTEGER NOT NULL,
    pad_d INTEGER NOT NULL DEFAULT 0, pad_h INTEGER NOT NULL, pad_w INTEGER NOT NULL,
    stride_d INTEGER NOT NULL DEFAULT 1, stride_h INTEGER NOT NULL, stride_w INTEGER NOT NULL,
    dilation_d INTEGER NOT NULL DEFAULT 1, dilation_h INTEGER NOT NULL,
    dilation_w INTEGER NOT NULL,
    groups INTEGER NOT NULL,
    dtype TEXT NOT NULL, layout TEXT NOT NULL, math TEXT NOT NULL,
    UNIQUE (c, d, h, w, k, t, r, s, pad_d, pad_h, pad_w, stride_d, stride_h, stride_w,
            dilation_d, dilation_h, dilation_w, groups, dtype, layout, math)
);
INSERT INTO shapes_v4 (id, c, h, w, k, r, s, pad_h, pad_w, stride_h, stride_w, dilation_h,
                       dilation_w, groups, dtype, layout, math)
    SELECT id, c, h, w, k, r, s, pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w,
           groups, dtype, layout, math FROM shapes;
DROP TABLE shapes;
ALTER TABLE shapes_v4 RENAME TO shapes;
";

/// Version 5: the split dimension. Measurements, measured sizes and skipped
/// candidates gain `split` ('batch' or 'spatial') in their key: a spatial row's `micro` is a
/// chunk's rows along the op's output's outermost spatial axis, not a number of samples, so it
/// never answers a batch lookup. Older rows are batch rows. SQLite cannot change a primary
/// key, so the three tables are rebuilt, rows copied.
const V5: &str = "
CREATE TABLE measured_sizes_v5 (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    split TEXT NOT NULL DEFAULT 'batch',
    micro INTEGER NOT NULL,
    kind TEXT NOT NULL,
    measured_at INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, split, micro, kind)
) WITHOUT ROWID;
INSERT INTO measured_sizes_v5 (device_id, shape_id, op, micro, kind, measured_at)
    SELECT device_id, shape_id, op, micro, kind, measured_at FROM measured_sizes;
DROP TABLE measured_sizes;
ALTER TABLE measured_sizes_v5 RENAME TO measured_sizes;
CREATE TABLE measurements_v5 (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    split TEXT NOT NULL DEFAULT 'batch',
    micro INTEGER NOT NULL,
    algo INTEGER NOT NULL,
    engine TEXT NOT NULL,
    time_ms REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, split, micro, algo, engine)
) WITHOUT ROWID;
INSERT INTO measurements_v5 (device_id, shape_id, op, micro, algo, engine, time_ms, workspace_bytes)
    SELECT device_id, shape_id, op, micro, algo, engine, time_ms, workspace_bytes FROM measurements;
DROP TABLE measurements;
ALTER TABLE measurements_v5 RENAME TO measurements;
CREATE TABLE skipped_v5 (
    device_id INTEGER NOT NULL REFERENCES devices(id),
    shape_id INTEGER NOT NULL REFERENCES shapes(id),
    op TEXT NOT NULL,
    split TEXT NOT NULL DEFAULT 'batch',
    micro INTEGER NOT NULL,
    algo INTEGER NOT NULL,
    engine TEXT NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    PRIMARY KEY (device_id, shape_id, op, split, micro, algo, engine)
) WITHOUT ROWID;
INSERT INTO skipped_v5 (device_id, shape_id, op, micro, algo, engine, workspace_bytes)
    SELECT device_id, shape_id, op, micro, algo, engine, workspace_bytes FROM skipped;
DROP TABLE skipped;
ALTER TABLE skipped_v5 RENAME TO skipped;
";

/// Version 6: verified tuning. A measurement row gains how its output compared with the
/// reference candidate's (`max_rel_error`, `tolerance`: NULL when not compared) and whether it
/// was `rejected` for it (over its tolerance: kept to say why, never read as a measurement). A
/// measured size gains its `verification`: 'verified' (measured with verification),
/// 'unverified' (measured without: a tune that verifies measures it again) or 'imported' (from a
/// profile without errors: used as it is). Older sizes were measured before mucudnn verified:
/// they are 'unverified', and a verifying tune verifies them on their next measurement. New
/// columns only, so no table is rebuilt.
const V6: &str = "
ALTER TABLE measurements ADD COLUMN max_rel_error REAL;
ALTER TABLE measurements ADD COLUMN tolerance REAL;
ALTER TABLE measurements ADD COLUMN rejected INTEGER NOT NULL DEFAULT 0;
ALTER TABLE measured_sizes ADD COLUMN verification TEXT NOT NULL DEFAULT 'unverified';
";

/// Why a file cannot be used as a cache.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("the cache file has schema version {found}; this build reads up to {SCHEMA_VERSION}")]
    TooNew { found: i64 },
    /// The database holds tables but no mucudnn schema version: someone else's file.
    #[error("the database is not a mucudnn cache (it has tables but no mucudnn schema version)")]
    Foreign,
}

/// The schema version recorded in `conn`'s `meta` table; `None` when there is none (no
/// `meta` table or no version row).
pub fn stored_version(conn: &Connection) -> rusqlite::Result<Option<i64>> {
    let has_meta: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta')",
        [],
        |row| row.get(0),
    )?;
    if !has_meta {
        return Ok(None);
    }
    Ok(conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'schema_version'",
            [],
            |row| row.get::<_, String>(0),
        )
        .optional()?
        .and_then(|v| v.parse().ok()))
}

/// Creates or upgrades the schema. Safe to call from many processes at once. A database with
/// tables but no mucudnn schema version is refused untouched ([`SchemaError::Foreign`]): the
/// caller identifies files before opening them for writing, and this re-checks it inside the
/// transaction, so no race can make a migration run on someone else's tables.
pub fn migrate(conn: &mut Connection) -> Result<(), SchemaError> {
    // Version 4 rebuilds `shapes`, which other tables reference: SQLite's procedure for that
    // turns foreign keys off around the transaction (the pragma is a no-op inside one).
    let foreign_keys: bool = conn.query_row("PRAGMA foreign_keys", [], |row| row.get(0))?;
    if foreign_keys {
        conn.pragma_update(None, "foreign_keys", "OFF")?;
    }
    let result = migrate_in_transaction(conn);
    if foreign_keys {
        conn.pragma_update(None, "foreign_keys", "ON")?;
    }
    result
}

fn migrate_in_transaction(conn: &mut Connection) -> Result<(), SchemaError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let found = match stored_version(&tx)? {
        Some(version) => version,
        None => {
            let tables: i64 = tx.query_row(
                "SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'",
                [],
                |row| row.get(0),
            )?;
            if tables > 0 {
                return Err(SchemaError::Foreign);
            }
            0
        }
    };
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);",
    )?;
    if found > SCHEMA_VERSION {
        return Err(SchemaError::TooNew { found });
    }
    // One arm per version step, applied in order.
    if found < 1 {
        tx.execute_batch(V1)?;
    }
    if found < 2 {
        tx.execute_batch(V2)?;
    }
    if found < 3 {
        tx.execute_batch(V3)?;
    }
    if found < 4 {
        tx.execute_batch(V4)?;
        let dangling: i64 =
            tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |row| {
                row.get(0)
            })?;
        if dangling > 0 {
            return Err(SchemaError::Sqlite(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY),
                Some(format!(
                    "{dangling} rows lost their shape while the shapes table was rebuilt"
                )),
            )));
        }
    }
    if found < 5 {
        tx.execute_batch(V5)?;
    }
    if found < 6 {
        tx.execute_batch(V6)?;
    }
    tx.execute(
        "INSERT INTO meta (key, value) VALUES ('schema_version', ?1)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [SCHEMA_VERSION.to_string()],
    )?;
    // Marks the file as mucudnn's (older caches gain the marker on their next open).
    let application_id: u32 = tx.query_row("PRAGMA application_id", [], |row| row.get(0))?;
    if application_id != APPLICATION_ID {
        tx.execute_batch(&format!("PRAGMA application_id = {APPLICATION_ID}"))?;
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrate_is_idempotent_and_records_the_version() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        migrate(&mut conn).unwrap();
        let version: String = conn
            .query_row(
                "SELECT value FROM meta WHERE key = 'schema_version'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION.to_string());
    }

    #[test]
    fn version_1_rows_survive_the_upgrade_as_legacy() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(V1).unwrap();
        conn.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO meta VALUES ('schema_version', '1');
             INSERT INTO devices VALUES (1, 'cuda', 'gpu', 9, 0, 13000, 91900, 'gpu');
             INSERT INTO shapes VALUES (1, 8, 9, 9, 8, 3, 3, 0, 0, 1, 1, 1, 1, 1, 'fp32', 'nchw', 'default');
             INSERT INTO measured_sizes VALUES (1, 1, 'fwd', 4, 100);
             INSERT INTO measurements VALUES (1, 1, 'fwd', 4, 6, 0.5, 1024);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        let row: (i64, String, f64, i64) = conn
            .query_row(
                "SELECT algo, engine, time_ms, workspace_bytes FROM measurements",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(row, (6, String::new(), 0.5, 1024));
        let kind: String = conn
            .query_row("SELECT kind FROM measured_sizes WHERE micro = 4", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(kind, "legacy");
    }

    #[test]
    fn version_2_measurements_stay_complete_after_the_upgrade() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(V1).unwrap();
        conn.execute_batch(V2).unwrap();
        conn.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO meta VALUES ('schema_version', '2');
             INSERT INTO devices VALUES (1, 'cpu', 'cpu', NULL, NULL, NULL, NULL, 'cpu');
             INSERT INTO shapes VALUES (1, 8, 9, 9, 8, 3, 3, 0, 0, 1, 1, 1, 1, 1, 'fp32', 'nchw', 'default');
             INSERT INTO measured_sizes VALUES (1, 1, 'fwd', 4, 'legacy', 100);
             INSERT INTO measurements VALUES (1, 1, 'fwd', 4, 6, '', 0.5, 1024);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        let version: String = conn
            .query_row(
                "SELECT value FROM meta WHERE key = 'schema_version'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION.to_string());
        let kept: i64 = conn
            .query_row("SELECT count(*) FROM measurements", [], |r| r.get(0))
            .unwrap();
        let skipped: i64 = conn
            .query_row("SELECT count(*) FROM skipped", [], |r| r.get(0))
            .unwrap();
        assert_eq!((kept, skipped), (1, 0));
    }

    #[test]
    fn version_4_rows_become_batch_rows() {
        let mut conn = Connection::open_in_memory().unwrap();
        for sql in [V1, V2, V3, V4] {
            conn.execute_batch(sql).unwrap();
        }
        conn.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO meta VALUES ('schema_version', '4');
             INSERT INTO devices VALUES (1, 'cpu', 'cpu', NULL, NULL, NULL, NULL, 'cpu');
             INSERT INTO shapes (id, c, h, w, k, r, s, pad_h, pad_w, stride_h, stride_w,
                                 dilation_h, dilation_w, groups, dtype, layout, math)
                 VALUES (1, 8, 9, 9, 8, 3, 3, 0, 0, 1, 1, 1, 1, 1, 'fp32', 'nchw', 'default');
             INSERT INTO measured_sizes VALUES (1, 1, 'fwd', 4, 'legacy', 100);
             INSERT INTO measurements VALUES (1, 1, 'fwd', 4, 6, '', 0.5, 1024);
             INSERT INTO skipped VALUES (1, 1, 'fwd', 4, 7, '', 4096);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        let stored_version = stored_version(&conn).unwrap();
        assert_eq!(stored_version, Some(SCHEMA_VERSION));
        let measurement: (String, i64, i64, String, f64, i64) = conn
            .query_row(
                "SELECT split, micro, algo, engine, time_ms, workspace_bytes FROM measurements",
                [],
                |r| {
                    Ok((
                        r.get(0)?,
                        r.get(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                    ))
                },
            )
            .unwrap();
        assert_eq!(
            measurement,
            ("batch".into(), 4, 6, String::new(), 0.5, 1024)
        );
        let size: (String, i64, String) = conn
            .query_row("SELECT split, micro, kind FROM measured_sizes", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .unwrap();
        assert_eq!(size, ("batch".into(), 4, "legacy".into()));
        let skipped: (String, i64, i64) = conn
            .query_row(
                "SELECT split, algo, workspace_bytes FROM skipped",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(skipped, ("batch".into(), 7, 4096));
        // The split is part of the key: a spatial row of the same size is another row.
        conn.execute(
            "INSERT INTO measurements (device_id, shape_id, op, split, micro, algo, engine,
                                       time_ms, workspace_bytes)
             VALUES (1, 1, 'fwd', 'spatial', 4, 6, '', 0.25, 0)",
            [],
        )
        .unwrap();
        let rows: i64 = conn
            .query_row("SELECT count(*) FROM measurements", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows, 2);
    }

    #[test]
    fn version_5_sizes_become_unverified() {
        let mut conn = Connection::open_in_memory().unwrap();
        for sql in [V1, V2, V3, V4, V5] {
            conn.execute_batch(sql).unwrap();
        }
        conn.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO meta VALUES ('schema_version', '5');
             INSERT INTO devices VALUES (1, 'cpu', 'cpu', NULL, NULL, NULL, NULL, 'cpu');
             INSERT INTO shapes (id, c, h, w, k, r, s, pad_h, pad_w, stride_h, stride_w,
                                 dilation_h, dilation_w, groups, dtype, layout, math)
                 VALUES (1, 8, 9, 9, 8, 3, 3, 0, 0, 1, 1, 1, 1, 1, 'fp32', 'nchw', 'default');
             INSERT INTO measured_sizes VALUES (1, 1, 'fwd', 'batch', 4, 'legacy', 100);
             INSERT INTO measurements VALUES (1, 1, 'fwd', 'batch', 4, 6, '', 0.5, 1024);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        assert_eq!(stored_version(&conn).unwrap(), Some(SCHEMA_VERSION));
        let row: (f64, Option<f64>, Option<f64>, i64) = conn
            .query_row(
                "SELECT time_ms, max_rel_error, tolerance, rejected FROM measurements",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(row, (0.5, None, None, 0));
        let state: String = conn
            .query_row("SELECT verification FROM measured_sizes", [], |r| r.get(0))
            .unwrap();
        assert_eq!(state, "unverified");
        // An infinite error (an output with NaN) is a REAL SQLite keeps.
        conn.execute(
            "UPDATE measurements SET max_rel_error = ?1, tolerance = 1e-5, rejected = 1",
            [f64::INFINITY],
        )
        .unwrap();
        let error: f64 = conn
            .query_row("SELECT max_rel_error FROM measurements", [], |r| r.get(0))
            .unwrap();
        assert_eq!(error, f64::INFINITY);
    }

    #[test]
    fn a_newer_file_is_refused() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        conn.execute(
            "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
        assert!(matches!(
            migrate(&mut conn),
            Err(SchemaError::TooNew { found: 99 })
        ));
    }

    #[test]
    fn another_programs_tables_are_refused_and_kept() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "CREATE TABLE plans (id INTEGER PRIMARY KEY, what TEXT);
             INSERT INTO plans (what) VALUES ('world domination');",
        )
        .unwrap();
        assert!(matches!(migrate(&mut conn), Err(SchemaError::Foreign)));
        let kept: String = conn
            .query_row("SELECT what FROM plans", [], |r| r.get(0))
            .unwrap();
        assert_eq!(kept, "world domination");
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tables, 1, "nothing was added");
    }

    #[test]
    fn migrate_marks_the_file_as_ours() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        let id: u32 = conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .unwrap();
        assert_eq!(id, APPLICATION_ID);
    }
}
