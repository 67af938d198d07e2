//! The tree follows the data flow (ARCHITECTURE.md): problem -> profile -> cache -> solve ->
//! plan -> execute, with the integrations on top. A lower stage never imports a higher one, so
//! that each stage can be read, tested and replaced without the ones above it. This test reads
//! the sources (code lines, not comments: a doc link upwards is allowed) and fails on an upward
//! path.

use std::path::{Path, PathBuf};

/// The modules of the main crate above the measuring and executing stages.
const INTEGRATIONS: [&str; 9] = [
    "tune",
    "candle",
    "torch",
    "layer",
    "local_tuner",
    "c_abi",
    "report",
    "report_files",
    "explain",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::<module>` a code line of a file under `dir` names, with its place.
fn crate_paths(dir: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join(dir), &mut files);
    assert!(!files.is_empty(), "no Rust files under {dir}");
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            let code = code.split("//").next().unwrap_or("");
            for (at, _) in code.match_indices("crate::") {
                let module: String = code[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let place = format!(
                    "{}:{}",
                    file.strip_prefix(root).unwrap().display(),
                    number + 1
                );
                found.push((module, place));
            }
        }
    }
    found
}

fn upward(dir: &str, forbidden: &[&str]) -> Vec<String> {
    crate_paths(dir)
        .into_iter()
        .filter(|(module, _)| forbidden.contains(&module.as_str()))
        .map(|(module, place)| format!("{place}: crate::{module}"))
        .collect()
}

#[test]
fn backends_import_no_stage_above_them() {
    let mut forbidden = vec!["exec", "profiler"];
    forbidden.extend(INTEGRATIONS);
    let found = upward("src/backend", &forbidden);
    assert!(
        found.is_empty(),
        "src/backend imports a higher stage: {found:#?}"
    );
}

#[test]
fn the_profiler_imports_no_stage_above_it() {
    let mut forbidden = vec!["exec"];
    forbidden.extend(INTEGRATIONS);
    let found = upward("src/profiler", &forbidden);
    assert!(
        found.is_empty(),
        "src/profiler imports a higher stage: {found:#?}"
    );
}

#[test]
fn execution_imports_no_tuning_and_no_integration() {
    let mut forbidden = vec!["profiler"];
    forbidden.extend(INTEGRATIONS);
    let found = upward("src/exec", &forbidden);
    assert!(
        found.is_empty(),
        "src/exec imports a higher stage: {found:#?}"
    );
}

#[test]
fn tuning_imports_no_integration() {
    let forbidden: Vec<&str> = INTEGRATIONS
        .iter()
        .copied()
        .filter(|m| *m != "tune")
        .collect();
    let found = upward("src/tune", &forbidden);
    assert!(
        found.is_empty(),
        "src/tune imports an integration: {found:#?}"
    );
}

#[test]
fn the_scan_sees_imports_and_skips_comments() {
    // The scanner itself: a code line's path counts, a comment's does not.
    let backend = crate_paths("src/backend");
    assert!(backend.iter().any(|(module, _)| module == "solver"));
    let tune = crate_paths("src/tune");
    assert!(tune.iter().any(|(module, _)| module == "profiler"));
    assert!(
        !tune.iter().any(|(module, _)| module == "layer"),
        "src/tune/mod.rs links crate::layer only in a doc comment"
    );
}

#[test]
fn the_solver_and_the_cache_know_nothing_of_cuda() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for manifest in ["solver/Cargo.toml", "cache/Cargo.toml"] {
        let text = std::fs::read_to_string(root.join(manifest)).unwrap();
        for dependency in ["cudarc", "candle", "mucudnn ="] {
            assert!(
                !text.contains(dependency),
                "{manifest} depends on {dependency}"
            );
        }
    }
}
