#!/usr/bin/env python3
"""`accept.sh --check PART`'s checker, on the build machine (no GPU): is .gpu complete for PART?

accept.sh records each step of the part (name, cap, command words) without running it; this
checks, from the folder above .gpu:

- the caps add up to the part's minutes (less 10 s for unpacking the summary; first-contact:
  300 s at most);
- every `.gpu/...` word of a command is in .gpu (a binary may be inside binaries.tar.xz), and
  what the part needs from build.sh (its needs column) was built, not left NOT-BUILT;
- every Python file in .gpu compiles and every shell script parses (`bash -n`);
- every pytest node id a step selects exists: by `pytest --collect-only` where torch and pytest
  import, else by reading the test file (the function is defined and its parameter id is made
  of the file's string literals);
- every Rust test executable runs through accept.sh's `rust_tests` (which fails a run of no
  test, or of fewer than it names), and every test it selects exists: with `--exact`, each
  name is a test; without, each filter matches one at least (`--skip NAME` selects nothing).
  By `BINARY --list` where the binary runs here, else by the sources beside .gpu: a name with
  a module path (`c_abi::tuner::tests::NAME`) must resolve through src/'s files and inline
  `mod`s to a file defining `fn NAME(`; a plain name must be a `fn NAME(` of tests/.

usage: check_part.py PART MINUTES "NEEDS" STEPS.tsv      (exit status 1 on any problem)
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

G = Path(".gpu")

# What each need of the PARTS table means in .gpu (beyond the files the commands name).
NEEDS = {
    "bin": ["binaries.tar.xz:mucudnn"],
    "tests": ["binaries.tar.xz"],
    "lib": ["c_abi/libmucudnn.so", "python/mucudnn/__init__.py", "c_abi/c_client.c",
            "c_abi/pytorch_ctypes.py", "c_abi/mucudnn.h"],
    "wheel": ["mucudnn-*-py3-none-manylinux_2_28_x86_64.whl"],
    "pytest": ["python/tests/conftest.py", "wheels/pytest-*.whl"],
    "diffusers": ["wheels-vae/diffusers-*.whl"],
    "vae_bench": ["vae_bench.py"],
    "candle": ["candle/candle_cnn"],
    "candle_ddp": ["candle_ddp/candle_ddp"],
}


def packed_binaries() -> set[str]:
    archive = G / "binaries.tar.xz"
    if not archive.is_file():
        return set()
    with tarfile.open(archive) as tar:
        return {Path(m.name).name for m in tar.getmembers() if m.isfile()}


def present(relative: str, packed: set[str]) -> bool:
    """Whether .gpu/RELATIVE exists (a glob; `binaries.tar.xz:NAME`: packed there)."""
    if ":" in relative:
        archive, name = relative.split(":", 1)
        return (G / archive).is_file() and name in packed
    if any(c in relative for c in "*?["):
        return any(G.glob(relative))
    return (G / relative).exists() or relative in packed


def not_built(relative: str) -> str | None:
    """The NOT-BUILT note of a folder build.sh could not fill, if any."""
    note = G / relative.split("/")[0] / "NOT-BUILT"
    return note.read_text().strip() if note.is_file() else None


def compile_all(problems: list[str]) -> int:
    count = 0
    for path in sorted(G.rglob("*.py")):
        if "out" in path.relative_to(G).parts[:1]:
            continue
        try:
            compile(path.read_bytes(), str(path), "exec")
        except (SyntaxError, ValueError) as e:
            problems.append(f"{path} does not compile: {e}")
        count += 1
    for path in sorted(G.rglob("*.sh")):
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"{path} does not parse: {done.stderr.strip()}")
        count += 1
    return count


def collected(test_file: Path) -> set[str] | None:
    """The test ids (`function[params]`) pytest collects from `test_file`, or None where
    pytest or torch cannot be imported here."""
    python = os.environ.get("ACCEPT_PYTHON", "python3")
    env = dict(os.environ, PYTHONPATH=f"{G / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    probe = subprocess.run([python, "-c", "import torch, pytest"], capture_output=True, env=env)
    if probe.returncode != 0:
        return None
    done = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(test_file)],
        capture_output=True, text=True, env=env,
    )
    if done.returncode != 0:
        return None
    return {line.split("::", 1)[1] for line in done.stdout.splitlines() if "::" in line}


def literal_id(text: str, literals: set[str]) -> bool:
    """Whether a parameter id such as `legacy-fp32-nchw-5x5-s2-g2` is a `-`-joined sequence
    of the file's string literals."""
    if text in literals:
        return True
    return any(text.startswith(lit + "-") and literal_id(text[len(lit) + 1:], literals)
               for lit in literals if lit)


