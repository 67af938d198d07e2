"""The GPU acceptance's spatial-split benchmark (scripts/gpu/spatial_bench.py) runs
end to end on the CPU at its --smoke size: the SDXL and Wan VAE decoders' convolutions,
converted with split="auto" at 64 MiB, 256 MiB and 1 GiB per layer, against PyTorch's outputs;
and, with split="spatial" forced, every layer's forward plan splits along h and still matches.
The decoders' shapes come from the mucudnn binary (`tune --list --json`): MUCUDNN_BIN, else
the cargo build's debug binary."""

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


def run_bench(out, *extra):
    binary = mucudnn_binary()
    if binary is None:
        pytest.skip("no mucudnn binary: build it (cargo build) or set MUCUDNN_BIN")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "spatial_bench.py"), str(out),
         "--smoke", "--mucudnn", binary, *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "MUCUDNN_QUIET": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads((out / "spatial_bench.json").read_text())


def test_spatial_bench_smoke(tmp_path):
    done, report = run_bench(tmp_path)
    assert report["smoke"] and report["failures"] == []
    assert report["limits"] == ["64MiB", "256MiB", "1GiB"] and report["goal_limit"] == "256MiB"
    # The image decoder at 64x64, channels / 32: 36 convolutions, 13 distinct; the video
    # decoder as nd_bench's smoke size has it: 75, 24 distinct.
    for part, layers, convolutions in (("sdxl", 13, 36), ("wan", 24, 75)):
        result = report[part]
        assert (result["layers"], result["convolutions"]) == (layers, convolutions), part
        assert result["split"] == "auto"
        assert [r["variant"] for r in result["rows"]] == ["pytorch", "64MiB", "256MiB", "1GiB"]
        for row in result["rows"]:
            assert row["total_ms"] > 0 and row["max_rel_err"] <= 1e-3
            assert len(row["layers"]) == layers
            pytorch = row["variant"] == "pytorch"
            assert row["tuned_ops"] == ([] if pytorch else ["fwd"])
            # Every converted layer reports its forward's split (no fallback at this size).
            assert all((layer["split"] is None) == pytorch for layer in row["layers"])
            assert not any(str(layer["split"]).startswith("fallback") for layer in row["layers"])
        assert set(result["goal_at_256MiB"]) == {"not_slower", "memory_below", "speedup"}
    assert "SDXL VAE decoder convs" in done.stdout and "Wan VAE decoder convs" in done.stdout


def test_spatial_bench_reports_spatial_plans(tmp_path):
    done, report = run_bench(tmp_path, "--parts", "sdxl", "--split", "spatial")
    assert "wan" not in report and report["failures"] == []
    rows = report["sdxl"]["rows"]
    for row in rows[1:]:
        # Forced: every layer's forward runs in chunks along h, and matches PyTorch.
        assert row["spatial_layers"] == [layer["layer"] for layer in row["layers"]]
        assert all(layer["split"].endswith(" along h") for layer in row["layers"])
        assert row["max_rel_err"] <= 1e-3
    assert " along h" in done.stdout
