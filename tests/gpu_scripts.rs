//! The GPU acceptance cannot rot unseen: every repository file and test target that
//! `scripts/gpu/*.sh` copy or run still exists, every `.gpu/` file the run scripts use is one
//! `build.sh` puts there, `build.sh` makes the git folder it writes its exclude line into,
//! every part `accept.sh` lists has its steps, fits a 15-minute GPU window (first-contact's
//! step caps add up to 300 s at most, every other part's to its 5 minutes) and is in
//! docs/gpu.md, `accept.sh --check` passes on a `.gpu` made from a fixture tree (and fails when
//! a file or a selected test is missing), no test script masks a failing command, and only
//! `libs.sh` chooses the libcudnn. Runs in CI without a GPU.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

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
            // A file the script only copies where present (`[ -f PATH ]`), another helper's.
            if text.contains(&format!("[ -f {path} ]")) {
                continue;
            }
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
            assert_eq!(
                fields.len(),
                4,
                "part line {line:?}: name|minutes|needs|what"
            );
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
    assert!(parts.len() >= 10, "{parts:?}");
    // The priority order: first-contact (the widest surface in one call) first, then the
    // PyTorch package.
    assert_eq!(parts[0].0, "first-contact");
    assert_eq!(parts[1].0, "torch");
    for (name, minutes) in &parts {
        // 15 minutes a GPU window, the machine's start included: a part is 5 at most.
        assert!(*minutes <= 5, "part {name}: {minutes} minutes");
        assert!(
            accept.contains(&format!("\n    {name}) ")),
            "accept.sh lists part {name} but has no `{name})` branch"
        );
        assert!(
            docs.contains(&format!("accept.sh {name}`")),
            "docs/gpu.md does not say when to run `bash .gpu/accept.sh {name}`"
        );
    }
    // Every branch of the case is a listed part.
    let case = &accept[accept.find("case \"$1\" in").expect("run_part's case")..];
    let case = &case[..case.find("\n  esac").unwrap()];
    for line in case.lines().skip(1) {
        if let Some((name, _)) = line.strip_prefix("    ").and_then(|l| l.split_once(") ")) {
            assert!(
                parts.iter().any(|(p, _)| p == name),
                "accept.sh has a branch {name}) that it does not list"
            );
        }
    }
    // A cap per step (not what is left of the part), and a step that runs out of it fails.
    assert!(accept.contains("timeout --kill-after=5 \"$cap\""));
    assert!(accept.contains("out of time (cap $cap s)"));
    assert!(!accept.contains("PART_BUDGET_S"));
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
    assert!(accept.contains("source $G/libs.sh") && accept.contains("one_cudnn_check"));
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

/// accept.sh's `bench` function, which runs one workload of nd_bench.py or spatial_bench.py
/// from .gpu at one limit.
fn bench_function(accept: &str) -> &str {
    let start = accept
        .find("\nbench() {")
        .expect("a bench function in accept.sh");
    let body = &accept[start..];
    let body = &body[..body.find("\n}\n").unwrap()];
    assert!(body.contains("python3 \"$G/$script\"") && body.contains("--limits \"$limit\""));
    body
}

/// The `nd` parts run nd_bench.py, which build.sh ships, and the script measures
/// what docs/gpu.md says: both limits against cudnn.benchmark, time and both memory figures.
#[test]
fn the_nd_part_runs_the_3d_benchmark() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let bench = bench_source("nd_bench.py", &build);
    // One workload and one limit per part: the decoder's convolutions, then r3d_18.
    assert!(accept.contains("    nd-vae) bench nd_bench.py vae 1GiB ;;"));
    assert!(accept.contains("    nd-r3d) bench nd_bench.py r3d 1GiB ;;"));
    assert!(bench_function(&accept).contains("--mucudnn $G/mucudnn"));
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

/// The `spatial` parts run spatial_bench.py, which build.sh ships, and the script
/// measures what docs/gpu.md says: the three limits with split="auto" against
/// cudnn.benchmark, both decoders at their full size, time and both memory figures.
#[test]
fn the_spatial_part_runs_the_spatial_benchmark() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let build = std::fs::read_to_string(root().join("scripts/gpu/build.sh")).unwrap();
    let bench = bench_source("spatial_bench.py", &build);
    assert!(accept.contains("    spatial-sdxl) bench spatial_bench.py sdxl 256MiB ;;"));
    assert!(accept.contains("    spatial-wan) bench spatial_bench.py wan 256MiB ;;"));
    assert!(bench_function(&accept).contains("--mucudnn $G/mucudnn"));
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

/// A temporary tree holding a `.gpu` laid out as `build.sh --parts first-contact` makes it,
/// from this repository's files, with stub executables in binaries.tar.xz (a release build is
/// too slow for CI; the stubs do not run, so `--check` reads the test names from the sources,
/// which sit beside .gpu as they do in a checkout). Removed on drop.
struct Fixture(PathBuf);

