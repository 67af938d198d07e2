//! One version: Cargo.toml's `[workspace.package] version` is the crate's, the C
//! library's (`mucudnnGetVersion`, `MUCUDNN_VERSION` in include/mucudnn.h) and the Python
//! package's (`mucudnn.__version__` in python/mucudnn/_version.py, which pyproject.toml reads;
//! python/tests/test_tuner.py checks that the loaded library says the same).

use std::path::Path;

fn read(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The value of the first line `key = "value"` after the line `section` in a TOML file.
fn toml_string(text: &str, section: &str, key: &str) -> Option<String> {
    let mut in_section = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_section = line == section;
        } else if in_section {
            if let Some((k, v)) = line.split_once('=') {
                if k.trim() == key {
                    return Some(v.trim().trim_matches('"').to_string());
                }
            }
        }
    }
    None
}

fn numeric(version: &str) -> u32 {
    let parts: Vec<u32> = version
        .split('.')
        .map(|p| {
            p.parse()
                .unwrap_or_else(|_| panic!("{version} is not x.y.z"))
        })
        .collect();
    assert_eq!(parts.len(), 3, "{version} is not x.y.z");
    parts[0] * 10_000 + parts[1] * 100 + parts[2]
}

#[test]
fn cargo_python_and_the_c_abi_have_one_version() {
    let cargo = toml_string(&read("Cargo.toml"), "[workspace.package]", "version")
        .expect("Cargo.toml: [workspace.package] version");
    assert_eq!(cargo, env!("CARGO_PKG_VERSION"));

    let python = read("python/mucudnn/_version.py");
    let python = python
        .lines()
        .find_map(|l| l.strip_prefix("__version__ = "))
        .expect("python/mucudnn/_version.py: __version__ = \"...\"")
        .trim_matches('"');
    assert_eq!(
        python, cargo,
        "python/mucudnn/_version.py against Cargo.toml"
    );

    // pyproject.toml takes the version from _version.py and states none of its own.
    let pyproject = read("python/pyproject.toml");
    assert_eq!(toml_string(&pyproject, "[project]", "version"), None);
    assert!(pyproject.contains("dynamic = [\"version\"]"), "{pyproject}");
    assert!(pyproject.contains("attr = \"mucudnn._version.__version__\""));

    let header = read("include/mucudnn.h");
    let define: u32 = header
        .lines()
        .find_map(|l| l.strip_prefix("#define MUCUDNN_VERSION "))
        .expect("include/mucudnn.h: #define MUCUDNN_VERSION")
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        define,
        numeric(&cargo),
        "MUCUDNN_VERSION against Cargo.toml {cargo}"
    );
    assert_eq!(mucudnn::c_abi::mucudnnGetVersion(), define);
    // The ABI's own version is a separate number and function.
    assert!(header.contains("#define MUCUDNN_ABI_VERSION "));
    assert!(header.contains("uint32_t mucudnnGetAbiVersion(void);"));
    assert_eq!(
        mucudnn::c_abi::mucudnnGetAbiVersion(),
        mucudnn::c_abi::MUCUDNN_ABI_VERSION
    );
    let abi: u32 = header
        .lines()
        .find_map(|l| l.strip_prefix("#define MUCUDNN_ABI_VERSION "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(abi, mucudnn::c_abi::MUCUDNN_ABI_VERSION);
    // The Python package calls the same ABI (and refuses a library of another).
    let python_abi = read("python/mucudnn/_version.py");
    let python_abi = python_abi
        .lines()
        .find_map(|l| l.strip_prefix("__abi_version__ = "))
        .expect("python/mucudnn/_version.py: __abi_version__ = N");
    assert_eq!(
        python_abi.trim().parse::<u32>().unwrap(),
        mucudnn::c_abi::MUCUDNN_ABI_VERSION,
        "python/mucudnn/_version.py's __abi_version__ against MUCUDNN_ABI_VERSION"
    );
}
