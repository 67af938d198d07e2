//! The pure solver entry point behind `mucudnnSolveProfile`: a profile in the interchange format
//! and JSON options in, the `mucudnn solve --json` document out. No GPU, no files.

use super::error::{invalid, FfiError};
use super::json::{self, parse_document, Document, Size};
use crate::report::SolutionJson;
use crate::solver::{interchange, Mode, Policy, WdOptions, MAX_TIME_LIMIT_S};
use serde::Deserialize;

/// What an options document asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct SolveOptions {
    pub policy: Policy,
    pub mode: Mode,
    pub wd: WdOptions,
}

impl Default for SolveOptions {
    fn default() -> Self {
        SolveOptions {
            policy: Policy::default(),
            mode: Mode::WorkspaceReuse {
                workspace_limit_bytes: super::MUCUDNN_DEFAULT_WORKSPACE_LIMIT,
            },
            wd: WdOptions::default(),
        }
    }
}

/// An options document as given (see [`parse_options`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OptionsDocument {
    #[serde(default, deserialize_with = "json::some")]
    policy: Option<String>,
    #[serde(default, deserialize_with = "json::present")]
    workspace_limit: Option<Option<Size>>,
    #[serde(default, deserialize_with = "json::present")]
    total_workspace: Option<Option<Size>>,
    #[serde(default, deserialize_with = "json::some")]
    ilp_time_limit: Option<f64>,
}

/// A size option's bytes; `null` is not a size.
fn size_option(key: &str, size: Option<Size>) -> Result<u64, FfiError> {
    size.map(|Size(bytes)| bytes).ok_or_else(|| {
        invalid(format!(
            "options: {key} is null; give a number of bytes or a string like \"64MiB\""
        ))
    })
}

/// Parses an options document: a JSON object with any of `policy` (`"undivided"`,
/// `"power-of-two"`, `"all"`), `workspace_limit` or `total_workspace` (not both; bytes or
/// `"64MiB"`), and `ilp_time_limit` (seconds). `None` or `{}` gives the defaults (power-of-two,
/// a 64 MiB per-layer limit, 10 s). Unknown keys are errors, so that a typo is not ignored.
pub fn parse_options(text: Option<&str>) -> Result<SolveOptions, FfiError> {
    let mut options = SolveOptions::default();
    let Some(text) = text else {
        return Ok(options);
    };
    let document: OptionsDocument = parse_document(
        text,
        &Document {
            name: "options",
            not_json: "options are not valid JSON",
            not_object: "options must be a JSON object (like {\"workspace_limit\": \"64MiB\"}), \
                         got",
        },
    )?;
    if let Some(policy) = document.policy {
        options.policy = json::choice(
            "options: policy",
            "policy",
            &policy,
            &Policy::ALL,
            Policy::name,
        )?;
    }
    match (document.workspace_limit, document.total_workspace) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "options: give workspace_limit (a per-layer limit, workspace reuse) or \
                 total_workspace (one budget for all layers, workspace division), not both",
            ))
        }
        (Some(limit), None) => {
            options.mode = Mode::WorkspaceReuse {
                workspace_limit_bytes: size_option("workspace_limit", limit)?,
            }
        }
        (None, Some(total)) => {
            options.mode = Mode::WorkspaceDivision {
                total_workspace_bytes: size_option("total_workspace", total)?,
            }
        }
        (None, None) => {}
    }
    if let Some(limit) = document.ilp_time_limit {
        options.wd.time_limit_s = WdOptions::check_time_limit(limit).map_err(|_| {
            invalid(format!(
                "options: ilp_time_limit is {limit}; expected a number of seconds above 0 and at most {MAX_TIME_LIMIT_S:e}"
            ))
        })?;
    }
    Ok(options)
}

/// What `mucudnnSolveProfile` returns: the plan document, and a warning when the WD solver
/// stopped before proving its answer optimal.
#[derive(Clone, Debug, PartialEq)]
pub struct Solved {
    pub json: String,
    pub warning: Option<String>,
}

