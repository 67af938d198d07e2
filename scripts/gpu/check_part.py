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
- every Rust test name after `--exact` exists: by `BINARY --list` where the binary runs here,
  else by its `fn NAME(` in the sources beside .gpu (tests/, src/).

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


def source_defines(name: str) -> bool | None:
    """Whether the Rust sources beside .gpu define `fn LAST_SEGMENT(`; None without sources."""
    roots = [Path("tests"), Path("src")]
    if not any(r.is_dir() for r in roots):
        return None
    pattern = re.compile(r"\bfn\s+" + re.escape(name.split("::")[-1]) + r"\s*\(")
    for root in roots:
        for path in root.rglob("*.rs"):
            if pattern.search(path.read_text(errors="replace")):
                return True
    return False


def check_rust_names(binary: str, names: list[str], packed: set[str],
                     problems: list[str]) -> str:
    listed = rust_names(binary, packed)
    if listed is not None:
        for name in names:
            if name not in listed:
                problems.append(f"{binary} --list has no test {name}")
        return f"{binary} --list"
    for name in names:
        found = source_defines(name)
        if found is None:
            problems.append(f"cannot check {binary}'s test {name}: the binary does not run "
                            "here and no sources are beside .gpu")
        elif not found:
            problems.append(f"no `fn {name.split('::')[-1]}(` in tests/ or src/ ({binary})")
    return f"{binary}: the sources (it does not run here)"


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
    rust: dict[str, list[str]] = {}
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
        if "--exact" in command:
            binary = next(Path(w).name for w in command if w.startswith(".gpu/"))
            after = command[command.index("--exact") + 1:]
            rust.setdefault(binary, []).extend(w for w in after if not w.startswith("-"))
    compiled = compile_all(problems)
    how = [f"{compiled} Python/shell files compile"]
    if pytest_ids:
        how.append(f"{len(pytest_ids)} pytest ids by {check_pytest_ids(pytest_ids, problems)}")
    for binary, names in rust.items():
        how.append(f"{len(names)} Rust tests by {check_rust_names(binary, names, packed, problems)}")
    print(f"{part}: {len(steps)} steps, caps {caps} s of {budget} s; " + "; ".join(how))
    for problem in problems:
        print(f"  {part}: {problem}")
    print(f"{part}: {'ok' if not problems else 'INCOMPLETE'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
