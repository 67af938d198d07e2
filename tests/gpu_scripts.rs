//! The GPU acceptance cannot rot unseen (issue 17, fix 8; issue 21, item 13): every repository
//! file and test target that `scripts/gpu/*.sh` copy or run still exists, every `.gpu/` file
//! the run scripts use is one `build.sh` puts there, `build.sh` makes the git folder it writes
//! its exclude line into, every part `accept.sh` lists has its steps, fits a device call and is
//! in docs/gpu.md, no test script masks a failing command, and only `libs.sh` chooses the
//! libcudnn. Runs in CI without a GPU.

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
        for path in paths_with_prefix(
            &text,
            &["scripts/", "tests/", "examples/", "src/", "python/"],
        ) {
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

/// The parts `accept.sh` lists: (name, minutes).
fn accept_parts() -> Vec<(String, u32)> {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let start = accept.find("PARTS=\"").expect("PARTS=\"...\" in accept.sh") + 7;
    let end = start + accept[start..].find('"').unwrap();
    accept[start..end]
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split('|').collect();
            assert_eq!(fields.len(), 3, "part line {line:?}: name|minutes|what");
            let minutes = fields[1].parse().unwrap_or_else(|_| panic!("{line:?}"));
            (fields[0].to_string(), minutes)
        })
        .collect()
}

#[test]
fn every_accept_part_has_steps_fits_a_device_call_and_is_documented() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let docs = std::fs::read_to_string(root().join("docs/gpu.md")).unwrap();
    assert!(
        build.contains("scripts/gpu/accept.sh"),
        "build.sh copies accept.sh"
    );
    let parts = accept_parts();
    assert!(parts.len() >= 6, "{parts:?}");
    // The priority order of the issue: the PyTorch package first, then the wall.
    assert_eq!(parts[0].0, "torch");
    for (name, minutes) in &parts {
        // 10 minutes a device call, the machine's start included; each part's budget is 8.
        assert!(*minutes <= 8, "part {name}: {minutes} minutes");
        assert!(
            accept.contains(&format!("\n  {name})\n")),
            "accept.sh lists part {name} but has no `{name})` branch"
        );
        assert!(
            docs.contains(&format!("accept.sh {name}`")),
            "docs/gpu.md does not say when to run `bash .gpu/accept.sh {name}`"
        );
    }
    // Every branch of the case is a listed part.
    let case = &accept[accept.find("case \"$part\" in").expect("the parts' case")..];
    let case = &case[..case.find("\nesac").unwrap()];
    for line in case.lines().skip(1) {
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(')')) {
            assert!(
                parts.iter().any(|(p, _)| p == name),
                "accept.sh has a branch {name}) that it does not list"
            );
        }
    }
    // A budget per part, and a step that runs out of it is a failure.
    assert!(accept.contains("PART_BUDGET_S:-480"));
    assert!(accept.contains("timeout --kill-after"));
}

/// The scripts the test runs and the GPU acceptance run, with their text.
fn test_scripts() -> Vec<(String, String)> {
    let mut all = scripts();
    for entry in std::fs::read_dir(root().join("scripts")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "sh") {
            let name = format!("scripts/{}", path.file_name().unwrap().to_string_lossy());
            all.push((name, std::fs::read_to_string(&path).unwrap()));
        }
    }
    all
}

