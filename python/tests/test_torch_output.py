"""What the package prints: ``conv.plans`` is a mapping that prints
as a table naming the algorithms, ``tune`` returns a :class:`TuneSummary` whose fields mean one
thing each, and a lazily tuned shape prints one line on stderr unless ``MUCUDNN_QUIET=1``."""

import re

import pytest
import torch
import torch.nn as nn

import mucudnn.torch as mt
from converted import NATIVE, plans_of, python_path_only

CPU_ALGORITHMS = ("direct", "im2col-batched", "im2col-per-image")


def table_rows(text):
    """The data rows of a plans table: the lines between the header and the peak line."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("shape"))
    return [line for line in lines[header + 1 :] if not line.startswith("peak measuring memory")]


def test_plans_print_as_a_table_with_algorithm_names(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MUCUDNN_QUIET", "1")
    # A cache of its own: the in-memory one is shared by every test of the process.
    conv = mt.Conv2d(3, 8, 3, padding=1, cache=str(tmp_path / "c.sqlite"), name="net.table")
    conv(torch.randn(4, 3, 12, 12))
    conv(torch.randn(2, 3, 8, 8))
    plans = conv.plans
    # Still a mapping from input shape to PlanReport.
    assert isinstance(plans[(4, 3, 12, 12)], mt.PlanReport)
    assert list(plans) == [(4, 3, 12, 12), (2, 3, 8, 8)] and len(plans) == 2
    assert dict(plans)[(2, 3, 8, 8)].shape == (2, 3, 8, 8)
    text = str(plans)
    assert repr(plans) == text
    assert text.startswith("net.table on cpu:")
    assert re.search(r"^shape\s+dtype\s+op\s+split\s+predicted\s+workspace\s+plans from$", text, re.M)
    rows = table_rows(text)
    assert len(rows) == 6, text  # one row per (shape, op)
    for shape, report in plans.items():
        for op, info in report.ops.items():
            split = info["split"]
            assert all(run.split("@")[1] in CPU_ALGORITHMS for run in split.split("+")), split
            row = next(r for r in rows if f" {op} " in r and split in r and f"{info['time_ms']:.3f} ms" in r)
            assert row, (op, split)
    assert rows[0].startswith("4x3x12x12  fp32 nchw") and rows[3].startswith("2x3x8x8")
    measured = plans[(4, 3, 12, 12)].measured
    assert measured > 0 and f"{measured} measured, 0 cached" in rows[0]
    peak = plans.peak_measuring_memory_bytes
    assert peak == max(r.peak_measuring_memory_bytes for r in plans.values()) > 0
    assert text.splitlines()[-1] == f"peak measuring memory {mt._runtime.format_bytes(peak)}"
    assert "peak measuring memory" in str(plans[(2, 3, 8, 8)])
    assert capsys.readouterr().err == ""  # quiet
    empty = mt.Conv2d(3, 8, 3, cache=False, name="net.untuned").plans
    assert str(empty) == "net.untuned: no input shape tuned yet" and len(empty) == 0


# The tuner's failures are scripted by patching the Python tuner, which the native path's
# kernels do not call (they tune in the library).
@python_path_only
def test_a_fallback_row_gives_the_reason(monkeypatch):
    from mucudnn import MucudnnError, Tuner

    def no_plan(self, layer, problem, settings):
        raise MucudnnError(f"{layer}: no plan fits 0 B", "SOLVER_ERROR")

    monkeypatch.setattr(Tuner, "tune", no_plan)
    conv = mt.Conv2d(3, 4, 3, cache=False, name="net.nofit")
    conv(torch.randn(2, 3, 6, 6))
    rows = table_rows(str(conv.plans))
    assert len(rows) == 1 and "PyTorch's convolution" in rows[0]
    assert "no plan: net.nofit: no plan fits 0 B" in rows[0]


@pytest.mark.python_smoke
def test_tune_returns_a_summary_whose_fields_mean_one_thing(tmp_path):
    torch.manual_seed(0)
    # Layers 2 and 3 have one problem; layer 4 another.
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1),
        nn.Conv2d(8, 4, 1),
    )
    cache = tmp_path / "cache.sqlite"
    mt.convert_(model, cache=str(cache))
    x = torch.randn(4, 3, 12, 12)
    summary = mt.tune(model, x, verbose=False)
    assert isinstance(summary, mt.TuneSummary)
    assert (summary.layers, summary.shapes, summary.world_size) == (4, 3, 1)
    reports = [plans_of(m)[tuple(m_x)] for m, m_x in (
        (model[0], x.shape), (model[1], (4, 8, 12, 12)), (model[2], (4, 8, 12, 12)),
        (model[3], (4, 8, 12, 12)))]
    assert summary.measured == sum(r.measured for r in reports) > 0
    assert summary.cached == 0 and summary.shared == 0 and summary.fallbacks == 0
    assert summary.tasks_dealt == 0 and summary.tasks_here == []
    assert summary.seconds > 0
    assert summary.peak_measuring_memory_bytes == max(r.peak_measuring_memory_bytes for r in reports) > 0
    # The layer that reuses another's problem says whose plans it runs, and measured nothing.
    assert reports[2].same_as == "1" and reports[2].source == "plans of 1"
    assert reports[2].measured == reports[2].cached == 0
    assert reports[2].ops == reports[1].ops
    assert "plans of 1" in str(plans_of(model[2]))
    # The old dict keys still read the fields.
    assert summary["layers"] == 4 and summary["measured"] == summary.measured
    assert summary["tasks"] == 0 and summary["measured_here"] == []
    with pytest.raises(KeyError):
        summary["nonsense"]
    # A second model on the same cache: everything measured before is now cached.
    torch.manual_seed(0)
    again = mt.convert_(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)), cache=str(cache))
    second = mt.tune(again, x, verbose=False)
    assert (second.layers, second.shapes, second.measured) == (1, 1, 0)
    assert second.peak_measuring_memory_bytes == 0


def test_tune_progress_names_the_layer_whose_plans_a_layer_shares(capsys, tmp_path):
    model = mt.convert_(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)),
        cache=str(tmp_path / "c.sqlite"),
    )
    summary = mt.tune(model, torch.randn(2, 3, 8, 8))
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith("mucudnn: 2 "))
    assert line.endswith("plans of 1)"), err
    assert "0 measured, 0 cached" not in err
    assert err.splitlines()[-1].startswith(f"mucudnn: tuned 3 layer(s), 2 shape(s) in ")
    assert f"{summary.measured} measured, {summary.cached} cached" in err.splitlines()[-1]


def lazy_lines(err):
    return [line for line in err.splitlines() if "on first use" in line]


# capfd, not capsys: the native path's kernels write to the process's stderr.
@pytest.mark.python_smoke
def test_a_lazily_tuned_shape_prints_one_line_per_new_shape(monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("MUCUDNN_QUIET", raising=False)
    cache = str(tmp_path / "c.sqlite")  # its own: other tests' layers share the in-memory one
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=cache, name="net.lazy")
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    conv(x).sum().backward()
    conv(x).sum().backward()
    lines = lazy_lines(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert re.match(
        r"mucudnn: net\.lazy: tuned input shape 2x3x6x6 \(fp32 nchw\) on first use in \d+\.\d\d s.*; "
        r"call mucudnn\.torch\.tune\(model, example_inputs\) ahead of training",
        lines[0],
    ), lines[0]
    conv(torch.randn(3, 3, 6, 6))  # a new shape: one more line
    conv(torch.randn(3, 3, 6, 6))
    lines = lazy_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "3x3x6x6" in lines[0], lines
    # The same shape under another PyTorch switch is another problem, but not a new shape:
    # the Python path says nothing; the native path says what it tunes (from the cache).
    with torch.backends.cudnn.flags(enabled=True, deterministic=True):
        conv(torch.randn(3, 3, 6, 6))
    assert plans_of(conv)[(3, 3, 6, 6)].deterministic
    lines = lazy_lines(capfd.readouterr().err)
    if NATIVE:
        assert len(lines) == 1 and "3x3x6x6" in lines[0] and "0 measured" in lines[0], lines
    else:
        assert lines == []
    # A second layer with the same problem runs the first's plans, and says so: in its plans
    # (and on the Python path in a line of its own; the native path prints a line when it
    # tunes, and nothing was tuned).
    twin = mt.Conv2d(3, 4, 3, padding=1, cache=cache, name="net.twin")
    twin(torch.randn(3, 3, 6, 6))
    lines = lazy_lines(capfd.readouterr().err)
    if NATIVE:
        assert lines == []
    else:
        assert len(lines) == 1 and "net.twin" in lines[0] and "plans of net.lazy" in lines[0], lines
    assert plans_of(twin)[(3, 3, 6, 6)].same_as == "net.lazy"
    # Shapes tuned by tune() print no such line.
    model = mt.convert_(nn.Sequential(nn.Conv2d(3, 4, 3)), cache=False)
    mt.tune(model, torch.randn(5, 3, 6, 6), verbose=False)
    model(torch.randn(5, 3, 6, 6))
    assert lazy_lines(capfd.readouterr().err) == []


@pytest.mark.parametrize("value", ["1", "true"])
def test_mucudnn_quiet_silences_the_lazy_line(monkeypatch, capfd, value):
    monkeypatch.setenv("MUCUDNN_QUIET", value)
    conv = mt.Conv2d(3, 4, 3, padding=1, cache=False, name="net.quiet")
    conv(torch.randn(2, 3, 7, 7))
    conv(torch.randn(4, 3, 7, 7))
    assert lazy_lines(capfd.readouterr().err) == []
    assert len(conv.plans) == 2  # it tuned, silently
    monkeypatch.setenv("MUCUDNN_QUIET", "0")
    conv(torch.randn(6, 3, 7, 7))
    assert len(lazy_lines(capfd.readouterr().err)) == 1


@python_path_only
def test_a_layer_sharing_a_failed_problem_keeps_its_own_fallback_setting(monkeypatch):
    from mucudnn import MucudnnError, Tuner

    def no_plan(self, layer, problem, settings):
        raise MucudnnError(f"{layer}: no plan fits 0 B", "SOLVER_ERROR")

    monkeypatch.setattr(Tuner, "tune", no_plan)
    model = nn.Sequential(
        mt.Conv2d(4, 4, 3, padding=1, cache=False, name="lenient"),
        mt.Conv2d(4, 4, 3, padding=1, cache=False, name="strict", fallback=False),
    )
    with pytest.raises(RuntimeError, match="strict: tuning failed: lenient: no plan fits"):
        mt.tune(model, torch.randn(2, 4, 6, 6), verbose=False)
    assert model[0].plans[(2, 4, 6, 6)].fallback is not None