def check_pytest_ids(ids: list[str], problems: list[str]) -> str:
    by_file: dict[str, list[str]] = {}
    for node in ids:
        path, test = node.split("::", 1)
        by_file.setdefault(path, []).append(test)
    methods = []
    for path, tests in by_file.items():
        file = Path(path)
        if not file.is_file():
            problems.append(f"{path} is not in .gpu")
            continue
        names = collected(file)
        if names is not None:
            methods.append("pytest --collect-only")
            for test in tests:
                if test not in names:
                    problems.append(f"pytest collects no {path}::{test}")
            continue
        methods.append("reading the test file (no torch/pytest here)")
        tree = ast.parse(file.read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        literals = {n.value for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for test in tests:
            name, _, params = test.partition("[")
            if name not in functions:
                problems.append(f"{path} defines no {name}")
            elif params and not literal_id(params.rstrip("]"), literals):
                problems.append(f"{path}::{test}: the id {params.rstrip(']')} is not made of "
                                "the file's parameter names")
    return ", ".join(sorted(set(methods))) or "-"


def rust_names(binary: str, packed: set[str]) -> set[str] | None:
    """The test names `binary --list` prints, or None where it does not run here."""
    path = G / binary
    with tempfile.TemporaryDirectory() as tmp:
        if not path.is_file() and binary in packed:
            with tarfile.open(G / "binaries.tar.xz") as tar:
                member = next(m for m in tar.getmembers() if Path(m.name).name == binary)
                tar.extract(member, tmp)
                path = Path(tmp) / member.name
        try:
            done = subprocess.run([str(path), "--list"], capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        return {line[:-len(": test")] for line in done.stdout.splitlines()
                if line.endswith(": test")}


def module_file(path: list[str]) -> tuple[Path, list[str]] | None:
    """The file of the longest prefix of module `path` under src/ (`a/b.rs` or `a/b/mod.rs`)
    and the rest of the path (inline modules of that file); None when not even the first
    segment is a file (then the path is the crate root's: src/lib.rs)."""
    for i in range(len(path), 0, -1):
        base = Path("src", *path[:i])
        for file in (base.with_suffix(".rs"), base / "mod.rs"):
            if file.is_file():
                return file, path[i:]
    return None


def inline_modules_hold(text: str, modules: list[str]) -> bool:
    """Whether `text` declares the inline modules `modules`, each inside the one before."""
    at = 0
    for name in modules:
        found = re.compile(r"\bmod\s+" + re.escape(name) + r"\s*\{").search(text, at)
        if not found:
            return False
        at = found.end()
    return True


def source_defines(name: str, exact: bool) -> bool | None:
    """Whether the sources beside .gpu hold test `name` (exact) or a test matching filter
    `name`; None without sources."""
    if not any(Path(r).is_dir() for r in ("tests", "src")):
        return None
    segments = name.split("::")
    if len(segments) > 1 or not exact:
        modules, function = (segments[:-1], segments[-1]) if exact else (segments, None)
        if not exact and len(segments) == 1:
            # A plain filter: some test function's name contains it.
            pattern = re.compile(r"\bfn\s+\w*" + re.escape(name) + r"\w*\s*\(")
            return any(pattern.search(p.read_text(errors="replace"))
                       for root in ("tests", "src") for p in Path(root).rglob("*.rs"))
        found = module_file(modules)
        file, inline = found if found else (Path("src/lib.rs"), modules)
        if not file.is_file():
            return False
        text = file.read_text(errors="replace")
        if not inline_modules_hold(text, inline):
            return False
        if function is None:  # a module filter: the module exists and holds a test
            under = file.parent.rglob("*.rs") if file.name == "mod.rs" else []
            return "#[test]" in text or any(
                "#[test]" in p.read_text(errors="replace") for p in under)
        return re.search(r"\bfn\s+" + re.escape(function) + r"\s*\(", text) is not None
    pattern = re.compile(r"\bfn\s+" + re.escape(name) + r"\s*\(")
    return any(pattern.search(p.read_text(errors="replace")) for p in Path("tests").glob("*.rs"))


def check_rust_names(binary: str, names: list[str], exact: bool, packed: set[str],
                     problems: list[str]) -> str:
    listed = rust_names(binary, packed)
    if listed is not None:
        for name in names:
            if exact and name not in listed:
                problems.append(f"{binary} --list has no test {name}")
            elif not exact and not any(name in test for test in listed):
                problems.append(f"{binary} --list has no test matching {name}")
        return f"{binary} --list"
    for name in names:
        found = source_defines(name, exact)
        if found is None:
            problems.append(f"cannot check {binary}'s test {name}: the binary does not run "
                            "here and no sources are beside .gpu")
        elif not found:
            what = "test" if exact else "test matching"
            problems.append(f"no {what} {name} in the sources ({binary}; src/ by its module "
                            "path, tests/ by its name)")
    return f"{binary}: the sources (it does not run here)"


def rust_selection(command: list[str]) -> tuple[str, list[str], bool, list[str]]:
    """A `rust_tests BINARY ARGS...` command's binary, the names or filters it selects,
    whether they are exact, and the names it skips (`--skip NAME`)."""
    binary = Path(command[1]).name
    names, skipped, skip = [], [], False
    for word in command[2:]:
        if skip:
            skipped.append(word)
            skip = False
        elif word == "--skip":
            skip = True
        elif not word.startswith("-"):
            names.append(word)
    return binary, names, "--exact" in command, skipped


#: The Rust test executables build.sh packs (the mucudnn CLI is not one).
TEST_BINARIES = {"lib-tests", "gpu-tests", "gpu-engines", "gpu-teardown", "current-context"}


def main() -> int:
    part, minutes, needs, steps_file = sys.argv[1:5]
    problems: list[str] = []
    packed = packed_binaries()
    steps = [line.rstrip("\n").split("\t") for line in open(steps_file) if line.strip()]
    if not steps:
        problems.append("no steps")
    budget = 300 if part == "first-contact" else int(minutes) * 60 - 10
    caps = sum(int(s[1]) for s in steps)
    if caps > budget:
        problems.append(f"the step caps add up to {caps} s, over the part's {budget} s")
    for need in needs.split():
        for relative in NEEDS.get(need, []):
            note = not_built(relative)
            if note:
                problems.append(f"needs {need}: not built: {note}")
            elif not present(relative, packed):
                problems.append(f"needs {need}: .gpu/{relative} is missing "
                                f"(scripts/gpu/build.sh --parts {part})")
    pytest_ids: list[str] = []
    rust: dict[tuple[str, bool], list[str]] = {}
    rust_all: set[str] = set()
    for name, _cap, *command in steps:
        # (a `sh -c "..."` argument holds several words, some ending in ; or quotes)
        words = [w.strip(";'\"()") for arg in command for w in arg.split()]
        for word in words:
            if word.startswith(".gpu/"):
                relative = word[len(".gpu/"):].split("::")[0]
                if not present(relative, packed):
                    problems.append(f"step {name!r} uses {word}, which is not in .gpu")
            if "::" in word and word.startswith(".gpu/") and ".py::" in word:
                pytest_ids.append(word)
        if command and command[0] == "rust_tests":
            binary, names, exact, skipped = rust_selection(command)
            if not names and exact:
                problems.append(f"step {name!r}: --exact with no test name")
            rust.setdefault((binary, exact), []).extend(names)
            # A skipped test that no longer exists is a stale skip: it must be a test too.
            rust.setdefault((binary, True), []).extend(skipped)
            if not names:
                rust_all.add(binary)
        elif any(Path(w).name in TEST_BINARIES for w in command if w.startswith(".gpu/")):
            problems.append(f"step {name!r} runs a Rust test executable without rust_tests "
                            "(a run of no test would pass)")
    compiled = compile_all(problems)
    how = [f"{compiled} Python/shell files compile"]
    if pytest_ids:
        how.append(f"{len(pytest_ids)} pytest ids by {check_pytest_ids(pytest_ids, problems)}")
    for (binary, exact), names in rust.items():
        if names:
            how.append(f"{len(names)} Rust {'tests' if exact else 'filters'} by "
                       f"{check_rust_names(binary, names, exact, packed, problems)}")
    for binary in sorted(rust_all):
        how.append(f"all of {binary}")
    print(f"{part}: {len(steps)} steps, caps {caps} s of {budget} s; " + "; ".join(how))
    for problem in problems:
        print(f"  {part}: {problem}")
    print(f"{part}: {'ok' if not problems else 'INCOMPLETE'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
