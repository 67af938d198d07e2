#!/usr/bin/env python3
"""The table of real clients tried with convolutions adopted in place (not a test): runs the
cases of python/tests/test_real_clients_adopt.py (the same builds, steps and measurements)
through ``convert_`` and ``enable(model)`` on the CPU, and prints a Markdown table of the
largest relative errors of outputs and gradients against the unconverted model (and against
float64, with PyTorch's own fp32 beside it, where a model amplifies rounding) and of the
convolution ops counted: run by mucudnn, run by PyTorch (a fallback), of modules left
unconverted, and the step's total.

usage: python3 python/benchmarks/real_clients_table.py
(``PYTHONPATH`` as for the tests: the ``mucudnn`` package, and diffusers, transformers, peft
and accelerate where installed; a case whose package is missing is listed as skipped.)
"""

import gc
import os
import sys
import time
import warnings

os.environ.setdefault("MUCUDNN_QUIET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import pytest  # noqa: E402  (the cases skip through pytest.importorskip)
import torch  # noqa: E402

import test_real_clients_adopt as cases  # noqa: E402

HEADER = (
    "| model | path | output error | gradient error | gradients vs float64: mucudnn / "
    "PyTorch | conv modules called | conv ops: mucudnn / PyTorch / not adopted / total | "
    "s |\n|---|---|---|---|---|---|---|---|"
)


def error(value):
    return "-" if value is None else f"{value:.1e}"


def row(name, path):
    case, _ = cases.CASES[name]
    start = time.perf_counter()
    try:
        m = cases.measure(case, path)
    except pytest.skip.Exception as e:
        return f"| {name} | {path} | skipped: {e} | | | | | |"
    seconds = time.perf_counter() - start
    ran, fell, left = (sum(counts.values()) for counts in (m.ran, m.fell_back, m.left))
    total = sum(m.expected.values()) + left
    gradient = error(m.gradient_error) if case.backward else "-"
    float64 = f"{error(m.float64_error)} / {error(m.pytorch_float64_error)}"
    return (
        f"| {name} | {path} | {error(m.output_error)} | {gradient} | {float64} | {m.called} | "
        f"{ran} / {fell} / {left} / {total} | {seconds:.1f} |"
    )


def main():
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(2)  # as the tests run
    print(f"torch {torch.__version__}, {cases.mt.PATH} path; errors: max |a - b| / max |b|\n")
    print(HEADER)
    for name, (_, paths) in cases.CASES.items():
        for path in paths:
            print(row(name, path), flush=True)
            gc.collect()  # the measured models' layers go before the next case


if __name__ == "__main__":
    main()
