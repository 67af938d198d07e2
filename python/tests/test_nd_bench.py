"""The GPU acceptance's 3-D benchmark (scripts/gpu/nd_bench.py) runs end to end on the CPU at
its --smoke size: the Wan VAE decoder's convolutions and r3d_18 training steps, converted at
256 MiB and 1 GiB per layer, against PyTorch's outputs. The decoder's shapes come from the
mucudnn binary (`tune --list --json`): MUCUDNN_BIN, else the cargo build's debug binary."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def mucudnn_binary():
    candidates = [os.environ.get("MUCUDNN_BIN")]
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        candidates.append(os.path.join(target, "debug", "mucudnn"))
    candidates += [str(ROOT / "target" / "debug" / "mucudnn"), shutil.which("mucudnn")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def test_nd_bench_smoke(tmp_path):
    binary = mucudnn_binary()
    if binary is None:
        pytest.skip("no mucudnn binary: build it (cargo build) or set MUCUDNN_BIN")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "nd_bench.py"), str(tmp_path),
         "--smoke", "--mucudnn", binary],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "MUCUDNN_QUIET": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "nd_bench.json").read_text())
    assert report["smoke"] and report["failures"] == []
    vae = report["vae"]
    # The tiny decoder (5 frames of 16x16, channels / 24): one later chunk and the first; at
    # 16 channels conv_in has the mid block's shape, so 24 distinct.
    assert (vae["layers"], vae["convolutions"]) == (24, 75)
    assert [r["variant"] for r in vae["rows"]] == ["pytorch", "256MiB", "1GiB"]
    for row in vae["rows"]:
        assert row["total_ms"] > 0 and row["max_rel_err"] <= 1e-3
        assert len(row["layers"]) == 24
        # Inference (no_grad) tunes the forward op alone.
        assert row["tuned_ops"] == ([] if row["variant"] == "pytorch" else ["fwd"])
    r3d = report["r3d"]
    assert [r["variant"] for r in r3d["rows"]] == ["pytorch", "256MiB", "1GiB"]
    assert all(r["step_ms"] > 0 and r["loss_rel_err"] <= 1e-3 for r in r3d["rows"])
    assert set(r3d["goal_at_1GiB"]) == {"not_slower", "memory_at_or_below", "speedup"}
    assert "VAE decoder convs" in done.stdout and "r3d_18 training step" in done.stdout