impl Fixture {
    fn new(name: &str) -> Fixture {
        let dir =
            std::env::temp_dir().join(format!("mucudnn-gpu-fixture-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let make = r#"set -euo pipefail
repo=$1
mkdir -p .gpu/python/tests .gpu/c_abi .gpu/wheels stub
cp "$repo"/scripts/gpu/*.sh "$repo"/scripts/gpu/*.py .gpu/
cp "$repo"/python/tests/conftest.py "$repo"/python/tests/converted.py \
  "$repo"/python/tests/test_torch_cuda.py "$repo"/python/tests/test_loader.py .gpu/python/tests/
(cd "$repo/python" && tar -cf - --exclude=__pycache__ mucudnn) | tar -xf - -C .gpu/python
cp "$repo"/examples/c_client.c "$repo"/examples/pytorch_ctypes.py "$repo"/include/mucudnn.h \
  .gpu/c_abi/
cp "$repo"/tests/fixtures/h100-alexnet-profile.json .gpu/
: > .gpu/c_abi/libmucudnn.so
: > .gpu/wheels/pytest-0-py3-none-any.whl
for b in mucudnn lib-tests gpu-tests gpu-engines gpu-teardown current-context; do
  printf '#!/bin/sh\nexit 1\n' > "stub/$b"
  chmod +x "stub/$b"
done
tar -cJf .gpu/binaries.tar.xz -C stub .
rm -r stub
ln -s "$repo/tests" tests
ln -s "$repo/src" src
"#;
        let done = Command::new("bash")
            .args(["-c", make, "make", root().to_str().unwrap()])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            done.status.success(),
            "making the fixture: {}",
            String::from_utf8_lossy(&done.stderr)
        );
        Fixture(dir)
    }

    /// `bash .gpu/accept.sh --check ARGS...` from the folder above .gpu: (passed, output).
    fn check(&self, args: &[&str]) -> (bool, String) {
        let done = Command::new("bash")
            .arg(".gpu/accept.sh")
            .arg("--check")
            .args(args)
            .current_dir(&self.0)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&done.stdout),
            String::from_utf8_lossy(&done.stderr)
        );
        (done.status.success(), text)
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.0.join(relative)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn check_passes_on_a_complete_first_contact_folder() {
    let fixture = Fixture::new("complete");
    let (passed, text) = fixture.check(&["first-contact"]);
    assert!(passed, "{text}");
    // Every selection was checked: the 19 pytest ids and the Rust tests of four executables.
    assert!(text.contains("19 pytest ids by"), "{text}");
    for binary in ["lib-tests", "gpu-tests", "gpu-teardown", "current-context"] {
        assert!(text.contains(&format!("Rust tests by {binary}")), "{text}");
    }
    assert!(text.contains("first-contact: ok"), "{text}");
}

#[test]
fn check_fails_on_a_missing_file_or_a_missing_test() {
    let fixture = Fixture::new("missing");
    std::fs::remove_file(fixture.path(".gpu/c_abi/libmucudnn.so")).unwrap();
    let (passed, text) = fixture.check(&["first-contact"]);
    assert!(!passed, "{text}");
    assert!(text.contains("c_abi/libmucudnn.so is missing"), "{text}");

    let fixture = Fixture::new("renamed");
    let tests = fixture.path(".gpu/python/tests/test_torch_cuda.py");
    let text = std::fs::read_to_string(&tests).unwrap().replace(
        "def test_cuda_graph_capture_after_tuning(",
        "def test_renamed(",
    );
    std::fs::write(&tests, text).unwrap();
    let (passed, text) = fixture.check(&["first-contact"]);
    assert!(!passed, "{text}");
    assert!(
        text.contains("test_cuda_graph_capture_after_tuning"),
        "{text}"
    );
}

#[test]
fn check_reports_a_missing_vae_benchmark() {
    let fixture = Fixture::new("vae");
    let _ = std::fs::remove_file(fixture.path(".gpu/vae_bench.py"));
    let (passed, text) = fixture.check(&["vae-wan"]);
    assert!(!passed, "{text}");
    assert!(text.contains("vae_bench.py"), "{text}");
}

/// Every part's step caps, as `--check` adds them up: first-contact's within 300 s, every
/// other part's within its minutes (5 at most), so that one part and a rerun fit a window.
#[test]
fn every_parts_step_caps_fit_five_minutes() {
    let fixture = Fixture::new("caps");
    let (_, text) = fixture.check(&[]);
    let parts = accept_parts();
    let mut seen = 0;
    for (name, minutes) in &parts {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}: ")) && l.contains(" steps, caps "))
            .unwrap_or_else(|| panic!("no caps line for {name}:\n{text}"));
        let caps: u32 = line
            .split(", caps ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let limit = if name == "first-contact" {
            300
        } else {
            minutes * 60 - 10
        };
        assert!(caps <= limit && caps <= 300, "{line}");
        assert!(!line.contains("the step caps add up"), "{line}");
        seen += 1;
    }
    assert_eq!(seen, parts.len());
    let first = text
        .lines()
        .find(|l| l.starts_with("first-contact: ") && l.contains(" steps"))
        .unwrap();
    assert!(
        first.contains(" 11 steps, "),
        "first-contact's steps: {first}"
    );
}