/// Solves a profile (interchange format v1) under JSON options; see [`parse_options`].
pub fn solve_profile_json(profile: &str, options: Option<&str>) -> Result<Solved, FfiError> {
    let options = parse_options(options)?;
    let profile = interchange::from_json_str(profile)?;
    let solution =
        crate::tune::solve_accurately(&profile, options.policy, options.mode, &options.wd)?;
    let json = serde_json::to_string_pretty(&SolutionJson::new(&solution))
        .map_err(|e| FfiError::Internal(format!("writing the plan document: {e}")))?;
    let warning = (!solution.proven_optimal).then(|| {
        format!(
            "warning: the MILP solver stopped at its time limit; this assignment ({}) is \
             feasible but not proven optimal (raise the ilp_time_limit option, or build with \
             --features highs)",
            solution.method
        )
    });
    Ok(Solved { json, warning })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::solver::solve_profile;

    const H100: &str = include_str!("../../tests/fixtures/h100-alexnet-profile.json");

    /// One measurement, with a workspace of 1000 bytes.
    pub const NEEDS_1000_BYTES: &str = r#"{"format": "mucudnn-profile-v1", "records": [
        {"layer": "l", "dtype": "fp32", "layout": "nchw", "n": 4, "c": 2, "h": 5, "w": 5, "k": 2,
         "r": 3, "s": 3, "pad_h": 0, "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1,
         "dilation_w": 1, "groups": 1, "op": "fwd", "algo": 1, "micro": 4,
         "workspace_bytes": 1000, "time_ms": 0.5}]}"#;

    #[test]
    fn options() {
        assert_eq!(parse_options(None).unwrap(), SolveOptions::default());
        assert_eq!(parse_options(Some("{}")).unwrap(), SolveOptions::default());
        let o = parse_options(Some(
            r#"{"policy": "all", "workspace_limit": "8MiB", "ilp_time_limit": 2}"#,
        ))
        .unwrap();
        assert_eq!(o.policy, Policy::All);
        assert_eq!(
            o.mode,
            Mode::WorkspaceReuse {
                workspace_limit_bytes: 8 << 20
            }
        );
        assert_eq!(o.wd.time_limit_s, 2.0);
        let o = parse_options(Some(r#"{"total_workspace": 1073741824}"#)).unwrap();
        assert_eq!(
            o.mode,
            Mode::WorkspaceDivision {
                total_workspace_bytes: 1 << 30
            }
        );
        for (text, expected) in [
            ("[1]", "must be a JSON object"),
            ("{", "not valid JSON"),
            (r#"{"workspace": 1}"#, "unknown key `workspace`"),
            (r#"{"policy": "pow2"}"#, "unknown policy `pow2`"),
            (r#"{"policy": 1}"#, "policy is 1"),
            // A limit the MILP solver's clock cannot add must not reach it (it
            // panicked there, printing a backtrace on the host program's stderr).
            (r#"{"ilp_time_limit": 1e19}"#, "at most"),
            (r#"{"ilp_time_limit": 0}"#, "above 0"),
            (r#"{"ilp_time_limit": -1}"#, "above 0"),
            (
                r#"{"workspace_limit": "64MB"}"#,
                "decimal suffixes are ambiguous",
            ),
            (r#"{"workspace_limit": -1}"#, "workspace_limit is -1"),
            (r#"{"workspace_limit": 1.5}"#, "workspace_limit is 1.5"),
            (r#"{"total_workspace": true}"#, "total_workspace is true"),
            (
                r#"{"workspace_limit": 1, "total_workspace": 2}"#,
                "not both",
            ),
            (r#"{"ilp_time_limit": 0}"#, "ilp_time_limit is 0"),
        ] {
            let err = parse_options(Some(text)).unwrap_err();
            assert!(
                matches!(err, FfiError::InvalidArgument(_)),
                "{text}: {err:?}"
            );
            assert!(err.to_string().contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn solves_the_recorded_profile_like_the_cli() {
        let solved = solve_profile_json(H100, Some(r#"{"workspace_limit": "64MiB"}"#)).unwrap();
        assert_eq!(solved.warning, None);
        let doc: serde_json::Value = serde_json::from_str(&solved.json).unwrap();
        assert_eq!(doc["mode"], "wr");
        assert_eq!(doc["policy"], "power-of-two");
        assert_eq!(doc["plans"].as_array().unwrap().len(), 30);
        assert!(doc["total_workspace_bytes"].as_u64().unwrap() <= 64 << 20);
        // Exactly the document `mucudnn solve --json` prints (the same serialisation).
        let profile = interchange::from_json_str(H100).unwrap();
        let solution = solve_profile(
            &profile,
            Policy::PowerOfTwo,
            Mode::WorkspaceReuse {
                workspace_limit_bytes: 64 << 20,
            },
            &WdOptions::default(),
        )
        .unwrap();
        assert_eq!(
            solved.json,
            serde_json::to_string_pretty(&SolutionJson::new(&solution)).unwrap()
        );
    }

    #[test]
    fn errors_have_the_right_kind() {
        let bad = solve_profile_json("{\"format\": 1}", None).unwrap_err();
        assert!(matches!(bad, FfiError::Profile(_)), "{bad:?}");
        assert!(
            bad.to_string().starts_with("bad profile: not valid JSON"),
            "{bad}"
        );
        let infeasible = solve_profile_json(NEEDS_1000_BYTES, Some(r#"{"workspace_limit": 10}"#));
        let err = infeasible.unwrap_err();
        assert!(matches!(err, FfiError::Solve(_)), "{err:?}");
        assert!(
            err.to_string().contains("smallest limit that works"),
            "{err}"
        );
    }
}
