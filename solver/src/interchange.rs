//! Profile interchange format v1 (`mucudnn-profile-v1`, see docs/PROFILE_FORMAT.md), with v2's
//! depth keys and v3's `split` key: JSON text in, [`Profile`] out, and back. Pure string
//! conversion; reading files is the caller's job.
//!
//! Records sharing (`layer`, `dtype`, `layout`, `op`, `split`) form one tuning problem; their shape fields
//! must agree. Errors name records counting from 1. Unknown keys are ignored, as the format requires. Entries keep the order in which
//! their first record appears.

use crate::algo::{Algo, EngineName};
use crate::problem::{ConvOp, ConvProblem, DType, Layout, MathMode};
use crate::profile::{Measurement, OpProfile, Profile, ProfileError, Verification};
use crate::spatial::SplitDim;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The `format` value of version 1 (2-D problems only).
pub const FORMAT_V1: &str = "mucudnn-profile-v1";

/// The `format` value of version 2: version 1 plus the depth keys of 3-D problems (`d`, `t`,
/// `pad_d`, `stride_d`, `dilation_d`; absent means the 2-D value). A profile is written as v2
/// only when it holds a 3-D problem, so that a v1 reader never reads a 3-D record as 2-D; both
/// versions are read.
pub const FORMAT_V2: &str = "mucudnn-profile-v2";

/// The `format` value of version 3: version 2 plus the `split` key (`batch`, the default when
/// absent, or `spatial`: `micro` is then a chunk's rows along the op's output's outermost
/// spatial axis). Written only when a profile holds a spatial entry, so that an older reader
/// never reads chunk sizes as micro-batch sizes; v1, v2 and v3 are read.
pub const FORMAT_V3: &str = "mucudnn-profile-v3";

fn known_format(format: &str) -> bool {
    format == FORMAT_V1 || format == FORMAT_V2 || format == FORMAT_V3
}

/// Why a text is not a usable v1 profile.
#[derive(Debug, thiserror::Error)]
pub enum InterchangeError {
    #[error("not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "unsupported profile format {found:?} (this build reads \"{FORMAT_V1}\", \"{FORMAT_V2}\" and \"{FORMAT_V3}\")"
    )]
    Format { found: String },
    /// `index` counts records from 1, as network files count lines.
    #[error("record {index}: {message}")]
    Record { index: usize, message: String },
    /// A measurement the profile rules refuse, with the record (from 1) that holds it.
    #[error("record {index}: {error}")]
    InRecord { index: usize, error: ProfileError },
    #[error(
        "record {index} ({layer} {dtype} {layout} {op}): {field} is {found}, but an earlier record of the same problem has {expected}"
    )]
    Inconsistent {
        index: usize,
        layer: String,
        dtype: DType,
        layout: Layout,
        op: ConvOp,
        field: &'static str,
        expected: String,
        found: String,
    },
    #[error("`fingerprint` is not a mucudnn device fingerprint ({0}); remove the key to import by device name")]
    Fingerprint(String),
    #[error(transparent)]
    Profile(#[from] ProfileError),
}

/// The document, with records as `R`: [`Record`]s read in one pass, or JSON values read one by
/// one when a record is bad (to say which).
#[derive(Deserialize)]
struct RawProfile<R> {
    format: String,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    cudnn_version: Option<u64>,
    #[serde(default)]
    math: Option<String>,
    #[serde(default)]
    timing: Option<String>,
    /// mucudnn's extension: the full device fingerprint. The key is mucudnn's, so a malformed
    /// one is an error (an import must not fall back to matching the device by name).
    #[serde(default)]
    fingerprint: Option<serde_json::Value>,
    records: Vec<R>,
}

