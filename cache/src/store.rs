//! The cache's queries. Every statement is parameterised and cached (`prepare_cached`); writes
//! run in immediate transactions so that concurrent writers queue on the busy timeout instead
//! of failing halfway. Lookups never create rows.

use mucudnn_solver::{
    Algo, AlgoKind, BackendKind, CandidateSet, ConvOp, ConvProblem, DType, DeviceFingerprint,
    EngineName, Layout, MathMode, MeasureKey, Measured, Measurement, Mode, OpKey, OpProfile, Plan,
    Policy, Profile, RecordCheck, SizeVerification, SizesKey, Skipped, SplitDim, Verification,
};
use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};
use std::collections::{BTreeMap, HashMap, HashSet};

type Result<T> = rusqlite::Result<T>;

/// What a cached plan was solved for, besides its problem and op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanKey {
    pub policy: Policy,
    /// The candidates the plan was chosen from.
    pub candidates: CandidateSet,
    pub mode: Mode,
    /// For workspace division: a digest of every (problem, op) solved together (the plan
    /// depends on them); empty for workspace reuse.
    pub context: String,
}

impl PlanKey {
    /// The key of a workspace-reuse plan.
    pub fn reuse(policy: Policy, candidates: CandidateSet, workspace_limit_bytes: u64) -> Self {
        PlanKey {
            policy,
            candidates,
            mode: Mode::WorkspaceReuse {
                workspace_limit_bytes,
            },
            context: String::new(),
        }
    }

    fn mode_and_limit(&self) -> (&'static str, i64) {
        match self.mode {
            Mode::WorkspaceReuse {
                workspace_limit_bytes,
            } => ("wr", clamp(workspace_limit_bytes)),
            Mode::WorkspaceDivision {
                total_workspace_bytes,
            } => ("wd", clamp(total_workspace_bytes)),
        }
    }
}

/// One named problem and op tuned on a device, for `mucudnn cache list`.
#[derive(Clone, Debug, PartialEq)]
pub struct EntrySummary {
    pub device: DeviceFingerprint,
    pub layer: String,
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// Micro-batch sizes measured (up to the problem's batch size).
    pub sizes: usize,
    pub measurements: usize,
    /// Candidates rejected for wrong results (at any size measured).
    pub rejected: usize,
    /// Cached plans for this problem and op.
    pub plans: usize,
}

fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn canonical(device: &DeviceFingerprint) -> String {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    format!(
        "{}|{}|{}|{}|{}",
        device.backend,
        device.name,
        opt(device.compute_capability.map(|(a, b)| format!("{a}.{b}"))),
        opt(device.driver_version.map(|v| v.to_string())),
        opt(device.cudnn_version.map(|v| v.to_string())),
    )
}

fn begin(conn: &Connection) -> Result<Transaction<'_>> {
    Transaction::new_unchecked(conn, TransactionBehavior::Immediate)
}

fn device_id(conn: &Connection, device: &DeviceFingerprint) -> Result<Option<i64>> {
    conn.prepare_cached("SELECT id FROM devices WHERE fingerprint = ?1")?
        .query_row([canonical(device)], |row| row.get(0))
        .optional()
}

fn ensure_device(conn: &Connection, device: &DeviceFingerprint) -> Result<i64> {
    conn.prepare_cached(
        "INSERT INTO devices (backend, name, cc_major, cc_minor, driver_version, cudnn_version, fingerprint)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (fingerprint) DO NOTHING",
    )?
    .execute(params![
        device.backend.name(),
        device.name,
        device.compute_capability.map(|c| c.0),
        device.compute_capability.map(|c| c.1),
        device.driver_version,
        device.cudnn_version.map(clamp),
        canonical(device),
    ])?;
    device_id(conn, device)?.ok_or(rusqlite::Error::QueryReturnedNoRows)
}

const SHAPE_COLUMNS: &str =
    "c, d, h, w, k, t, r, s, pad_d, pad_h, pad_w, stride_d, stride_h, stride_w, \
     dilation_d, dilation_h, dilation_w, groups, dtype, layout, math";

