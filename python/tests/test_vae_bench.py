"""The GPU benchmark of whole diffusers VAE decodes (scripts/gpu/vae_bench.py) runs end to end
on the CPU at its --smoke size: every variant of both topologies decodes, mucudnn's variants
tune, run no fallback and match the fp32 decode, and the JSON and the table are written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="diffusers is in the test venv (scripts/test.sh)")
ROOT = Path(__file__).resolve().parents[2]


def test_vae_bench_smoke(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "vae_bench.py"), str(tmp_path / "out"),
         "--smoke", "--cases", "wan,sdxl1024", "--repeats", "1", "--cap-s", "250",
         "--cache", str(tmp_path / "cache.sqlite")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MUCUDNN_QUIET": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "out" / "vae_bench.json").read_text())
    assert report["smoke"] and report["failures"] == [] and report["limits"] == ["256MiB", "1GiB"]
    for name in ("wan", "sdxl1024"):
        rows = report["cases"][name]["rows"]
        assert [r["variant"] for r in rows] == [
            "pytorch", "enable_tiling", "mucudnn 256MiB", "mucudnn 1GiB"
        ]
        for row in rows:
            assert row["time_ms"] > 0 and row["repeats"] == 1
            if row["variant"].startswith("mucudnn"):
                assert row["fallbacks"] == [] and row["tuning_s"] > 0
                assert row["max_error_vs_fp32"] <= 1e-5
    table = (tmp_path / "out" / "vae_bench.md").read_text()
    assert "| wan | mucudnn 1GiB |" in table
