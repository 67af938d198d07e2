//! The one-call GPU acceptance cannot rot unseen (issue 17, fix 8): every repository file and
//! test target that `scripts/gpu/*.sh` copy or run still exists, every `.gpu/` file the run
//! scripts use is one `build.sh` puts there, and `build.sh` makes the git folder it writes
//! its exclude line into. Runs in CI without a GPU.

use std::collections::BTreeSet;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn scripts() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(root().join("scripts/gpu"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sh"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(out.len() >= 5, "the GPU scripts: {out:?}");
    out
}

/// Words of `text` that start with one of `prefixes` at a word boundary (not inside an
/// absolute path such as /usr/include/...), up to the first character that ends a path.
fn paths_with_prefix(text: &str, prefixes: &[&str]) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for prefix in prefixes {
        let mut at = 0;
        while let Some(i) = text[at..].find(prefix) {
            let start = at + i;
            at = start + prefix.len();
            let before = text[..start].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || "/._-$".contains(c)) {
                continue;
            }
            let end = text[start..]
                .find(|c: char| !(c.is_alphanumeric() || "/._-".contains(c)))
                .map_or(text.len(), |n| start + n);
            let path = text[start..end].trim_end_matches(['.', '/']);
            if path.len() > prefix.len() {
                found.insert(path.to_string());
            }
        }
    }
    found
}

#[test]
fn every_file_the_gpu_scripts_copy_or_run_exists() {
    let mut checked = 0;
    for (name, text) in scripts() {
        for path in paths_with_prefix(&text, &["scripts/", "tests/", "examples/", "src/"]) {
            assert!(
                root().join(&path).exists(),
                "{name} names {path}, which is gone"
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 10,
        "only {checked} paths found: is the scan broken?"
    );
}

#[test]
fn every_test_target_the_gpu_scripts_build_exists() {
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let mut targets = 0;
    for (name, text) in scripts() {
        for word in text.split("--test ").skip(1) {
            let target: String = word
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            assert!(
                root().join(format!("tests/{target}.rs")).exists(),
                "{name} builds test target {target}, but tests/{target}.rs is gone"
            );
            targets += 1;
        }
    }
    assert!(
        targets >= 3,
        "{targets} test targets found in build.sh:\n{build}"
    );
}

#[test]
fn every_gpu_file_the_run_scripts_use_is_built() {
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    // What build.sh puts into .gpu/: `.gpu/NAME` destinations and the files copied there.
    let mut built: BTreeSet<String> = paths_with_prefix(&build, &[".gpu/"])
        .into_iter()
        .map(|p| p.trim_start_matches(".gpu/").to_string())
        .collect();
    for path in paths_with_prefix(&build, &["scripts/", "tests/"]) {
        if let Some(file) = Path::new(&path).file_name() {
            built.insert(file.to_string_lossy().into_owned());
        }
    }
    for (name, text) in scripts() {
        if name == "build.sh" {
            continue;
        }
        // A script with a build step of its own (c_abi_check.sh, candle_check.sh) makes the
        // folders it creates with `mkdir -p .gpu/NAME`.
        let own: BTreeSet<String> = text
            .lines()
            .filter(|line| line.trim_start().starts_with("mkdir -p"))
            .flat_map(|line| paths_with_prefix(line, &[".gpu/"]))
            .map(|p| p.trim_start_matches(".gpu/").to_string())
            .collect();
        let used = paths_with_prefix(&text, &[".gpu/", "$G/"]);
        for path in used {
            let file = path.trim_start_matches(".gpu/").trim_start_matches("$G/");
            let top = file.split('/').next().unwrap();
            assert!(
                built.contains(top) || own.contains(top),
                "{name} uses .gpu/{file}, which build.sh does not make (it makes {built:?})"
            );
        }
    }
}

#[test]
fn build_script_makes_the_git_info_folder() {
    // A clone without git's templates has no .git/info: build.sh must create it before it
    // appends its exclude line.
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let exclude = build.find("exclude=$(").expect("the exclude path");
    let mkdir = build[exclude..]
        .find("mkdir -p \"$(dirname \"$exclude\")\"")
        .expect("mkdir -p of the exclude file's folder");
    let append = build[exclude..]
        .find(">> \"$exclude\"")
        .expect("the append");
    assert!(mkdir < append);
}