/// `?1, ?2, ...` for every shape column.
fn shape_placeholders() -> String {
    (1..=SHAPE_PARAMS)
        .map(|i| format!("?{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

const SHAPE_PARAMS: usize = 21;

fn shape_params(p: &ConvProblem) -> [Box<dyn rusqlite::ToSql>; SHAPE_PARAMS] {
    [
        Box::new(p.c),
        Box::new(p.d),
        Box::new(p.h),
        Box::new(p.w),
        Box::new(p.k),
        Box::new(p.t),
        Box::new(p.r),
        Box::new(p.s),
        Box::new(p.pad_d),
        Box::new(p.pad_h),
        Box::new(p.pad_w),
        Box::new(p.stride_d),
        Box::new(p.stride_h),
        Box::new(p.stride_w),
        Box::new(p.dilation_d),
        Box::new(p.dilation_h),
        Box::new(p.dilation_w),
        Box::new(p.groups),
        Box::new(p.dtype.name()),
        Box::new(p.layout.name()),
        Box::new(p.math.name()),
    ]
}

fn shape_id(conn: &Connection, problem: &ConvProblem) -> Result<Option<i64>> {
    let sql = format!(
        "SELECT id FROM shapes WHERE ({SHAPE_COLUMNS}) = ({})",
        shape_placeholders()
    );
    let params = shape_params(problem);
    conn.prepare_cached(&sql)?
        .query_row(
            rusqlite::params_from_iter(params.iter().map(|b| b.as_ref())),
            |row| row.get(0),
        )
        .optional()
}

fn ensure_shape(conn: &Connection, problem: &ConvProblem) -> Result<i64> {
    let sql = format!(
        "INSERT INTO shapes ({SHAPE_COLUMNS}) VALUES ({}) ON CONFLICT DO NOTHING",
        shape_placeholders()
    );
    let params = shape_params(problem);
    conn.prepare_cached(&sql)?
        .execute(rusqlite::params_from_iter(
            params.iter().map(|b| b.as_ref()),
        ))?;
    shape_id(conn, problem)?.ok_or(rusqlite::Error::QueryReturnedNoRows)
}

/// (device id, shape id) when both are known.
fn ids(
    conn: &Connection,
    device: &DeviceFingerprint,
    problem: &ConvProblem,
) -> Result<Option<(i64, i64)>> {
    Ok(match (device_id(conn, device)?, shape_id(conn, problem)?) {
        (Some(d), Some(s)) => Some((d, s)),
        _ => None,
    })
}

/// The columns [`read_measurement`] reads, in its order.
const MEASUREMENT_COLUMNS: &str =
    "micro, algo, engine, time_ms, workspace_bytes, max_rel_error, tolerance";

/// Columns: [`MEASUREMENT_COLUMNS`]. A row whose engine name does not parse (or whose algo
/// number is negative) is an error, which the caller treats as a miss; so is a verification
/// with one of its two values missing.
fn read_measurement(row: &rusqlite::Row<'_>) -> Result<Measurement> {
    // A negative workspace is no measurement's: the row is unusable, not a 0-byte one.
    let workspace: i64 = row.get(4)?;
    let workspace_bytes = u64::try_from(workspace).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(4, rusqlite::types::Type::Integer, Box::new(e))
    })?;
    let verification = match (row.get::<_, Option<f64>>(5)?, row.get::<_, Option<f64>>(6)?) {
        (None, None) => None,
        (Some(max_rel_error), Some(tolerance)) => Some(Verification {
            max_rel_error,
            tolerance,
        }),
        _ => {
            return Err(rusqlite::Error::FromSqlConversionFailure(
                5,
                rusqlite::types::Type::Null,
                "a verification without its error or its tolerance".into(),
            ))
        }
    };
    Ok(Measurement {
        micro: row.get(0)?,
        algo: read_algo(row)?,
        time_ms: row.get(3)?,
        workspace_bytes,
        verification,
    })
}

/// Columns: micro, algo, engine, workspace_bytes of a `skipped` row.
fn read_skipped(row: &rusqlite::Row<'_>) -> Result<Skipped> {
    Ok(Skipped {
        micro: row.get(0)?,
        algo: read_algo(row)?,
        workspace_bytes: row.get::<_, i64>(3)?.max(0) as u64,
    })
}

/// The candidate of a row whose columns 1 and 2 are `algo` and `engine`.
fn read_algo(row: &rusqlite::Row<'_>) -> Result<Algo> {
    let engine: String = row.get(2)?;
    let algo = if engine.is_empty() {
        let number: i64 = row.get(1)?;
        Algo::Legacy(u32::try_from(number).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(
                1,
                rusqlite::types::Type::Integer,
                Box::new(e),
            )
        })?)
    } else {
        Algo::Engine(EngineName::new(&engine).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(2, rusqlite::types::Type::Text, Box::new(e))
        })?)
    };
    Ok(algo)
}

/// The `(algo, engine)` key columns of a candidate.
fn algo_columns(algo: &Algo) -> (i64, &'static str) {
    match *algo {
        Algo::Legacy(number) => (i64::from(number), ""),
        Algo::Engine(name) => (-1, name.as_str()),
    }
}

