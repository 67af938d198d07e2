//! The C ABI from C: compiles `tests/c/abi_test.c` with the system C compiler (`cc`, or `$CC`)
//! against `include/mucudnn.h` and the library cargo built for this test run, links it once
//! with the static library and once with the shared one, and runs both on the recorded H100
//! profile. Needs no GPU (`abi_test.c` checks that mucudnnCreate says so); a CPU tuner tunes,
//! prepares and runs a tiny problem, and operands of another shape are refused. Also checks
//! that the header compiles as strict C99 and, where a C++ compiler is installed, as C++.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C compiler: `$CC`, else `cc`. Its absence fails the test with what to install.
fn c_compiler() -> String {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    match Command::new(&cc).arg("--version").output() {
        Ok(output) if output.status.success() => cc,
        Ok(output) => panic!(
            "the C compiler `{cc}` does not work ({}): the C ABI test needs one (apt-get install \
             gcc, or set CC)",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(e) => panic!(
            "no C compiler `{cc}` ({e}): the C ABI test compiles tests/c/abi_test.c; install one \
             (apt-get install gcc) or point CC at it"
        ),
    }
}

/// This build's `name` (`libmucudnn.a` or `libmucudnn.so`), from next to the test executable
/// (`target/<profile>/deps`) or its parent (`target/<profile>`), copied into this test's own
/// directory: a cargo run beside this one (another test binary, an editor) may be rewriting the
/// original while the C compiler reads it.
fn library_copy(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let candidates: Vec<PathBuf> = [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .map(|dir| dir.join(name))
        .collect();
    let copy_dir = out_dir().join(name.replace('.', "_"));
    std::fs::create_dir_all(&copy_dir).unwrap();
    let copy = copy_dir.join(name);
    for _attempt in 0..20 {
        for path in &candidates {
            if path.is_file() && std::fs::copy(path, &copy).is_ok() {
                return copy;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    panic!(
        "{name} not found in {candidates:?}: cargo builds it with the lib target (Cargo.toml's \
         crate-type includes staticlib and cdylib)"
    )
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn out_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c_abi");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tests here compile and run one program at a time: a binary written while another
/// thread forks can be "text file busy" when run, and two links of a 100+ MB static library at
/// once only compete for the machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `command`, failing the test with its output when it fails; returns its stdout.
fn run(mut command: Command, what: &str) -> String {
    const TEXT_FILE_BUSY: i32 = 26; // ETXTBSY: retried, it passes as soon as the writer is gone
    let mut attempts = 0;
    let output = loop {
        match command.output() {
            Err(e) if e.raw_os_error() == Some(TEXT_FILE_BUSY) && attempts < 20 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            result => {
                break result.unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"))
            }
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{command:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    if !stderr.trim().is_empty() {
        println!("{what} (stderr):\n{stderr}");
    }
    stdout
}

/// `cc` with the flags every compile here uses: strict C, all warnings as errors.
fn cc_command(cc: &str) -> Command {
    let mut command = Command::new(cc);
    command
        .args(["-std=c99", "-D_POSIX_C_SOURCE=200809L"])
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
        .arg("-I")
        .arg(root().join("include"));
    command
}

fn run_abi_test(binary: &Path) {
    let profile = root().join("tests/fixtures/h100-alexnet-profile.json");
    let mut command = Command::new(binary);
    command.arg(&profile);
    let stdout = run(command, &format!("{}", binary.display()));
    print!("{stdout}");
    assert!(stdout.contains("mucudnnSolveProfile: 30 plans"), "{stdout}");
    assert!(stdout.contains("checks passed"), "{stdout}");
}

#[test]
fn c_program_against_the_static_library() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cc = c_compiler();
    let library = library_copy("libmucudnn.a");
    let binary = out_dir().join("abi_test_static");
    let mut command = cc_command(&cc);
    command
        .arg(root().join("tests/c/abi_test.c"))
        .arg(&library)
        // The Rust standard library's system dependencies (`--print native-static-libs`).
        .args([
            "-lgcc_s",
            "-lutil",
            "-lrt",
            "-lpthread",
            "-lm",
            "-ldl",
            "-lc",
        ])
        .arg("-o")
        .arg(&binary);
    run(
        command,
        "compiling and linking tests/c/abi_test.c with libmucudnn.a",
    );
    run_abi_test(&binary);
}

#[test]
fn c_program_against_the_shared_library() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cc = c_compiler();
    let library = library_copy("libmucudnn.so");
    let dir = library.parent().unwrap();
    let binary = out_dir().join("abi_test_shared");
    let mut command = cc_command(&cc);
    command
        .arg(root().join("tests/c/abi_test.c"))
        .arg("-L")
        .arg(dir)
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .args(["-lmucudnn", "-lpthread"])
        .arg("-o")
        .arg(&binary);
    run(
        command,
        "compiling and linking tests/c/abi_test.c with libmucudnn.so",
    );
    run_abi_test(&binary);
}

#[test]
fn header_compiles_alone_as_c_and_cpp() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cc = c_compiler();
    let source = out_dir().join("header_only.c");
    std::fs::write(
        &source,
        "#include \"mucudnn.h\"\n#include \"mucudnn.h\" /* the include guard */\n\
         int main(void) { mucudnnOptions_t o; (void)o; return MUCUDNN_OP_FORWARD; }\n",
    )
    .unwrap();
    let mut command = cc_command(&cc);
    command.arg("-fsyntax-only").arg(&source);
    run(command, "compiling include/mucudnn.h as C99");

    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    if Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        let mut command = Command::new(&cxx);
        command
            .args([
                "-x",
                "c++",
                "-std=c++11",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
            ])
            .arg("-fsyntax-only")
            .arg("-I")
            .arg(root().join("include"))
            .arg(&source);
        run(command, "compiling include/mucudnn.h as C++11");
    } else {
        println!("no C++ compiler `{cxx}`: the header's C++ check is skipped");
    }
}

/// A 663-byte profile whose mini-batch is 2^30, solved through the C ABI in a process of its
/// own under a 4 GiB address-space limit, as a memory-limited caller runs: the solver used to
/// make DP tables of 16 bytes per row of the extent with an infallible allocation, which
/// aborted the caller. Now its cost follows the sizes measured, and sizes that make up too
/// many partial sums are a solver error naming the problem.
#[cfg(target_os = "linux")]
#[test]
fn a_huge_extent_is_a_solver_error_not_an_abort_of_the_caller() {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cc = c_compiler();
    let library = library_copy("libmucudnn.so");
    let dir = library.parent().unwrap();
    let binary = out_dir().join("solve_bounded");
    let mut command = cc_command(&cc);
    command
        .arg(root().join("tests/c/solve_bounded.c"))
        .arg("-L")
        .arg(dir)
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .args(["-lmucudnn", "-lpthread"])
        .arg("-o")
        .arg(&binary);
    run(
        command,
        "compiling and linking tests/c/solve_bounded.c with libmucudnn.so",
    );
    let profile = root().join("tests/fixtures/hostile/huge-extent.json");
    let started = std::time::Instant::now();
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(&binary)
        .arg(&profile);
    let stdout = run(command, "solve_bounded under a 4 GiB address-space limit");
    assert!(
        stdout.contains("status: MUCUDNN_STATUS_SOLVER_ERROR"),
        "{stdout}"
    );
    assert!(
        stdout.contains("huge fp32 nchw fwd: an extent of 1073741824 is too large to solve"),
        "{stdout}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}