/// One line of the format. Field order is the order records are written in.
#[derive(Serialize, Deserialize)]
struct Record {
    layer: String,
    dtype: DType,
    layout: Layout,
    n: i64,
    c: i64,
    /// v2's depth keys: absent for a 2-D problem.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    d: i64,
    h: i64,
    w: i64,
    k: i64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    t: i64,
    r: i64,
    s: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pad_d: i64,
    pad_h: i64,
    pad_w: i64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    stride_d: i64,
    stride_h: i64,
    stride_w: i64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    dilation_d: i64,
    dilation_h: i64,
    dilation_w: i64,
    groups: i64,
    /// Not in the v1 text; an extension key that other readers ignore. Absent means default.
    #[serde(default, skip_serializing_if = "is_default_math")]
    math: MathMode,
    op: ConvOp,
    /// v3's split key: absent for a batch split.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    split: SplitDim,
    /// A legacy algorithm number; absent for an engine configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    algo: Option<u32>,
    /// A graph-API engine configuration's name; absent for a legacy algorithm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    engine: Option<String>,
    micro: i64,
    workspace_bytes: u64,
    time_ms: f64,
    /// mucudnn's extension keys, written together for a verified measurement: its output's
    /// largest difference from the reference candidate's, relative to the reference's largest
    /// magnitude, and the tolerance it was held to. Absent: not verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_rel_error: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tolerance: Option<f64>,
}

fn one() -> i64 {
    1
}