#[test]
fn no_script_masks_a_failing_command() {
    let mut checked = 0;
    for (name, text) in test_scripts() {
        let code: Vec<&str> = text
            .lines()
            .map(|l| l.split(" # ").next().unwrap())
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        for (i, line) in code.iter().enumerate() {
            for masked in ["|| true", "|| :", "||:", "|| exit 0"] {
                assert!(
                    !line.contains(masked),
                    "{name}: `{}` hides a failure",
                    line.trim()
                );
            }
            // `set +e` only to read a status, which is then checked.
            if line.trim() == "set +e" {
                let rest = code[i + 1..].iter().take(8).copied().collect::<Vec<_>>();
                assert!(
                    rest.iter().any(|l| l.contains("=$?")),
                    "{name}: `set +e` without reading the status after it"
                );
            }
        }
        // A command piped into tee fails the pipeline only under pipefail.
        if code.iter().any(|l| l.contains("| tee ")) && name != "libs.sh" {
            assert!(
                text.contains("pipefail"),
                "{name} pipes into tee without pipefail"
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "{checked} scripts");
}

#[test]
fn only_libs_sh_puts_a_cudnn_folder_on_the_library_path() {
    let libs = std::fs::read_to_string(root().join("scripts/gpu/libs.sh")).unwrap();
    assert!(libs.contains("one_cudnn_check()"));
    for (name, text) in scripts() {
        if name == "libs.sh" {
            continue;
        }
        for line in text.lines().filter(|l| l.contains("LD_LIBRARY_PATH")) {
            assert!(
                !line.contains("cudnn/lib") && !line.contains("TORCH_CUDNN"),
                "{name} puts a cuDNN folder on LD_LIBRARY_PATH itself: {line}"
            );
        }
    }
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    assert!(accept.contains("source scripts/gpu/libs.sh") && accept.contains("one_cudnn_check"));
}

/// The source of a benchmark script and bench_common.py, the module it imports as a sibling,
/// which build.sh must ship next to it in .gpu/.
fn bench_source(script: &str, build: &str) -> String {
    assert!(
        build.contains("scripts/gpu/bench_common.py"),
        "build.sh ships bench_common.py, which {script} imports"
    );
    let text = std::fs::read_to_string(root().join("scripts/gpu").join(script)).unwrap();
    assert!(
        text.contains("from bench_common import"),
        "{script} imports bench_common"
    );
    text + &std::fs::read_to_string(root().join("scripts/gpu/bench_common.py")).unwrap()
}

/// The `nd` part (issue 26) runs nd_bench.py, which build.sh ships, and the script measures
/// what docs/gpu.md says: both limits against cudnn.benchmark, time and both memory figures.
#[test]
fn the_nd_part_runs_the_3d_benchmark() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let bench = bench_source("nd_bench.py", &build);
    let branch = &accept[accept.find("\n  nd)\n").expect("an nd) branch")..];
    let branch = &branch[..branch.find(";;").unwrap()];
    assert!(branch.contains("$G/nd_bench.py") && branch.contains("--mucudnn $G/mucudnn"));
    assert!(
        build.contains("scripts/gpu/nd_bench.py"),
        "build.sh ships nd_bench.py"
    );
    for needle in [
        "LIMITS = (\"256MiB\", \"1GiB\")",
        "    torch.backends.cudnn.benchmark = True\n",
        "torch.cuda.mem_get_info()",
        "torch.cuda.max_memory_allocated()",
        "\"wan21_vae_decoder\", 1, args.dtype_name, \"ndhwc\"",
        "args.r3d_width, args.r3d_batch, args.r3d_clip = 64, 8, (16, 112, 112)",
        "torchvision.models.video",
        "--smoke",
    ] {
        assert!(
            bench.contains(needle),
            "nd_bench.py (with bench_common.py) lacks {needle:?}"
        );
    }
}

/// The `spatial` part (issue 24) runs spatial_bench.py, which build.sh ships, and the script
/// measures what docs/gpu.md says: the three limits with split="auto" against
/// cudnn.benchmark, both decoders at their full size, time and both memory figures.
#[test]
fn the_spatial_part_runs_the_spatial_benchmark() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let bench = bench_source("spatial_bench.py", &build);
    let branch = &accept[accept.find("\n  spatial)\n").expect("a spatial) branch")..];
    let branch = &branch[..branch.find(";;").unwrap()];
    assert!(branch.contains("$G/spatial_bench.py") && branch.contains("--mucudnn $G/mucudnn"));
    assert!(
        build.contains("scripts/gpu/spatial_bench.py"),
        "build.sh ships spatial_bench.py"
    );
    for needle in [
        "LIMITS = (\"64MiB\", \"256MiB\", \"1GiB\")",
        "GOAL_LIMIT = \"256MiB\"",
        "    torch.backends.cudnn.benchmark = True\n",
        "torch.cuda.mem_get_info()",
        "torch.cuda.max_memory_allocated()",
        "\"sdxl\": (\"sdxl_vae_decoder\", \"nhwc\", [],",
        "\"wan\": (\"wan21_vae_decoder\", \"ndhwc\", [],",
        "split=args.split",
        "default=\"auto\"",
        "--smoke",
    ] {
        assert!(
            bench.contains(needle),
            "spatial_bench.py (with bench_common.py) lacks {needle:?}"
        );
    }
}
