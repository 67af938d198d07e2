//! `include/mucudnn.h` is generated from `src/c_abi/` by cbindgen (configured by `cbindgen.toml`).
//! This test regenerates it into memory and fails when the checked-in header differs;
//! `MUCUDNN_BLESS=1 cargo test --test c_header` writes the new header instead.

use std::path::Path;

const BLESS_ENV: &str = "MUCUDNN_BLESS";

/// The header as cbindgen generates it now.
fn generate(root: &Path) -> String {
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("cannot read cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/c_abi/mod.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen cannot generate the header from src/c_abi/: {e}"));
    let mut bytes = Vec::new();
    bindings.write(&mut bytes);
    String::from_utf8(bytes).expect("cbindgen writes UTF-8")
}

/// `(line number, checked-in line, generated line)` of the first difference.
fn first_difference<'a>(old: &'a str, new: &'a str) -> (usize, &'a str, &'a str) {
    let (mut old_lines, mut new_lines) = (old.lines(), new.lines());
    let mut number = 1;
    loop {
        match (old_lines.next(), new_lines.next()) {
            (Some(a), Some(b)) if a == b => number += 1,
            (a, b) => {
                return (
                    number,
                    a.unwrap_or("<end of file>"),
                    b.unwrap_or("<end of file>"),
                )
            }
        }
    }
}

#[test]
fn header_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("include/mucudnn.h");
    let generated = generate(root);
    assert!(generated.contains("mucudnnConvolutionForward"));
    if std::env::var(BLESS_ENV).as_deref() == Ok("1") {
        std::fs::create_dir_all(root.join("include")).unwrap();
        std::fs::write(&path, &generated).unwrap();
        println!("wrote {}", path.display());
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let (line, old, new) = first_difference(&checked_in, &generated);
        panic!(
            "include/mucudnn.h is out of date: run `{BLESS_ENV}=1 cargo test --test c_header` \
             to regenerate it from src/c_abi/ (first difference at line {line}:\n  checked in: \
             {old}\n  generated:  {new})"
        );
    }
}