/// The rows of a measurement query that may be used: each passes the check every record
/// entering the cache passes ([`RecordCheck::record`]; the device's memory is not known here).
/// A row that does not parse or fails the check (written by an older mucudnn, by hand, or
/// poisoned) is skipped and counted in `skipped`, so one bad row never fails a tune.
fn usable_rows(
    rows: impl Iterator<Item = Result<Result<Measurement>>>,
    device: &DeviceFingerprint,
    problem: &ConvProblem,
    op: ConvOp,
    split: SplitDim,
    skipped: &mut usize,
) -> Result<Vec<Measurement>> {
    let check = row_check(device);
    let mut usable = Vec::new();
    for row in rows {
        match row? {
            Ok(m) if usable_row(&check, problem, op, split, &m, false) => usable.push(m),
            _ => *skipped += 1,
        }
    }
    Ok(usable)
}

/// Whether a row read back passes the record check and agrees with its table's verdict: a
/// measurement row (`rejected` false) within its tolerance, a rejected row over it.
fn usable_row(
    check: &RecordCheck<'_>,
    problem: &ConvProblem,
    op: ConvOp,
    split: SplitDim,
    m: &Measurement,
    rejected: bool,
) -> bool {
    check.record_split(problem, op, split, m).is_ok() && check.verdict(m, rejected).is_ok()
}

/// More bytes than any device's memory (1 PiB): the cache does not know its device's memory,
/// but a workspace past this (2^63 - 1 bytes, written by hand or by an unchecked store) is no
/// measurement's, and a plan that needed it could never run.
const MAX_CACHED_WORKSPACE_BYTES: u64 = 1 << 50;

/// The record check of rows read back from the cache.
fn row_check(device: &DeviceFingerprint) -> RecordCheck<'_> {
    RecordCheck {
        device,
        memory_bytes: Some(MAX_CACHED_WORKSPACE_BYTES),
    }
}

/// The sizes of `kind` (all, or only `micro`) that have stored rows for `op` and none of them
/// usable: each failed the record check or names an op that is not one. Such a size is a miss,
/// not "measured, nothing supported" (which has no rows at all), so that measuring it again
/// replaces the rows; otherwise a poisoned size would never be measured again, and a tune
/// left with no usable measurement would fail.
fn unusable_sizes(
    conn: &Connection,
    (d, s): (i64, i64),
    device: &DeviceFingerprint,
    key: &SizesKey,
    micro: Option<i64>,
) -> Result<HashSet<i64>> {
    let SizesKey {
        problem,
        op,
        split,
        kind,
    } = key;
    let (problem, op, split, kind) = (problem, *op, *split, *kind);
    let [a, b, c] = ConvOp::ALL.map(ConvOp::name);
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {MEASUREMENT_COLUMNS}, op FROM measurements
         WHERE device_id = ?1 AND shape_id = ?2 AND split = ?3 AND (?4 IS NULL OR micro = ?4)
           AND (op = ?5 OR op NOT IN (?6, ?7, ?8)) AND rejected = 0 AND {}",
        kind_condition(kind)
    ))?;
    let check = row_check(device);
    let mut usable: HashMap<i64, bool> = HashMap::new();
    let mut rows = stmt.query(params![d, s, split.name(), micro, op.name(), a, b, c])?;
    while let Some(row) = rows.next()? {
        let Ok(size) = row.get::<_, i64>(0) else {
            continue; // a size that is not a number is no size of ours
        };
        let ours = row.get::<_, String>(7).is_ok_and(|name| name == op.name());
        let good = ours
            && read_measurement(row)
                .is_ok_and(|m| usable_row(&check, problem, op, split, &m, false));
        *usable.entry(size).or_insert(false) |= good;
    }
    Ok(usable
        .into_iter()
        .filter(|&(_, good)| !good)
        .map(|(size, _)| size)
        .collect())
}

/// Whether every micro-batch of a cached plan passes the record check (a plan solved from a
/// poisoned measurement names a candidate the device does not have, or a zero time).
fn usable_plan(plan: &Plan, device: &DeviceFingerprint) -> bool {
    let check = row_check(device);
    plan.micro_batches.iter().all(|mb| {
        let m = Measurement::new(mb.size, mb.algo, mb.time_ms, mb.workspace_bytes);
        check
            .record_split(&plan.problem, plan.op, plan.split, &m)
            .is_ok()
    })
}

/// The SQL condition selecting one kind's measurement rows.
fn kind_condition(kind: AlgoKind) -> &'static str {
    match kind {
        AlgoKind::Legacy => "engine = ''",
        AlgoKind::Engine => "engine <> ''",
    }
}

