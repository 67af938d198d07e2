//! Two test runs on one machine share the test cache: the shared set-up of
//! scripts/test.sh (the Python venv, scripts/test_venv.sh) and of the cuDNN host tier (the
//! wheels and the stub libcuda, scripts/cudnn_host_env.sh) is made once, under a flock, while a
//! second run waits and then reuses it. Each check starts the real script twice at once on a
//! fresh cache folder, with fake installers (a `python3` whose venv and pip only log, sleep
//! and write the files the script looks for; a C compiler that does the same) so that no
//! network or compiler is used, and counts the installs. Without the lock both runs install
//! (and the venv's `rm -rf` deletes the other's half-made copy). Needs bash and flock(1).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("mucudnn-cache-lock-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_script(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    Command::new("chmod").arg("+x").arg(path).status().unwrap();
}

/// Runs `script` in bash twice at once with `envs`; returns both outputs.
fn twice_at_once(script: &str, envs: &[(&str, String)]) -> [Output; 2] {
    let spawn = || {
        let mut command = Command::new("bash");
        command.arg("-c").arg(script).current_dir(root());
        for (key, value) in envs {
            command.env(key, value);
        }
        command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("bash")
    };
    let (a, b) = (spawn(), spawn());
    [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()]
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn count(log: &Path, word: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(word))
        .count()
}

#[test]
fn with_lock_runs_one_set_up_at_a_time() {
    let dir = temp_dir("with-lock");
    let log = dir.join("log");
    let script = r#"source scripts/lock.sh
install() {
  [ -f "$DIR/done" ] && { echo reused >> "$DIR/log"; return 0; }
  echo start >> "$DIR/log"; sleep 1; echo end >> "$DIR/log"; touch "$DIR/done"
}
with_lock "$DIR/set-up.lock" install"#;
    let outputs = twice_at_once(script, &[("DIR", dir.display().to_string())]);
    for output in &outputs {
        assert!(output.status.success(), "{}", text(output));
    }
    // One install from start to end, then the other run reused it: never start, start.
    let lines = std::fs::read_to_string(&log).unwrap();
    assert_eq!(lines, "start\nend\nreused\n", "{lines}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_runs_make_one_python_venv() {
    let dir = temp_dir("venv");
    let log = dir.join("log");
    // A fake python: `-m venv DIR` makes DIR/bin/python (this same fake); `-m pip install`
    // sleeps, as a download would. Each logs what it did.
    let fake = dir.join("fake-python");
    write_script(
        &fake,
        &format!(
            r#"#!/usr/bin/env bash
if [ "$1 $2" = "-m venv" ]; then
  echo "venv $3" >> {log}
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
elif [ "$1 $2" = "-m pip" ]; then
  echo "pip $*" >> {log}
  sleep 1
else
  exit 3
fi
"#,
            log = log.display()
        ),
    );
    let script = r#"source scripts/test_venv.sh
setup_venv && [ -f "$venv/.mucudnn-ready" ] && echo "ready: $venv""#;
    let outputs = twice_at_once(
        script,
        &[
            (
                "MUCUDNN_TEST_CACHE",
                dir.join("cache").display().to_string(),
            ),
            ("PYTHON", fake.display().to_string()),
        ],
    );
    for output in &outputs {
        assert!(output.status.success(), "{}", text(output));
        assert!(String::from_utf8_lossy(&output.stdout).contains("ready: "));
    }
    let lines = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        count(&log, "venv "),
        1,
        "the venv was made more than once:\n{lines}"
    );
    assert_eq!(count(&log, "pip "), 2, "{lines}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_runs_fetch_the_cudnn_host_wheels_and_build_the_stub_once() {
    let dir = temp_dir("host");
    let log = dir.join("log");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // A fake `python3 -m pip install ... --target DIR ...`: the files the script checks for.
    write_script(
        &bin.join("python3"),
        &format!(
            r#"#!/usr/bin/env bash
target=""
while [ $# -gt 0 ]; do [ "$1" = --target ] && target=$2; shift; done
echo "pip $target" >> {log}
sleep 1
mkdir -p "$target/nvidia/cudnn/lib" "$target/nvidia/cu13/lib"
touch "$target/nvidia/cudnn/lib/libcudnn.so.9"
"#,
            log = log.display()
        ),
    );
    // A fake C compiler: logs and writes its -o file.
    let cc = bin.join("fake-cc");
    write_script(
        &cc,
        &format!(
            r#"#!/usr/bin/env bash
out=""
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
echo "cc $out" >> {log}
sleep 1
touch "$out"
"#,
            log = log.display()
        ),
    );
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let outputs = twice_at_once(
        "bash scripts/cudnn_host_env.sh",
        &[
            (
                "MUCUDNN_TEST_CACHE",
                dir.join("cache").display().to_string(),
            ),
            ("PATH", path),
            ("CC", cc.display().to_string()),
        ],
    );
    for output in &outputs {
        assert!(output.status.success(), "{}", text(output));
        assert!(String::from_utf8_lossy(&output.stdout).contains("export MUCUDNN_HOST_CUDNN_DIR="));
    }
    // Both print the same libraries, fetched once; the stub (and its bare variant) built once.
    assert_eq!(outputs[0].stdout, outputs[1].stdout);
    let lines = std::fs::read_to_string(&log).unwrap();
    assert_eq!(count(&log, "pip "), 1, "{lines}");
    assert_eq!(count(&log, "cc "), 2, "{lines}");
    let _ = std::fs::remove_dir_all(&dir);
}
