"""mucudnn's version, the same as the Rust crate's (Cargo.toml's ``[workspace.package]
version``) and the C library's (``mucudnnGetVersion``); tests/versions.rs checks that they
agree, and pyproject.toml reads it from here."""

__version__ = "0.1.0"