/// What is stored of `key`'s size, if it was measured: its measurements, its rejected
/// candidates and its verification state, in one pass over its rows (a warm tune reads every
/// size this way). A row that does not read as its table says (a measurement within its
/// tolerance, a rejection over it) is left out and counted in `skipped`; a size whose
/// measurement rows are all unusable is a miss ([`unusable_sizes`]). An unknown verification
/// state (written by hand or a newer mucudnn) reads as unverified.
pub(crate) fn size_rows(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &MeasureKey,
    skipped: &mut usize,
) -> Result<Option<Measured>> {
    let (problem, op, split, micro, kind) = (&key.problem, key.op, key.split, key.size, key.kind);
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(None);
    };
    let state: Option<String> = conn
        .prepare_cached("SELECT verification FROM measured_sizes WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro = ?4 AND kind = ?5 AND split = ?6")?
        .query_row(params![d, s, op.name(), micro, kind.name(), split.name()], |row| row.get(0))
        .optional()?;
    let Some(state) = state else {
        return Ok(None);
    };
    if !unusable_sizes(conn, (d, s), device, &key.sizes(), Some(micro))?.is_empty() {
        return Ok(None);
    }
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {MEASUREMENT_COLUMNS}, rejected FROM measurements
         WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro = ?4 AND split = ?5 AND {}
         ORDER BY algo, engine",
        kind_condition(kind)
    ))?;
    let mut rows = stmt.query(params![d, s, op.name(), micro, split.name()])?;
    let check = row_check(device);
    let mut measured = Measured {
        verification: state.parse().unwrap_or(SizeVerification::Unverified),
        ..Measured::default()
    };
    while let Some(row) = rows.next()? {
        let rejected = row.get::<_, i64>(7).is_ok_and(|flag| flag != 0);
        match read_measurement(row) {
            Ok(m) if usable_row(&check, problem, op, split, &m, rejected) => {
                if rejected {
                    measured.rejected.push(m);
                } else {
                    measured.measurements.push(m);
                }
            }
            _ => *skipped += 1,
        }
    }
    Ok(Some(measured))
}

/// The sizes of `key` whose measurements were taken without verification
/// ([`SizeVerification::Unverified`]).
pub(crate) fn unverified_sizes(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &SizesKey,
) -> Result<Vec<i64>> {
    let (problem, op, split, kind) = (&key.problem, key.op, key.split, key.kind);
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(Vec::new());
    };
    let mut stmt = conn.prepare_cached(
        "SELECT micro FROM measured_sizes WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3
         AND kind = ?4 AND split = ?5 AND verification NOT IN ('verified', 'imported')",
    )?;
    let rows = stmt.query_map(params![d, s, op.name(), kind.name(), split.name()], |row| {
        row.get(0)
    })?;
    rows.collect()
}

/// The candidates of `kind` skipped for their workspace at micro-batch `micro` (empty when
/// none were, or the size was never measured).
pub(crate) fn skipped(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &MeasureKey,
) -> Result<Vec<Skipped>> {
    let (problem, op, split, micro, kind) = (&key.problem, key.op, key.split, key.size, key.kind);
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(Vec::new());
    };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT micro, algo, engine, workspace_bytes FROM skipped
         WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro = ?4 AND split = ?5 AND {}
         ORDER BY algo, engine",
        kind_condition(kind)
    ))?;
    let rows = stmt.query_map(params![d, s, op.name(), micro, split.name()], read_skipped)?;
    rows.collect()
}

/// The micro-batch sizes at which some candidate of `kind` was skipped with a workspace of at
/// most `limit` bytes (`None`: any).
pub(crate) fn sizes_skipped_within(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &SizesKey,
    limit: Option<u64>,
) -> Result<Vec<i64>> {
    let (problem, op, split, kind) = (&key.problem, key.op, key.split, key.kind);
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(Vec::new());
    };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT DISTINCT micro FROM skipped
         WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND workspace_bytes <= ?4 AND split = ?5 AND {}",
        kind_condition(kind)
    ))?;
    let rows = stmt.query_map(
        params![
            d,
            s,
            op.name(),
            clamp(limit.unwrap_or(u64::MAX)),
            split.name()
        ],
        |row| row.get(0),
    )?;
    rows.collect()
}

/// Every usable cached measurement of `problem`'s shape, `op` and `split` at sizes up to the
/// split's extent (`problem.n` for the batch), of the kinds in `candidates` (see
/// [`usable_rows`]).
pub(crate) fn measurements_up_to(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &OpKey,
    candidates: CandidateSet,
    skipped: &mut usize,
) -> Result<Vec<Measurement>> {
    let (problem, op, split) = (&key.problem, key.op, key.split);
    let n = key.extent();
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(Vec::new());
    };
    let condition = match candidates {
        CandidateSet::Legacy => kind_condition(AlgoKind::Legacy),
        CandidateSet::Engines => kind_condition(AlgoKind::Engine),
        CandidateSet::All => "1",
    };
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {MEASUREMENT_COLUMNS} FROM measurements
         WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro <= ?4 AND split = ?5
           AND rejected = 0 AND {condition}
         ORDER BY micro, algo, engine"
    ))?;
    let rows = stmt.query_map(params![d, s, op.name(), n, split.name()], |row| {
        Ok(read_measurement(row))
    })?;
    usable_rows(rows, device, problem, op, split, skipped)
}

