//! `mucudnn cache path|list|show|export|import|clear`.
//!
//! `list`, `show` and `export` open the cache read-only: they create, migrate and move
//! nothing. `import` and `clear` write; they fail when the cache cannot be written. Every
//! command refuses a file that is not a mucudnn cache and leaves it as it is.

use crate::{open_device, read_profile, DeviceChoice};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use mucudnn::backend::Backend;
use mucudnn::cache::{Access, Cache, Location, SCHEMA_VERSION};
use mucudnn::solver::units::format_bytes;
use mucudnn::solver::{interchange, DeviceFingerprint, Profile, RecordCheck};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub(crate) struct CacheArgs {
    /// The cache file (default: $MUCUDNN_CACHE, else the user's cache directory).
    #[arg(long, value_name = "PATH", global = true)]
    cache: Option<PathBuf>,
    #[command(subcommand)]
    action: CacheAction,
}

#[derive(Subcommand)]
enum CacheAction {
    /// Print where the cache file is.
    Path,
    /// One line per tuned (device, layer, op): micro-batch sizes, measurements, plans.
    List {
        /// Print the entries as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Location, schema, size, and totals per device.
    Show {
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write this machine's cached measurements as a profile (interchange format).
    Export {
        file: PathBuf,
        /// Which device's measurements: this machine's GPU (auto/cuda) or its CPU backend.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
    },
    /// Read a profile (interchange format) into the cache as this machine's measurements.
    Import {
        file: PathBuf,
        /// Import a profile measured on another device (or driver, or cuDNN) anyway, as this
        /// machine's (its records must still be candidates of this machine's backend).
        #[arg(long)]
        force: bool,
        /// Which device's measurements they become: this machine's GPU (auto/cuda) or its CPU
        /// backend.
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
    },
    /// Delete every measurement and plan.
    Clear,
}

fn local_fingerprint(choice: DeviceChoice) -> Result<DeviceFingerprint> {
    let mut device = open_device(choice, false)?;
    Ok(device.backend().fingerprint().clone())
}

/// Refuses a profile with any record this machine's cache may not hold, before anything is
/// stored: each passes [`RecordCheck::batch`], the check every record entering the cache
/// passes (a candidate `backend` has, a positive finite time, a workspace within its memory),
/// along its entry's split: a spatial entry's sizes are chunks of rows, not micro-batches.
/// `--force` only relabels a foreign profile's device; it does not let bad records in.
fn check_records(profile: &Profile, backend: &dyn Backend, file: &Path) -> Result<()> {
    let check = RecordCheck {
        device: backend.fingerprint(),
        memory_bytes: backend.memory_bytes(),
    };
    let records = profile.entries.iter().flat_map(|entry| {
        entry.measurements.iter().map(move |m| {
            (
                entry.layer.as_str(),
                &entry.problem,
                entry.op,
                entry.split,
                m,
            )
        })
    });
    check.batch_split(records).map_err(|refused| {
        // The file's records, counted from 1 as profile errors count them (the check's
        // index counts from 0).
        anyhow::anyhow!(
            "{}: record {} ({} {} micro-batch {}): {}; nothing was imported",
            file.display(),
            refused.index + 1,
            refused.layer,
            refused.op,
            refused.micro,
            refused.source
        )
    })?;
    Ok(())
}

pub(crate) fn run(args: &CacheArgs) -> Result<()> {
    if let CacheAction::Path = args.action {
        // Resolving the path opens nothing.
        match args.cache.clone().or_else(mucudnn::cache::default_path) {
            Some(path) => outln!("{}", path.display()),
            None => anyhow::bail!("no cache location: set MUCUDNN_CACHE or HOME, or pass --cache"),
        }
        return Ok(());
    }
    // Bad input is refused before the cache is opened (or created).
    let imported = match &args.action {
        CacheAction::Import { file, .. } => Some(read_profile(file)?),
        _ => None,
    };
    let access = match args.action {
        CacheAction::Import { .. } | CacheAction::Clear => Access::ReadWrite,
        _ => Access::ReadOnly,
    };
    let cache = Cache::open_default_with(args.cache.as_deref(), access)?;
    match &args.action {
        CacheAction::Path => unreachable!("handled above"),
        CacheAction::List { json } => list(&cache, *json),
        CacheAction::Show { json } => show(&cache, *json),
        CacheAction::Export { file, device } => {
            let local = local_fingerprint(*device)?;
            let profiles = cache.export(Some(&local))?;
            let Some(profile) = profiles.into_iter().next() else {
                let others: Vec<String> = cache
                    .export(None)?
                    .iter()
                    .map(|p| p.device.clone())
                    .collect();
                anyhow::bail!(
                    "nothing cached for {local}{}",
                    if others.is_empty() {
                        String::new()
                    } else {
                        format!(" (the cache has: {})", others.join("; "))
                    }
                );
            };
            let records: usize = profile.entries.iter().map(|e| e.measurements.len()).sum();
            std::fs::write(file, interchange::to_json_string(&profile))
                .with_context(|| format!("cannot write {}", file.display()))?;
            eprintln!(
                "exported {records} measurements of {} (layer, op) to {}",
                profile.entries.len(),
                file.display()
            );
            Ok(())
        }
        CacheAction::Import {
            file,
            force,
            device,
        } => {
            let profile = match imported {
                Some(profile) => profile,
                None => read_profile(file)?,
            };
            let mut device = open_device(*device, false)?;
            let backend = device.backend();
            let local = backend.fingerprint().clone();
            if !*force {
                mucudnn::cache::check_device(&profile, &local)?;
            }
            check_records(&profile, backend, file)?;
            let stored = cache.import(&profile, &local, *force)?;
            eprintln!(
                "imported {stored} measurements of {} (layer, op) into {}",
                profile.entries.len(),
                cache.location()
            );
            Ok(())
        }
        CacheAction::Clear => {
            let entries = cache.entries()?.len();
            cache.clear()?;
            eprintln!(
                "cleared {entries} tuned (layer, op) entries from {}",
                cache.location()
            );
            Ok(())
        }
    }
}

fn list(cache: &Cache, json: bool) -> Result<()> {
    let entries = cache.entries()?;
    if json {
        let rows: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "device": e.device.to_string(), "layer": e.layer, "problem": e.problem, "op": e.op.name(),
                    "sizes": e.sizes, "measurements": e.measurements, "rejected": e.rejected,
                    "plans": e.plans,
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut device = None;
    for e in &entries {
        if device != Some(&e.device) {
            outln!("{}:", e.device);
            device = Some(&e.device);
        }
        outln!(
            "  {:<32} {:<10} {:<44} {:>3} sizes {:>5} measurements {:>3} plans{}",
            mucudnn::report::escape_control(&e.layer),
            e.op.name(),
            e.problem.describe(),
            e.sizes,
            e.measurements,
            e.plans,
            if e.rejected > 0 {
                format!(" ({} rejected for wrong results)", e.rejected)
            } else {
                String::new()
            }
        );
    }
    if entries.is_empty() {
        outln!("the cache at {} is empty", cache.location());
    }
    Ok(())
}

fn show(cache: &Cache, json: bool) -> Result<()> {
    let entries = cache.entries()?;
    let mut per_device: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
    for e in &entries {
        let t = per_device.entry(e.device.to_string()).or_default();
        t.0 += 1;
        t.1 += e.measurements;
        t.2 += e.plans;
    }
    let size = match cache.location() {
        Location::File(path) => std::fs::metadata(path).map(|m| m.len()).ok(),
        Location::Memory { .. } => None,
    };
    if json {
        let devices: Vec<serde_json::Value> = per_device
            .iter()
            .map(|(d, (e, m, p))| serde_json::json!({"device": d, "entries": e, "measurements": m, "plans": p}))
            .collect();
        let doc = serde_json::json!({
            "location": cache.location().to_string(), "schema_version": SCHEMA_VERSION,
            "file_bytes": size, "devices": devices,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    outln!(
        "location: {}{}",
        cache.location(),
        match (cache.location(), size) {
            (Location::File(_), None) => " (no file yet)",
            _ => "",
        }
    );
    outln!("schema version: {SCHEMA_VERSION}");
    if let Some(bytes) = size {
        outln!("file size: {}", format_bytes(bytes));
    }
    for (device, (e, m, p)) in &per_device {
        outln!("{device}: {e} tuned (layer, op), {m} measurements, {p} plans");
    }
    if per_device.is_empty() {
        outln!("empty");
    }
    Ok(())
}
