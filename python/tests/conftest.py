"""Shared fixtures: every test gets its own cache file, so tests never read each other's (or
the user's) measurements, and starts with the switch off and an empty account."""

import gc
import sys

import pytest


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Points mucudnn's default cache at a file in this test's tmp dir."""
    path = tmp_path / "cache.sqlite"
    monkeypatch.setenv("MUCUDNN_CACHE", str(path))
    return path


@pytest.fixture(autouse=True)
def clean_switch_and_account():
    """Where the test's module uses mucudnn.torch: the switch off and the account zeroed
    before the test, the switch off after it. On the native path the layers of earlier tests'
    models are collected first: a layer lives while its module does, and it claims the calls
    of any weight of its signature that is not another layer's (another test's model of the
    same shapes would be counted under its name)."""
    mt = sys.modules.get("mucudnn.torch")
    if mt is None:
        yield
        return
    if mt.PATH == "native":
        gc.collect()
    mt.disable()
    mt.reset_account()
    yield
    mt.disable()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "python_path: a test of the Python path's own design (skipped on the native one)"
    )
    config.addinivalue_line(
        "markers",
        "python_smoke: part of the small set scripts/test.sh also runs on the Python path",
    )


def pytest_report_header(config):
    try:
        import mucudnn

        return f"mucudnn library: {mucudnn.library_path()} (version {mucudnn.version()})"
    except Exception as e:  # the tests report the failure themselves
        return f"mucudnn library: not loadable ({e})"