/// The micro-batch sizes at which `kind`'s candidates were measured, less those whose rows are
/// all unusable (`unusable_sizes`).
pub(crate) fn measured_sizes(
    conn: &Connection,
    device: &DeviceFingerprint,
    key: &SizesKey,
) -> Result<Vec<i64>> {
    let (problem, op, split, kind) = (&key.problem, key.op, key.split, key.kind);
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(Vec::new());
    };
    let mut stmt = conn.prepare_cached(
        "SELECT micro FROM measured_sizes WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND kind = ?4 AND split = ?5",
    )?;
    let rows = stmt.query_map(params![d, s, op.name(), kind.name(), split.name()], |row| {
        row.get(0)
    })?;
    let measured: Vec<i64> = rows.collect::<Result<_>>()?;
    let unusable = unusable_sizes(conn, (d, s), device, key, None)?;
    Ok(measured
        .into_iter()
        .filter(|size| !unusable.contains(size))
        .collect())
}

/// Replaces what is stored of `key` (its kind at its size) under the device and shape ids
/// `(d, s)` by `measured`: the timed measurements, the rejected candidates (rows marked
/// `rejected`, with their error), the `skipped` candidates (a candidate also timed is not
/// stored as skipped) and the size's verification state. Returns the measurements stored.
fn insert_measurements(
    conn: &Connection,
    (d, s): (i64, i64),
    key: &MeasureKey,
    measured: &Measured,
) -> Result<usize> {
    let (op, split, micro, kind) = (key.op, key.split, key.size, key.kind);
    for table in ["measurements", "skipped"] {
        // The table name is one of these two constants, never input.
        conn.prepare_cached(&format!(
            "DELETE FROM {table} WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro = ?4 AND split = ?5 AND {}",
            kind_condition(kind)
        ))?
        .execute(params![d, s, op.name(), micro, split.name()])?;
    }
    let of_key = |m: &&Measurement| m.micro == micro && m.algo.kind() == kind;
    let timed: HashSet<Algo> = measured
        .measurements
        .iter()
        .chain(&measured.rejected)
        .map(|m| m.algo)
        .collect();
    let mut insert_skipped = conn.prepare_cached(
        "INSERT INTO skipped (device_id, shape_id, op, micro, algo, engine, workspace_bytes, split)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
         ON CONFLICT DO UPDATE SET workspace_bytes = excluded.workspace_bytes",
    )?;
    for x in measured
        .skipped
        .iter()
        .filter(|x| x.micro == micro && x.algo.kind() == kind && !timed.contains(&x.algo))
    {
        let (algo, engine) = algo_columns(&x.algo);
        insert_skipped.execute(params![
            d,
            s,
            op.name(),
            micro,
            algo,
            engine,
            clamp(x.workspace_bytes),
            split.name()
        ])?;
    }
    let mut insert = conn.prepare_cached(
        "INSERT INTO measurements (device_id, shape_id, op, micro, algo, engine, time_ms, workspace_bytes, split,
                                   max_rel_error, tolerance, rejected)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
         ON CONFLICT DO UPDATE SET time_ms = excluded.time_ms, workspace_bytes = excluded.workspace_bytes,
             max_rel_error = excluded.max_rel_error, tolerance = excluded.tolerance, rejected = excluded.rejected",
    )?;
    let mut stored = 0;
    let rows = measured
        .measurements
        .iter()
        .filter(of_key)
        .map(|m| (m, false))
        .chain(measured.rejected.iter().filter(of_key).map(|m| (m, true)));
    for (m, rejected) in rows {
        let (algo, engine) = algo_columns(&m.algo);
        insert.execute(params![
            d,
            s,
            op.name(),
            micro,
            algo,
            engine,
            m.time_ms,
            clamp(m.workspace_bytes),
            split.name(),
            m.verification.map(|v| v.max_rel_error),
            m.verification.map(|v| v.tolerance),
            rejected,
        ])?;
        stored += usize::from(!rejected);
    }
    conn.prepare_cached(
        "INSERT INTO measured_sizes (device_id, shape_id, op, micro, kind, measured_at, split, verification)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
         ON CONFLICT DO UPDATE SET measured_at = excluded.measured_at, verification = excluded.verification",
    )?
    .execute(params![
        d,
        s,
        op.name(),
        micro,
        kind.name(),
        now(),
        split.name(),
        measured.verification.name()
    ])?;
    Ok(stored)
}