fn is_one(v: &i64) -> bool {
    *v == 1
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

fn is_default_math(math: &MathMode) -> bool {
    *math == MathMode::Default
}

impl Record {
    fn problem(&self) -> ConvProblem {
        ConvProblem {
            n: self.n,
            c: self.c,
            d: self.d,
            h: self.h,
            w: self.w,
            k: self.k,
            t: self.t,
            r: self.r,
            s: self.s,
            pad_d: self.pad_d,
            pad_h: self.pad_h,
            pad_w: self.pad_w,
            stride_d: self.stride_d,
            stride_h: self.stride_h,
            stride_w: self.stride_w,
            dilation_d: self.dilation_d,
            dilation_h: self.dilation_h,
            dilation_w: self.dilation_w,
            groups: self.groups,
            dtype: self.dtype,
            layout: self.layout,
            math: self.math,
        }
    }
}

/// The first shape field in which two problems differ, as (name, a, b).
fn first_difference(a: &ConvProblem, b: &ConvProblem) -> Option<(&'static str, String, String)> {
    let fields: [(&'static str, i64, i64); 19] = [
        ("n", a.n, b.n),
        ("c", a.c, b.c),
        ("d", a.d, b.d),
        ("h", a.h, b.h),
        ("w", a.w, b.w),
        ("k", a.k, b.k),
        ("t", a.t, b.t),
        ("r", a.r, b.r),
        ("s", a.s, b.s),
        ("pad_d", a.pad_d, b.pad_d),
        ("pad_h", a.pad_h, b.pad_h),
        ("pad_w", a.pad_w, b.pad_w),
        ("stride_d", a.stride_d, b.stride_d),
        ("stride_h", a.stride_h, b.stride_h),
        ("stride_w", a.stride_w, b.stride_w),
        ("dilation_d", a.dilation_d, b.dilation_d),
        ("dilation_h", a.dilation_h, b.dilation_h),
        ("dilation_w", a.dilation_w, b.dilation_w),
        ("groups", a.groups, b.groups),
    ];
    if let Some((field, x, y)) = fields.into_iter().find(|(_, x, y)| x != y) {
        return Some((field, x.to_string(), y.to_string()));
    }
    (a.math != b.math).then(|| ("math", a.math.to_string(), b.math.to_string()))
}

/// Parses a v1, v2 or v3 profile and validates it (shapes, sizes, times, duplicates).
pub fn from_json_str(text: &str) -> Result<Profile, InterchangeError> {
    let raw: RawProfile<Record> = match serde_json::from_str(text) {
        Ok(raw) => raw,
        // Read again record by record, for the error that names the format or the record.
        Err(_) => {
            let raw: RawProfile<serde_json::Value> = serde_json::from_str(text)?;
            if !known_format(&raw.format) {
                return Err(InterchangeError::Format { found: raw.format });
            }
            let records = raw
                .records
                .into_iter()
                .enumerate()
                .map(|(index, value)| {
                    serde_json::from_value(value).map_err(|e| InterchangeError::Record {
                        index: index + 1,
                        message: e.to_string(),
                    })
                })
                .collect::<Result<Vec<Record>, _>>()?;
            RawProfile {
                format: raw.format,
                device: raw.device,
                cudnn_version: raw.cudnn_version,
                math: raw.math,
                timing: raw.timing,
                fingerprint: raw.fingerprint,
                records,
            }
        }
    };
    if !known_format(&raw.format) {
        return Err(InterchangeError::Format { found: raw.format });
    }
    // `split` is v3's key: in a v1 or v2 file it is some other program's extension key, which
    // readers ignore, and every record is a batch record (docs/PROFILE_FORMAT.md). Read as
    // spatial, a v1 file's micro-batch sizes would be taken for chunks of rows.
    let versioned_split = raw.format == FORMAT_V3;
    let mut raw = raw;
    if !versioned_split {
        for record in &mut raw.records {
            record.split = SplitDim::Batch;
        }
    }
    let mut profile = Profile {
        device: raw.device.unwrap_or_default(),
        cudnn_version: raw.cudnn_version,
        math: raw.math,
        timing: raw.timing,
        fingerprint: match raw.fingerprint {
            None => None,
            Some(value) => Some(
                serde_json::from_value(value)
                    .map_err(|e| InterchangeError::Fingerprint(e.to_string()))?,
            ),
        },
        entries: Vec::new(),
    };
    let mut index_of: HashMap<(String, DType, Layout, ConvOp, SplitDim), usize> = HashMap::new();
    // Per entry, the number (from 1) of the record behind each measurement.
    let mut records_of: Vec<Vec<usize>> = Vec::new();
    for (index, record) in raw.records.into_iter().enumerate() {
        let index = index + 1;
        let problem = record.problem();
        let key = (
            record.layer.clone(),
            record.dtype,
            record.layout,
            record.op,
            record.split,
        );
        let slot = *index_of.entry(key).or_insert_with(|| {
            profile.entries.push(OpProfile {
                layer: record.layer.clone(),
                problem,
                op: record.op,
                split: record.split,
                measurements: Vec::new(),
                skipped: Vec::new(),
                rejected: Vec::new(),
            });
            records_of.push(Vec::new());
            profile.entries.len() - 1
        });
        let entry = &mut profile.entries[slot];
        if let Some((field, expected, found)) = first_difference(&entry.problem, &problem) {
            return Err(InterchangeError::Inconsistent {
                index,
                layer: record.layer,
                dtype: record.dtype,
                layout: record.layout,
                op: record.op,
                field,
                expected,
                found,
            });
        }
        let algo = match (record.algo, &record.engine) {
            (Some(algo), None) => Algo::Legacy(algo),
            (None, Some(engine)) => {
                Algo::Engine(
                    EngineName::new(engine).map_err(|e| InterchangeError::Record {
                        index,
                        message: e.to_string(),
                    })?,
                )
            }
            (Some(_), Some(_)) => {
                return Err(InterchangeError::Record {
                    index,
                    message: "has both `algo` and `engine` (a candidate is one or the other)"
                        .into(),
                })
            }
            (None, None) => {
                return Err(InterchangeError::Record {
                    index,
                    message: "missing field `algo` (or `engine` for an engine configuration)"
                        .into(),
                })
            }
        };
        let verification = match (record.max_rel_error, record.tolerance) {
            (None, None) => None,
            (Some(max_rel_error), Some(tolerance)) => Some(Verification {
                max_rel_error,
                tolerance,
            }),
            _ => {
                return Err(InterchangeError::Record {
                    index,
                    message: "has only one of `max_rel_error` and `tolerance` (a verified \
                              record has both)"
                        .into(),
                })
            }
        };
        entry.measurements.push(Measurement {
            micro: record.micro,
            algo,
            time_ms: record.time_ms,
            workspace_bytes: record.workspace_bytes,
            verification,
        });
        records_of[slot].push(index);
    }
    for (entry, records) in profile.entries.iter().zip(&records_of) {
        if let Err(error) = entry.validate() {
            return Err(match record_of(entry, records, &error) {
                Some(index) => InterchangeError::InRecord { index, error },
                None => error.into(),
            });
        }
    }
    profile.validate()?;
    Ok(profile)
}

/// The record (from 1) behind an entry's validation error: the first record of a bad shape,
/// the record of a bad measurement, the second of a duplicate.
fn record_of(entry: &OpProfile, records: &[usize], error: &ProfileError) -> Option<usize> {
    let position = |wanted: &dyn Fn(&Measurement) -> bool, nth: usize| {
        entry
            .measurements
            .iter()
            .zip(records)
            .filter(|(m, _)| wanted(m))
            .nth(nth)
            .map(|(_, &index)| index)
    };
    match error {
        ProfileError::Shape { .. } => records.first().copied(),
        ProfileError::MicroOutOfRange { micro, .. } => position(&|m| m.micro == *micro, 0),
        ProfileError::BadTime { micro, algo, .. } => position(
            &|m| {
                m.micro == *micro && m.algo == *algo && !(m.time_ms.is_finite() && m.time_ms > 0.0)
            },
            0,
        ),
        ProfileError::Duplicate { micro, algo, .. } => {
            position(&|m| m.micro == *micro && m.algo == *algo, 1)
        }
        ProfileError::BadVerification { micro, algo, .. }
        | ProfileError::OverTolerance { micro, algo, .. } => {
            position(&|m| m.micro == *micro && m.algo == *algo, 0)
        }
        _ => None,
    }
}

/// Writes a profile in v1 format (v3 when it holds a spatial entry, else v2 when it holds a
/// 3-D problem): header fields, then one record per line.
pub fn to_json_string(profile: &Profile) -> String {
    let mut out = String::from("{\n");
    let mut field = |key: &str, value: serde_json::Value| {
        out += &format!("\"{key}\": {value},\n");
    };
    let spatial = profile.entries.iter().any(|e| e.split == SplitDim::Spatial);
    let three_d = profile.entries.iter().any(|e| e.problem.is_3d());
    let format = if spatial {
        FORMAT_V3
    } else if three_d {
        FORMAT_V2
    } else {
        FORMAT_V1
    };
    field("format", format.into());
    field("device", profile.device.clone().into());
    if let Some(version) = profile.cudnn_version {
        field("cudnn_version", version.into());
    }
    if let Some(math) = &profile.math {
        field("math", math.clone().into());
    }
    if let Some(timing) = &profile.timing {
        field("timing", timing.clone().into());
    }
    if let Some(fingerprint) = &profile.fingerprint {
        // Serialising plain data cannot fail.
        field(
            "fingerprint",
            serde_json::to_value(fingerprint).unwrap_or_default(),
        );
    }
    out += "\"records\": [";
    let mut first = true;
    for entry in &profile.entries {
        let p = &entry.problem;
        for m in &entry.measurements {
            let record = Record {
                layer: entry.layer.clone(),
                dtype: p.dtype,
                layout: p.layout,
                n: p.n,
                c: p.c,
                d: p.d,
                h: p.h,
                w: p.w,
                k: p.k,
                t: p.t,
                r: p.r,
                s: p.s,
                pad_d: p.pad_d,
                pad_h: p.pad_h,
                pad_w: p.pad_w,
                stride_d: p.stride_d,
                stride_h: p.stride_h,
                stride_w: p.stride_w,
                dilation_d: p.dilation_d,
                dilation_h: p.dilation_h,
                dilation_w: p.dilation_w,
                groups: p.groups,
                math: p.math,
                op: entry.op,
                split: entry.split,
                algo: m.algo.legacy(),
                engine: m.algo.engine().map(|name| name.as_str().to_string()),
                micro: m.micro,
                workspace_bytes: m.workspace_bytes,
                time_ms: m.time_ms,
                max_rel_error: m.verification.map(|v| v.max_rel_error),
                tolerance: m.verification.map(|v| v.tolerance),
            };
            out += if first { "\n" } else { ",\n" };
            first = false;
            // Serialising a struct of numbers, strings and unit enums cannot fail.
            out += &serde_json::to_string(&record).unwrap_or_default();
        }
    }
    out += "\n]\n}\n";
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = r#"{"format": "mucudnn-profile-v1", "device": "d", "extra": [1, 2],
      "records": [
        {"layer": "a", "dtype": "fp32", "layout": "nchw", "n": 4, "c": 2, "h": 5, "w": 5, "k": 2,
         "r": 3, "s": 3, "pad_h": 0, "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1,
         "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 1, "micro": 4,
         "workspace_bytes": 10, "time_ms": 0.5, "unknown_key": "ignored"}
      ]}"#;

    #[test]
    fn reads_and_ignores_unknown_keys() {
        let p = from_json_str(ONE).unwrap();
        assert_eq!(p.device, "d");
        assert_eq!(p.entries.len(), 1);
        assert_eq!(p.entries[0].measurements[0].workspace_bytes, 10);
        assert_eq!(p.entries[0].problem.math, MathMode::Default);
    }

    #[test]
    fn three_d_profiles_are_written_as_v2_and_2d_ones_stay_v1() {
        let v1 = from_json_str(ONE).unwrap();
        assert!(to_json_string(&v1).contains(FORMAT_V1));
        let three = ONE
            .replace("mucudnn-profile-v1", "mucudnn-profile-v2")
            .replace(
                r#""n": 4, "c": 2, "h": 5"#,
                r#""n": 4, "c": 2, "d": 6, "t": 3, "pad_d": 1, "stride_d": 2, "h": 5"#,
            );
        let p = from_json_str(&three).unwrap();
        let problem = p.entries[0].problem;
        assert_eq!(
            (problem.d, problem.t, problem.pad_d, problem.stride_d),
            (6, 3, 1, 2)
        );
        assert_eq!(problem.dilation_d, 1);
        let text = to_json_string(&p);
        assert!(text.contains(FORMAT_V2), "{text}");
        assert!(text.contains(r#""d":6"#), "{text}");
        assert_eq!(from_json_str(&text).unwrap(), p);
        let err = from_json_str(&ONE.replace("profile-v1", "profile-v9"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(FORMAT_V2), "{err}");
    }

    #[test]
    fn spatial_entries_are_written_as_v3_and_old_files_read_as_batch() {
        // A v1 file (no split key) reads as batch, and is written back as v1.
        let v1 = from_json_str(ONE).unwrap();
        assert_eq!(v1.entries[0].split, SplitDim::Batch);
        let text = to_json_string(&v1);
        assert!(
            text.contains(FORMAT_V1) && !text.contains("split"),
            "{text}"
        );
        // A 3-D batch profile stays v2.
        let mut three = v1.clone();
        three.entries[0].problem.d = 6;
        three.entries[0].problem.t = 3;
        let text = to_json_string(&three);
        assert!(
            text.contains(FORMAT_V2) && !text.contains("split"),
            "{text}"
        );

        // The same op split both ways: two entries, written as v3, read back equal.
        let mut spatial = v1.entries[0].clone();
        spatial.split = SplitDim::Spatial;
        spatial.measurements[0].micro = 3; // 3 output rows of a 5x5 input, 3x3 filter
        let mut both = v1.clone();
        both.entries.push(spatial);
        both.validate().unwrap();
        let text = to_json_string(&both);
        assert!(text.contains(FORMAT_V3), "{text}");
        assert_eq!(text.matches(r#""split":"spatial""#).count(), 1, "{text}");
        let back = from_json_str(&text).unwrap();
        assert_eq!(back, both);
        assert_eq!(back.entries[1].split, SplitDim::Spatial);
        // A 3-D profile with a spatial entry is v3 too.
        let mut both_3d = both.clone();
        for entry in &mut both_3d.entries {
            entry.problem.d = 6;
            entry.problem.t = 3;
        }
        let text = to_json_string(&both_3d);
        assert!(text.contains(FORMAT_V3), "{text}");
        assert_eq!(from_json_str(&text).unwrap(), both_3d);

        // Chunk sizes are checked against the extent along the axis, not the batch.
        let too_big = ONE
            .replace("profile-v1", "profile-v3")
            .replace(r#""op": "fwd""#, r#""op": "fwd", "split": "spatial""#);
        let err = from_json_str(&too_big).unwrap_err().to_string();
        assert!(err.contains("outside 1..=3"), "{err}");
        let bad = ONE
            .replace("profile-v1", "profile-v3")
            .replace(r#""op": "fwd""#, r#""op": "fwd", "split": "rows""#);
        assert!(from_json_str(&bad).is_err());
        // In v1 and v2, `split` is no key of the format: the records are batch records.
        for format in ["profile-v1", "profile-v2"] {
            let old = ONE
                .replace("profile-v1", format)
                .replace(r#""op": "fwd""#, r#""op": "fwd", "split": "spatial""#);
            let read = from_json_str(&old).unwrap();
            assert_eq!(read.entries[0].split, SplitDim::Batch, "{format}");
        }
    }

    #[test]
    fn engine_records_carry_an_engine_name_instead_of_algo() {
        let engine = ONE.replace(r#""algo": 1"#, r#""engine": "eng38_k2=8_k13=1""#);
        let p = from_json_str(&engine).unwrap();
        let name: EngineName = "eng38_k2=8_k13=1".parse().unwrap();
        assert_eq!(p.entries[0].measurements[0].algo, Algo::Engine(name));
        let text = to_json_string(&p);
        assert!(text.contains(r#""engine":"eng38_k2=8_k13=1""#), "{text}");
        assert!(!text.contains(r#""algo""#), "{text}");
        assert_eq!(from_json_str(&text).unwrap(), p);
        let both = ONE.replace(r#""algo": 1"#, r#""algo": 1, "engine": "eng3""#);
        let err = from_json_str(&both).unwrap_err().to_string();
        assert!(err.contains("both `algo` and `engine`"), "{err}");
        let neither = ONE.replace(r#""algo": 1,"#, "");
        let err = from_json_str(&neither).unwrap_err().to_string();
        assert!(err.contains("missing field `algo`"), "{err}");
        let bad = ONE.replace(r#""algo": 1"#, r#""engine": "cudnn-38""#);
        let err = from_json_str(&bad).unwrap_err().to_string();
        assert!(err.contains("not an engine configuration name"), "{err}");
    }

    #[test]
    fn round_trip() {
        let mut p = from_json_str(ONE).unwrap();
        let text = to_json_string(&p);
        assert_eq!(from_json_str(&text).unwrap(), p);
        p.fingerprint = Some(crate::device::DeviceFingerprint {
            backend: crate::device::BackendKind::Cuda,
            name: "d".into(),
            compute_capability: Some((9, 0)),
            driver_version: Some(13000),
            cudnn_version: Some(91900),
        });
        let text = to_json_string(&p);
        assert!(text.contains("\"fingerprint\""));
        assert_eq!(from_json_str(&text).unwrap(), p);
        // A malformed fingerprint is refused; a null one is absent.
        for odd in ["7", r#"{"backend": "cuda"}"#, r#""H100""#] {
            let text = ONE.replace("\"extra\"", &format!("\"fingerprint\": {odd}, \"extra\""));
            assert!(
                matches!(from_json_str(&text), Err(InterchangeError::Fingerprint(_))),
                "{odd}"
            );
        }
        let null = ONE.replace("\"extra\"", "\"fingerprint\": null, \"extra\"");
        assert_eq!(from_json_str(&null).unwrap().fingerprint, None);
    }

    /// A verified record carries its error and tolerance both ways; one over its tolerance,
    /// or with only one of the two keys, is refused and named.
    #[test]
    fn verified_records_keep_their_error() {
        let mut p = from_json_str(ONE).unwrap();
        p.entries[0].measurements[0].verification = Some(Verification {
            max_rel_error: 3.0e-7,
            tolerance: 1.2e-5,
        });
        let text = to_json_string(&p);
        assert!(
            text.contains(r#""max_rel_error":3e-7,"tolerance":0.000012"#),
            "{text}"
        );
        assert_eq!(from_json_str(&text).unwrap(), p);
        // Other records stay plain.
        assert_eq!(text.matches("max_rel_error").count(), 1);
        let over = text.replace(r#""max_rel_error":3e-7"#, r#""max_rel_error":0.5"#);
        let error = from_json_str(&over).unwrap_err().to_string();
        assert!(
            error.starts_with("record 1: ") && error.contains("rejected candidate"),
            "{error}"
        );
        let half = text.replace(r#","tolerance":0.000012"#, "");
        let error = from_json_str(&half).unwrap_err().to_string();
        assert!(error.contains("only one of `max_rel_error`"), "{error}");
    }

    #[test]
    fn times_survive_a_round_trip_bit_for_bit() {
        let mut p = from_json_str(ONE).unwrap();
        let mut rng = crate::synthetic::Rng(12345);
        let times: Vec<f64> = [13.618241999999999, 0.1 + 0.2, 1e-7 / 3.0]
            .into_iter()
            .chain((0..200).map(|_| rng.unit() * 10f64.powi(rng.below(8) as i32 - 4)))
            .filter(|t| *t > 0.0)
            .collect();
        p.entries[0].measurements = times
            .iter()
            .enumerate()
            .map(|(i, &time_ms)| Measurement {
                micro: 1 + (i as i64 % 4),
                algo: if i % 3 == 0 {
                    Algo::Engine(format!("eng{i}_k2={}", i % 7).parse().unwrap())
                } else {
                    Algo::Legacy(i as u32)
                },
                time_ms,
                workspace_bytes: 0,
                verification: None,
            })
            .collect();
        let back = from_json_str(&to_json_string(&p)).unwrap();
        for (a, b) in p.entries[0]
            .measurements
            .iter()
            .zip(&back.entries[0].measurements)
        {
            assert_eq!(
                a.time_ms.to_bits(),
                b.time_ms.to_bits(),
                "{} became {}",
                a.time_ms,
                b.time_ms
            );
        }
    }

    #[test]
    fn errors_are_specific() {
        let wrong = ONE.replace("mucudnn-profile-v1", "mucudnn-profile-v9");
        let err = from_json_str(&wrong).unwrap_err();
        assert!(matches!(err, InterchangeError::Format { .. }));
        assert!(err.to_string().contains(FORMAT_V3), "{err}");
        let missing = ONE.replace(r#""micro": 4,"#, "");
        let err = from_json_str(&missing).unwrap_err().to_string();
        assert!(
            err.starts_with("record 1:") && err.contains("micro"),
            "{err}"
        );
        let bad_op = ONE.replace(r#""fwd""#, r#""sideways""#);
        assert!(from_json_str(&bad_op)
            .unwrap_err()
            .to_string()
            .contains("record 1"));
        assert!(matches!(from_json_str("{"), Err(InterchangeError::Json(_))));
        let empty = r#"{"format": "mucudnn-profile-v1", "records": []}"#;
        assert!(matches!(
            from_json_str(empty),
            Err(InterchangeError::Profile(ProfileError::Empty))
        ));
    }

    /// Records count from 1, and a measurement the rules refuse is blamed
    /// on the record that holds it.
    #[test]
    fn errors_name_the_record_counting_from_1() {
        let record = &ONE[ONE.find("{\"layer").unwrap()..ONE.rfind('}').unwrap()];
        let record = &record[..record.rfind('}').unwrap() + 1];
        let profile = |records: &[String]| {
            format!(
                r#"{{"format": "mucudnn-profile-v1", "records": [{}]}}"#,
                records.join(",")
            )
        };
        let with = |from: &str, to: &str| record.replace(from, to);
        for (records, expect) in [
            (
                vec![
                    record.to_string(),
                    with("\"micro\": 4", "\"micro\": 2"),
                    with("\"micro\": 4", "\"micro\": 2"),
                ],
                "record 3: ",
            ),
            (
                vec![
                    record.to_string(),
                    with("\"time_ms\": 0.5", "\"time_ms\": -1"),
                ],
                "record 2: ",
            ),
            (
                vec![record.to_string(), with("\"micro\": 4", "\"micro\": 9")],
                "record 2: ",
            ),
            (vec![with("\"c\": 2", "\"c\": 0")], "record 1: "),
        ] {
            let err = from_json_str(&profile(&records)).unwrap_err().to_string();
            assert!(err.starts_with(expect), "expected {expect:?}: {err}");
        }
        let err = from_json_str(&profile(&[with("\"op\": \"fwd\"", "\"op\": 3")]))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("record 1: "), "{err}");
    }

    #[test]
    fn inconsistent_shapes_in_one_problem_are_refused() {
        let text = ONE.replace("]}", ",")
            + &ONE[ONE.find("{\"layer").unwrap()..].replace("\"c\": 2", "\"c\": 3");
        let err = from_json_str(&text).unwrap_err();
        assert!(
            matches!(
                &err,
                InterchangeError::Inconsistent {
                    index: 2,
                    field: "c",
                    ..
                }
            ),
            "{err}"
        );
    }
}
