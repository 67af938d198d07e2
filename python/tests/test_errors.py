"""Errors name what is wrong: a library that cannot be loaded is reported as
that, naming MUCUDNN_LIBRARY, not as a bad ``workspace_limit`` (the first setting that needed
the library to parse it)."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_missing_library_is_named_not_relabelled_as_workspace_limit(tmp_path):
    missing = str(tmp_path / "nonexistent.so")
    result = run(
        """
        import torch
        from torch import nn
        try:
            import mucudnn.torch as mt
            model = mt.convert_(nn.Sequential(nn.Conv2d(3, 4, 3)), workspace_limit="64MiB")
            model(torch.randn(2, 3, 8, 8))
        except Exception as error:
            print(f"{type(error).__name__}|{getattr(error, 'status', '')}|{error}")
        else:
            print("no error")
        """,
        MUCUDNN_LIBRARY=missing,
    )
    assert result.returncode == 0, result.stderr
    kind, status, message = result.stdout.strip().splitlines()[-1].split("|", 2)
    assert kind == "MucudnnError", result.stdout
    assert status == "NOT_AVAILABLE", result.stdout
    assert f"MUCUDNN_LIBRARY={missing}" in message, result.stdout
    assert "workspace_limit" not in message, result.stdout


def test_a_bad_size_is_still_a_workspace_limit_error():
    import mucudnn.torch as mt
    from torch import nn

    with pytest.raises(ValueError, match="workspace_limit"):
        mt.convert_(nn.Sequential(nn.Conv2d(3, 4, 3)), workspace_limit="64MB")