fn insert_seen(
    conn: &Connection,
    d: i64,
    s: i64,
    layer: &str,
    problem: &ConvProblem,
    op: ConvOp,
) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO seen (device_id, layer, shape_id, n, op, last_used, seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, (SELECT COALESCE(MAX(seq), 0) + 1 FROM seen))
         ON CONFLICT DO UPDATE SET last_used = excluded.last_used",
    )?
    .execute(params![d, layer, s, problem.n, op.name(), now()])?;
    Ok(())
}

pub(crate) fn store_measurements(
    conn: &Connection,
    device: &DeviceFingerprint,
    layer: &str,
    key: &MeasureKey,
    measured: &Measured,
) -> Result<()> {
    let tx = begin(conn)?;
    let d = ensure_device(&tx, device)?;
    let s = ensure_shape(&tx, &key.problem)?;
    insert_measurements(&tx, (d, s), key, measured)?;
    insert_seen(&tx, d, s, layer, &key.problem, key.op)?;
    tx.commit()
}

pub(crate) fn mark_seen(
    conn: &Connection,
    device: &DeviceFingerprint,
    layer: &str,
    problem: &ConvProblem,
    op: ConvOp,
) -> Result<()> {
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(());
    };
    insert_seen(conn, d, s, layer, problem, op)
}

pub(crate) fn plan(
    conn: &Connection,
    device: &DeviceFingerprint,
    problem: &ConvProblem,
    op: ConvOp,
    key: &PlanKey,
    skipped: &mut usize,
) -> Result<Option<Plan>> {
    let Some((d, s)) = ids(conn, device, problem)? else {
        return Ok(None);
    };
    let (mode, limit) = key.mode_and_limit();
    let json: Option<String> = conn
        .prepare_cached(
            "SELECT plan_json FROM plans WHERE device_id = ?1 AND shape_id = ?2 AND n = ?3 AND op = ?4
             AND policy = ?5 AND mode = ?6 AND limit_bytes = ?7 AND context = ?8 AND candidates = ?9",
        )?
        .query_row(params![d, s, problem.n, op.name(), key.policy.name(), mode, limit, key.context, key.candidates.name()], |row| row.get(0))
        .optional()?;
    // A row that does not parse, or is for another problem, is a miss; so is a plan with a
    // micro-batch no record could have produced (counted in `skipped`).
    let plan = json
        .and_then(|text| serde_json::from_str::<Plan>(&text).ok())
        .filter(|plan| plan.problem == *problem && plan.op == op && plan.batch() == problem.n);
    match plan {
        Some(plan) if !usable_plan(&plan, device) => {
            *skipped += 1;
            Ok(None)
        }
        plan => Ok(plan),
    }
}

pub(crate) fn store_plan(
    conn: &Connection,
    device: &DeviceFingerprint,
    plan: &Plan,
    key: &PlanKey,
) -> Result<()> {
    let json = serde_json::to_string(plan)
        .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
    let (mode, limit) = key.mode_and_limit();
    let tx = begin(conn)?;
    let d = ensure_device(&tx, device)?;
    let s = ensure_shape(&tx, &plan.problem)?;
    tx.prepare_cached(
        "INSERT INTO plans (device_id, shape_id, n, op, policy, mode, limit_bytes, context, plan_json, created_at, candidates)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
         ON CONFLICT DO UPDATE SET plan_json = excluded.plan_json, created_at = excluded.created_at",
    )?
    .execute(params![d, s, plan.problem.n, plan.op.name(), key.policy.name(), mode, limit, key.context, json, now(), key.candidates.name()])?;
    tx.commit()
}

fn read_device(row: &rusqlite::Row<'_>, first: usize) -> Result<DeviceFingerprint> {
    let backend: String = row.get(first)?;
    let cc: (Option<u32>, Option<u32>) = (row.get(first + 2)?, row.get(first + 3)?);
    Ok(DeviceFingerprint {
        backend: if backend == "cuda" {
            BackendKind::Cuda
        } else {
            BackendKind::Cpu
        },
        name: row.get(first + 1)?,
        compute_capability: cc.0.zip(cc.1),
        driver_version: row.get(first + 4)?,
        cudnn_version: row
            .get::<_, Option<i64>>(first + 5)?
            .map(|v| v.max(0) as u64),
    })
}

