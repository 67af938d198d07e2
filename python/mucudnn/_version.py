"""mucudnn's version, the same as the Rust crate's (Cargo.toml's ``[workspace.package]
version``) and the C library's (``mucudnnGetVersion``); tests/versions.rs checks that they
agree, and pyproject.toml reads it from here."""

__version__ = "0.1.0"

#: The C ABI this package calls (``MUCUDNN_ABI_VERSION`` of include/mucudnn.h; tests/versions.rs
#: checks that they agree). A library of another ABI version is refused when it is loaded: its
#: functions may take other arguments (version 2: 15 operand dims in mucudnnTunerExecute; version 3: the mucudnnTorch*
#: functions the native path of mucudnn.torch calls).
__abi_version__ = 3
