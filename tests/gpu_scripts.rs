//! The GPU acceptance cannot rot unseen: every repository file and test target that
//! `scripts/gpu/*.sh` copy or run still exists, every `.gpu/` file the run scripts use is one
//! `build.sh` puts there, `build.sh` makes the git folder it writes its exclude line into,
//! every part `accept.sh` lists has its steps, fits a 15-minute GPU window (first-contact's
//! step caps add up to 300 s at most, every other part's to its 5 minutes) and is in
//! docs/gpu.md, `accept.sh --check` and `accept.sh window --check` pass on a `.gpu` made from a
//! fixture tree (and fail when a file or a selected test is missing or renamed), a named Rust
//! test that runs nothing fails its step, `accept.sh window` runs on past a failing part and
//! stops before a part whose caps would pass its time, no test script masks a failing command,
//! only `libs.sh` chooses the libcudnn and it finds the cuBLASLt cuDNN's gate needs. Runs in CI
//! without a GPU.

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
    // The priority order: first-contact (the widest surface in one call) first, then
    // verification (which candidates compute wrong numbers on this GPU), then the PyTorch
    // package.
    assert_eq!(parts[0].0, "first-contact");
    assert_eq!(parts[1].0, "verify");
    assert_eq!(parts[2].0, "torch");
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
echo first-contact > .gpu/parts.txt
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
        let mut all = vec!["--check"];
        all.extend(args);
        self.accept(&all, &[])
    }

    /// `bash .gpu/accept.sh ARGS...` from the folder above .gpu, with `env` set and a stand-in
    /// `nvidia-smi` (an H200) first on PATH: (passed, output).
    fn accept(&self, args: &[&str], env: &[(&str, &Path)]) -> (bool, String) {
        let bin = self.0.join("fake-bin");
        if !bin.join("nvidia-smi").exists() {
            self.nvidia_smi("");
        }
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        let done = Command::new("bash")
            .arg(".gpu/accept.sh")
            .args(args)
            .env("PATH", path)
            .envs(env.iter().copied())
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

    /// The stand-in `nvidia-smi` (an H200), running `before` first.
    fn nvidia_smi(&self, before: &str) {
        let bin = self.0.join("fake-bin");
        std::fs::create_dir_all(&bin).unwrap();
        write_script(
            &bin.join("nvidia-smi"),
            &format!("#!/bin/sh\n{before}\necho 'NVIDIA H200, 580.95.05, 143771 MiB'\n"),
        );
    }

    /// Replaces `from` by `to` in the fixture's copy of `relative`.
    fn edit(&self, relative: &str, from: &str, to: &str) {
        let path = self.path(relative);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{relative} has no {from:?}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
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
    // Every selection was checked: the 18 pytest ids and the Rust tests of four executables.
    assert!(text.contains("18 pytest ids by"), "{text}");
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

/// Writes an executable script.
fn write_script(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A Rust test name the steps select that no longer exists (a test renamed, or moved to
/// another module: the `wall` part once named `ffi::tuner::...` after the module became
/// `c_abi`) fails the check, whether the names come from the sources or from `--list`.
#[test]
fn check_fails_on_a_renamed_rust_test() {
    let fixture = Fixture::new("renamed-rust");
    fixture.edit(
        ".gpu/accept.sh",
        "c_abi::tuner::tests::gpu_tune_leaves_no_measuring_backend",
        "ffi::tuner::tests::gpu_tune_leaves_no_measuring_backend",
    );
    let (passed, text) = fixture.check(&["wall"]);
    assert!(!passed, "{text}");
    assert!(
        text.contains("no test ffi::tuner::tests::gpu_tune_leaves_no_measuring_backend"),
        "{text}"
    );

    // From `--list` (a test executable that runs here): a stand-in listing all but one.
    let fixture = Fixture::new("renamed-list");
    let stub = fixture.path("stub");
    std::fs::create_dir_all(&stub).unwrap();
    write_script(
        &stub.join("current-context"),
        "#!/bin/sh\n[ \"$1\" = --list ] || exit 1\n\
         echo 'no_current_context_stays_none: test'\n\
         echo 'the_callers_device_stays_current_across_gpus: test'\n",
    );
    let done = Command::new("bash")
        .args([
            "-c",
            "tar -xJf .gpu/binaries.tar.xz -C stub ./lib-tests ./gpu-tests \
             ./gpu-teardown ./mucudnn ./gpu-engines && tar -cJf .gpu/binaries.tar.xz -C stub .",
        ])
        .current_dir(&fixture.0)
        .output()
        .unwrap();
    assert!(done.status.success(), "{done:?}");
    let (passed, text) = fixture.check(&["first-contact"]);
    assert!(!passed, "{text}");
    assert!(
        text.contains(
            "current-context --list has no test engine_plans_are_destroyed_in_the_callers_context"
        ),
        "{text}"
    );
    assert!(
        !text.contains("has no test no_current_context_stays_none"),
        "{text}"
    );
}

/// A Rust test executable runs only through accept.sh's `rust_tests`, which fails a run of no
/// test, or of fewer than it names with `--exact` (libtest passes both: a silent pass).
#[test]
fn a_named_test_that_runs_nothing_fails_its_step() {
    let accept = std::fs::read_to_string(root().join("scripts/gpu/accept.sh")).unwrap();
    let start = accept
        .find("\nrust_tests() {")
        .expect("rust_tests in accept.sh");
    let end = start + accept[start..].find("\n}\n").unwrap() + 3;
    let function = &accept[start..end];
    let dir = std::env::temp_dir().join(format!("mucudnn-rust-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A stand-in test executable that runs the tests named in $RAN, as libtest prints them.
    let binary = dir.join("tests");
    write_script(
        &binary,
        "#!/bin/sh\nset -- $RAN\necho \"running $# tests\"\n\
         for t in \"$@\"; do echo \"test $t ... ok\"; done\n\
         echo \"test result: ok. $# passed; 0 failed\"\n",
    );
    let run = |ran: &str, args: &str| {
        let script = format!("{function}\nrust_tests {} {args}", binary.display());
        Command::new("bash")
            .args(["-c", &script])
            .env("RAN", ran)
            .output()
            .unwrap()
    };
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let all = run("a b", "--exact a b");
    assert!(all.status.success(), "{}", text(&all));
    let none = run("", "--exact renamed");
    assert!(!none.status.success(), "{}", text(&none));
    assert!(text(&none).contains("ran no test"), "{}", text(&none));
    let some = run("a", "--exact a renamed --skip other");
    assert!(!some.status.success(), "{}", text(&some));
    assert!(
        text(&some).contains("ran 1 of the 2 tests it names; not run: renamed"),
        "{}",
        text(&some)
    );
    let filtered = run("x", "module --skip other");
    assert!(filtered.status.success(), "{}", text(&filtered));
    let _ = std::fs::remove_dir_all(&dir);
    // Every test executable a part runs goes through it (check_part.py refuses the others).
    for line in accept.lines() {
        for binary in [
            "lib-tests",
            "gpu-tests",
            "gpu-engines",
            "gpu-teardown",
            "current-context",
        ] {
            if line.contains(&format!("$G/{binary} ")) {
                assert!(line.contains(&format!("rust_tests $G/{binary} ")), "{line}");
            }
        }
    }
}

/// `accept.sh window --check` checks every part the window may reach (first-contact and the
/// parts .gpu was built for) and that each fits the window's seconds.
#[test]
fn window_check_covers_every_part_it_may_reach() {
    let fixture = Fixture::new("window-check");
    let (passed, text) = fixture.check(&["window"]);
    // (`--check window`, as `window --check`)
    assert!(passed, "{text}");
    assert!(text.contains("first-contact: ok"), "{text}");
    assert!(
        text.contains("window: 1 parts it may reach in 540 s: first-contact"),
        "{text}"
    );
    std::fs::write(fixture.path(".gpu/parts.txt"), "first-contact\nwall\n").unwrap();
    let (passed, text) = fixture.accept(&["window", "--check"], &[]);
    assert!(passed, "{text}");
    assert!(
        text.contains("wall: ok") && text.contains("window: ok"),
        "{text}"
    );
    // A window too short for first-contact's caps can never run it.
    let (passed, text) = fixture.accept(&["window", "--check", "200"], &[]);
    assert!(!passed, "{text}");
    assert!(
        text.contains(
            "first-contact: its caps (300 s) and summary (10 s) exceed the window's 200 s"
        ),
        "{text}"
    );
    // What the window reaches is checked like any part: a missing file fails it.
    std::fs::remove_file(fixture.path(".gpu/libs.sh")).unwrap();
    let (passed, _) = fixture.accept(&["window", "--check"], &[]);
    assert!(!passed);
}

/// The window's JSON summary, read back.
fn window_json(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("window.json")).unwrap()).unwrap()
}

/// (part, status) of each part the window recorded.
fn window_parts(doc: &serde_json::Value) -> Vec<(String, String)> {
    doc["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["part"].as_str().unwrap().to_string(),
                p["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// On the CPU every part fails at once (no libcudnn here): the window still runs the next
/// part, writes each one's summary, table, log and files under $OUT (four files: the device
/// tool brings back eight at most), and exits non-zero.
#[test]
fn a_failing_part_does_not_stop_the_window() {
    let fixture = Fixture::new("window-run");
    std::fs::write(fixture.path(".gpu/parts.txt"), "first-contact\nwall\n").unwrap();
    let out = fixture.path("out");
    let (passed, text) = fixture.accept(&["window", "600"], &[("OUT", &out)]);
    assert!(!passed, "{text}");
    let doc = window_json(&out);
    assert_eq!(
        window_parts(&doc),
        [
            ("first-contact".to_string(), "FAILED".to_string()),
            ("wall".to_string(), "FAILED".to_string())
        ],
        "{text}"
    );
    assert_eq!(doc["gpu"], "NVIDIA H200, 580.95.05, 143771 MiB");
    let first = &doc["parts"][0];
    assert_eq!(first["failed"]["step"], "one libcudnn (libs.sh)", "{first}");
    assert!(
        first["failed"]["last_lines"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("libcudnn")),
        "{first}"
    );
    assert!(doc["suggested_dir"].as_str().unwrap().ends_with("-h200"));
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "window-files.tar",
            "window.json",
            "window.log",
            "window.txt"
        ]
    );
    let table = std::fs::read_to_string(out.join("window.txt")).unwrap();
    for needle in [
        "first-contact",
        "wall",
        "one libcudnn (libs.sh)",
        "window: FAILED",
    ] {
        assert!(table.contains(needle), "{needle}: {table}");
    }
    assert!(text.contains(&table), "the table is printed last:\n{text}");
}

/// The window stops before a part whose caps (and its summary's 10 s) would pass the time
/// left, and records it and every later part as not run; a part already passed on this kind
/// of GPU (.gpu/passed.json, from benches/gpu/) is skipped.
#[test]
fn the_window_stops_before_a_part_whose_caps_exceed_its_time() {
    let fixture = Fixture::new("window-budget");
    std::fs::write(
        fixture.path(".gpu/parts.txt"),
        "first-contact\nwall\nwall-engines\n",
    )
    .unwrap();
    let out = fixture.path("out");
    // 311 s: first-contact (300 s of caps, and 10 for its summary) runs. Its nvidia-smi hangs
    // until the step's cap (20 s) ends it, so 291 s at most are left, and wall (282 + 10 s)
    // does not fit.
    fixture.nvidia_smi("sleep 60");
    let (passed, text) = fixture.accept(&["window", "311"], &[("OUT", &out)]);
    assert!(!passed, "{text}");
    let doc = window_json(&out);
    let parts = window_parts(&doc);
    assert_eq!(
        parts[0],
        ("first-contact".into(), "FAILED".into()),
        "{text}"
    );
    assert!(
        parts[1].0 == "wall" && parts[1].1.starts_with("not run: the window's time"),
        "{parts:?}"
    );
    assert!(
        parts[1].1.contains("wall needs its caps (282 s)"),
        "{parts:?}"
    );
    assert!(
        parts[2].0 == "wall-engines" && parts[2].1.starts_with("not run"),
        "{parts:?}"
    );
    let first = &doc["parts"][0];
    assert!(
        first["warnings"][0]
            .as_str()
            .unwrap()
            .contains("nvidia-smi: FAILED: out of time (cap 20 s)"),
        "{first}"
    );
    // A part passed on this GPU (an H200 here) is skipped, and the next one runs.
    fixture.nvidia_smi("");
    std::fs::write(
        fixture.path(".gpu/passed.json"),
        r#"[{"part": "wall", "gpu_name": "NVIDIA H200", "where": "benches/gpu/x/window.json"},
            {"part": "wall-engines", "gpu_name": "NVIDIA H100 80GB HBM3", "where": "y"}]"#,
    )
    .unwrap();
    let (_, text) = fixture.accept(&["window", "600"], &[("OUT", &out)]);
    let parts = window_parts(&window_json(&out));
    assert_eq!(
        parts[1],
        (
            "wall".into(),
            "skipped: passed on NVIDIA H200 (benches/gpu/x/window.json)".into()
        ),
        "{text}"
    );
    assert_eq!(parts[2], ("wall-engines".into(), "FAILED".into()), "{text}");
}

/// libs.sh looks for the cuBLASLt cuDNN's gate loads (libcublasLt.so.13 for PyTorch's CUDA 13),
/// not any libcublas: a system CUDA 12 cuBLAS must not hide the wheel's.
#[test]
fn libs_sh_finds_the_cublaslt_the_gate_needs() {
    let dir = std::env::temp_dir().join(format!("mucudnn-libs-sh-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let site = dir.join("site");
    let lib = site.join("nvidia/cu13/lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(site.join("torch")).unwrap();
    std::fs::write(lib.join("libcublasLt.so.13"), "").unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // PyTorch's site and CUDA major, and a loader that knows a system CUDA 12 cuBLAS.
    write_script(
        &bin.join("python3"),
        &format!("#!/bin/sh\nprintf '%s\\n13\\n' '{}'\n", site.display()),
    );
    write_script(
        &bin.join("ldconfig"),
        "#!/bin/sh\necho '\tlibcublas.so.12 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcublas.so.12'\n\
         echo '\tlibcublas.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcublas.so'\n",
    );
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let done = Command::new("bash")
        .args([
            "-c",
            "source \"$1\" && echo \"MUCUDNN_CUBLASLT=$MUCUDNN_CUBLASLT\"",
            "libs",
            root().join("scripts/gpu/libs.sh").to_str().unwrap(),
        ])
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .env("OUT", &out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{done:?}");
    assert!(
        stdout.contains("MUCUDNN_CUBLASLT=libcublasLt.so.13"),
        "{stdout}"
    );
    let libraries = std::fs::read_to_string(out.join("libraries.txt")).unwrap();
    assert!(
        libraries.contains(&format!(
            "libcublasLt.so.13: {}/libcublasLt.so.13 (PyTorch's wheel",
            lib.display()
        )),
        "{libraries}"
    );
    assert!(!libraries.contains("libcublas.so.12"), "{libraries}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every mucudnn layer test_torch_cuda.py makes bounds its tuning (a GPU window is short):
/// `max_candidates` given, or made through `pair`, which sets it.
#[test]
fn the_cuda_tests_bound_their_tuning() {
    let file = root().join("python/tests/test_torch_cuda.py");
    let check = r#"
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
pair = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "pair")
assert 'options.setdefault("max_candidates"' in ast.get_source_segment(open(sys.argv[1]).read(), pair)
layers = 0
for node in ast.walk(tree):
    if isinstance(node, ast.Call) and any(k.arg == "cache" for k in node.keywords):
        layers += 1
        names = {k.arg for k in node.keywords}
        inside_pair = pair.lineno <= node.lineno <= pair.end_lineno
        assert "max_candidates" in names or inside_pair, f"line {node.lineno}: unbounded tuning"
assert layers >= 3, layers
print(layers, "layer constructions bounded")
"#;
    let done = Command::new("python3")
        .args(["-c", check, file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
}

/// What build.sh gives the window as passed (.gpu/passed.json): each part a window under
/// benches/gpu/ recorded as passed, and each single part's summary that passed, by GPU name;
/// failed and not-run parts are not.
#[test]
fn build_collects_the_passed_parts_from_benches_gpu() {
    let dir = std::env::temp_dir().join(format!("mucudnn-collect-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let window = dir.join("benches/gpu/2026-01-02-h200");
    let single = dir.join("benches/gpu/2026-01-01-h100-80gb-hbm3");
    std::fs::create_dir_all(&window).unwrap();
    std::fs::create_dir_all(&single).unwrap();
    std::fs::write(
        window.join("window.json"),
        r#"{"gpu": "NVIDIA H200, 580.95.05, 143771 MiB", "budget_s": 540, "parts": [
            {"part": "first-contact", "status": "passed"}, {"part": "torch", "status": "FAILED"},
            {"part": "wall", "status": "not run: the window's time"}]}"#,
    )
    .unwrap();
    std::fs::write(
        single.join("c-abi.json"),
        r#"{"part": "c-abi", "passed": true, "gpu": "NVIDIA H100 80GB HBM3, 580.65.06, 81559 MiB"}"#,
    )
    .unwrap();
    let done = Command::new("python3")
        .arg(root().join("scripts/gpu/summary.py"))
        .args(["collect", "benches/gpu", "passed.json"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(done.status.success(), "{done:?}");
    let passed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("passed.json")).unwrap()).unwrap();
    let got: Vec<(&str, &str)> = passed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["part"].as_str().unwrap(), r["gpu_name"].as_str().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            ("c-abi", "NVIDIA H100 80GB HBM3"),
            ("first-contact", "NVIDIA H200")
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