/// Reads a problem from `seen`/`shapes` columns starting at `first` (n, then the shape), or a
/// conversion error for a damaged row.
fn read_problem(row: &rusqlite::Row<'_>, first: usize) -> Result<ConvProblem> {
    let text = |i: usize| row.get::<_, String>(first + i);
    let bad = |i: usize, message: String| {
        rusqlite::Error::FromSqlConversionFailure(
            first + i,
            rusqlite::types::Type::Text,
            message.into(),
        )
    };
    let int = |i: usize| row.get::<_, i64>(first + i);
    Ok(ConvProblem {
        n: int(0)?,
        c: int(1)?,
        d: int(2)?,
        h: int(3)?,
        w: int(4)?,
        k: int(5)?,
        t: int(6)?,
        r: int(7)?,
        s: int(8)?,
        pad_d: int(9)?,
        pad_h: int(10)?,
        pad_w: int(11)?,
        stride_d: int(12)?,
        stride_h: int(13)?,
        stride_w: int(14)?,
        dilation_d: int(15)?,
        dilation_h: int(16)?,
        dilation_w: int(17)?,
        groups: int(18)?,
        dtype: text(19)?.parse::<DType>().map_err(|e| bad(19, e))?,
        layout: text(20)?.parse::<Layout>().map_err(|e| bad(20, e))?,
        math: text(21)?.parse::<MathMode>().map_err(|e| bad(21, e))?,
    })
}

/// A `seen` row: (device id, shape id, device, layer, problem, op).
type SeenRow = (i64, i64, DeviceFingerprint, String, ConvProblem, ConvOp);

