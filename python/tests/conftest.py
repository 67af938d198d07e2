"""Shared fixtures: every test gets its own cache file, so tests never read each other's (or
the user's) measurements."""

import pytest


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Points mucudnn's default cache at a file in this test's tmp dir."""
    path = tmp_path / "cache.sqlite"
    monkeypatch.setenv("MUCUDNN_CACHE", str(path))
    return path


def pytest_report_header(config):
    try:
        import mucudnn

        return f"mucudnn library: {mucudnn.library_path()} (version {mucudnn.version()})"
    except Exception as e:  # the tests report the failure themselves
        return f"mucudnn library: not loadable ({e})"