/// The `seen` rows with device and problem, in tuning order. A row that does not read as one
/// (a dtype such as `fp8` that this mucudnn does not know, a value of the wrong type) is
/// counted in `skipped` and left out: one such row must not hide the others.
fn seen_rows(conn: &Connection, skipped: &mut usize) -> Result<Vec<SeenRow>> {
    let sql = format!(
        "SELECT seen.device_id, seen.shape_id,
                devices.backend, devices.name, devices.cc_major, devices.cc_minor, devices.driver_version,
                devices.cudnn_version, seen.layer, seen.n, {}, seen.op
         FROM seen JOIN devices ON devices.id = seen.device_id JOIN shapes ON shapes.id = seen.shape_id
         ORDER BY seen.device_id, seen.seq",
        SHAPE_COLUMNS.split(", ").map(|c| format!("shapes.{c}")).collect::<Vec<_>>().join(", ")
    );
    let mut stmt = conn.prepare(&sql)?;
    let rows = stmt.query_map([], |row| {
        let op_text: String = row.get(9 + 1 + SHAPE_PARAMS)?;
        let op = op_text.parse::<ConvOp>().map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(
                9 + 1 + SHAPE_PARAMS,
                rusqlite::types::Type::Text,
                e.into(),
            )
        })?;
        Ok((
            row.get(0)?,
            row.get(1)?,
            read_device(row, 2)?,
            row.get(8)?,
            read_problem(row, 9)?,
            op,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        match row {
            Ok(row) => out.push(row),
            // SQLite's own errors (a damaged page, a busy file) fail the read; a value that
            // does not convert is one bad row.
            Err(e @ rusqlite::Error::SqliteFailure(..)) => return Err(e),
            Err(_) => *skipped += 1,
        }
    }
    Ok(out)
}

pub(crate) fn entries(conn: &Connection, skipped: &mut usize) -> Result<Vec<EntrySummary>> {
    let mut out = Vec::new();
    for (d, s, device, layer, problem, op) in seen_rows(conn, skipped)? {
        let count = |sql: &str| -> Result<i64> {
            conn.prepare_cached(sql)?
                .query_row(params![d, s, op.name(), problem.n], |row| row.get(0))
        };
        out.push(EntrySummary {
            sizes: count(
                "SELECT COUNT(DISTINCT micro) FROM measured_sizes WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro <= ?4 AND split = 'batch'",
            )? as usize,
            measurements: count(
                "SELECT COUNT(*) FROM measurements WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro <= ?4 AND split = 'batch' AND rejected = 0",
            )? as usize,
            rejected: count(
                "SELECT COUNT(*) FROM measurements WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND micro <= ?4 AND rejected = 1",
            )? as usize,
            plans: count("SELECT COUNT(*) FROM plans WHERE device_id = ?1 AND shape_id = ?2 AND op = ?3 AND n = ?4")?
                as usize,
            device,
            layer,
            problem,
            op,
        });
    }
    Ok(out)
}

/// The cache's measurements as one profile per device, every entry of which the interchange
/// format reads back and the solver accepts (docs/PROFILE_FORMAT.md, "Export").
///
/// `seen` holds a row per (layer, shape, mini-batch size, op) ever tuned, but a profile holds
/// one problem per (layer, dtype, layout, op). Measurements are keyed by the shape without the
/// mini-batch size, so the rows of one layer's shape tuned at several batch sizes become one
/// entry at the largest: its measurements (every micro-batch size up to it) include the smaller
/// batches'. A layer name given to two different shapes keeps its name on the first shape
/// tuned; the others are exported as `<layer>#2`, `<layer>#3`, ...
pub(crate) fn export(
    conn: &Connection,
    only: Option<&DeviceFingerprint>,
    skipped: &mut usize,
) -> Result<Vec<Profile>> {
    // Per device: the merged rows in tuning order, and where each (layer, shape, op) went.
    type Key = (String, ConvProblem, ConvOp);
    let mut rows: BTreeMap<i64, (DeviceFingerprint, Vec<Key>)> = BTreeMap::new();
    let mut slot_of: HashMap<(i64, Key), usize> = HashMap::new();
    for (d, _, device, layer, problem, op) in seen_rows(conn, skipped)? {
        if only.is_some_and(|o| *o != device) {
            continue;
        }
        let list = &mut rows.entry(d).or_insert_with(|| (device, Vec::new())).1;
        let key = (layer.clone(), problem.with_batch(1), op);
        match slot_of.get(&(d, key.clone())) {
            Some(&slot) => list[slot].1.n = list[slot].1.n.max(problem.n),
            None => {
                slot_of.insert((d, key), list.len());
                list.push((layer, problem, op));
            }
        }
    }
    let mut profiles = Vec::new();
    for (device, list) in rows.into_values() {
        let mut profile = Profile {
            device: device.name.clone(),
            cudnn_version: device.cudnn_version,
            math: None,
            timing: Some("exported from the mucudnn cache".into()),
            fingerprint: Some(device.clone()),
            entries: Vec::new(),
        };
        // The (layer, dtype, layout, op, split) names given out so far.
        let mut used: HashSet<(String, DType, Layout, ConvOp, SplitDim)> = HashSet::new();
        for (layer, problem, op) in list {
            for split in SplitDim::ALL {
                let key = OpKey::new(problem, op, split);
                let measurements =
                    measurements_up_to(conn, &device, &key, CandidateSet::All, skipped)?;
                if measurements.is_empty() {
                    continue;
                }
                let layer = (1..)
                    .map(|nth| match nth {
                        1 => layer.clone(),
                        nth => format!("{layer}#{nth}"),
                    })
                    .find(|name| {
                        used.insert((name.clone(), problem.dtype, problem.layout, op, split))
                    })
                    .unwrap_or_else(|| layer.clone());
                profile.entries.push(OpProfile {
                    layer,
                    problem,
                    op,
                    split,
                    measurements,
                    // The interchange format carries timed measurements only.
                    skipped: Vec::new(),
                    rejected: Vec::new(),
                });
            }
        }
        if !profile.entries.is_empty() {
            profiles.push(profile);
        }
    }
    Ok(profiles)
}

pub(crate) fn import(
    conn: &Connection,
    profile: &Profile,
    local: &DeviceFingerprint,
) -> Result<usize> {
    let tx = begin(conn)?;
    let d = ensure_device(&tx, local)?;
    let mut stored = 0;
    for entry in &profile.entries {
        let s = ensure_shape(&tx, &entry.problem)?;
        let mut by_size: BTreeMap<(i64, AlgoKind), Vec<Measurement>> = BTreeMap::new();
        for m in &entry.measurements {
            by_size
                .entry((m.micro, m.algo.kind()))
                .or_default()
                .push(*m);
        }
        for ((micro, kind), measurements) in by_size {
            // An imported size is complete: the interchange format has no skipped candidates.
            // It is verified when every record says how its output compared; otherwise it is
            // used as imported, not measured again.
            let key = MeasureKey {
                problem: entry.problem,
                op: entry.op,
                split: entry.split,
                size: micro,
                kind,
            };
            let verification = if measurements.iter().all(|m| m.verification.is_some()) {
                SizeVerification::Verified
            } else {
                SizeVerification::Imported
            };
            let measured = Measured {
                measurements,
                verification,
                ..Measured::default()
            };
            stored += insert_measurements(&tx, (d, s), &key, &measured)?;
        }
        insert_seen(&tx, d, s, &entry.layer, &entry.problem, entry.op)?;
    }
    tx.commit()?;
    Ok(stored)
}

pub(crate) fn clear(conn: &Connection) -> Result<()> {
    let tx = begin(conn)?;
    tx.execute_batch(
        "DELETE FROM plans; DELETE FROM measurements; DELETE FROM skipped; DELETE FROM measured_sizes; DELETE FROM seen;
         DELETE FROM shapes; DELETE FROM devices;",
    )?;
    tx.commit()?;
    // Give the space back (outside the transaction, as VACUUM requires).
    conn.execute_batch("VACUUM")
}
