"""Spatial splits in PyTorch, on CPU tensors: a converted model at batch 1 with
``split="spatial"`` forced and a tight ``workspace_limit`` runs plans of chunks along the
outermost spatial dimension (checked in the layers' plan reports) and matches the unconverted
model, outputs and input, weight and bias gradients; ``split="auto"`` at batch 1 under a tight
limit gives plans (spatial or batch) that match too; ``split="batch"`` gives batch plans; a bad
value is a clear error; the setting keeps plans apart.

Every layer is made with ``fallback=False``, so a shape mucudnn cannot tune is an error, never
a silent run of PyTorch's convolution.
"""

import copy
import json

import pytest
import torch
from torch import nn

import mucudnn.torch as mt
from converted import NATIVE, by_pytorch, converted_layers, fallbacks, options_of, plans_of
from mucudnn._tuner import Settings, Tuner


def conv2d_model():
    """Conv2d layers over stride 2 at odd sizes, dilation 2, a 1x1 kernel, padding larger
    than the halo and groups."""
    return nn.Sequential(
        nn.Conv2d(8, 16, 3, stride=2, padding=1),  # 17x17 -> 9x9
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, dilation=2, padding=2),  # 9x9
        nn.ReLU(),
        nn.Conv2d(16, 12, 1),  # no halo
        nn.ReLU(),
        nn.Conv2d(12, 16, 3, padding=3, groups=4),  # 9x9 -> 13x13
    )


def conv3d_model():
    return nn.Sequential(
        nn.Conv3d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(8, 8, 3, stride=2, padding=2, dilation=2),
    )


def conv1d_model():
    return nn.Sequential(
        nn.Conv1d(8, 16, 5, padding=2),
        nn.ReLU(),
        nn.Conv1d(16, 16, 3, stride=2, dilation=2, padding=3, groups=2),
    )


def conv_transpose2d_model():
    return nn.Sequential(
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1),  # 7x7 -> 14x14
        nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 3, padding=1, groups=2),
    )


# name: (model, input shape at batch 1, workspace limit tight enough that no unsplit
# im2col fits)
MODELS = {
    "conv2d": (conv2d_model, (1, 8, 17, 17), "8KiB"),
    "conv3d": (conv3d_model, (1, 4, 6, 8, 8), "32KiB"),
    "conv1d": (conv1d_model, (1, 8, 64), "2KiB"),
    "conv_transpose2d": (conv_transpose2d_model, (1, 16, 7, 7), "8KiB"),
}


# The CPU algorithms' numbers: direct (no workspace), im2col-batched, im2col-per-image.
DIRECT, IM2COL_BATCHED, IM2COL_PER_IMAGE = 0, 1, 2


def discovered_problems(model, x):
    """(problem, settings) of each convolution the converted ``model`` runs on ``x``, as its
    layers tune them (tune()'s discovery pass of the path)."""
    if NATIVE:
        from mucudnn.torch import _native_tune

        calls = _native_tune._discover(model, (x,), {})
        return [(c["problem"], Settings(**json.loads(c["options"])["settings"])) for c in calls]
    from mucudnn.torch import _keys, _tune

    return [
        (_keys.problem_of(key), layer._mucudnn.settings_for(key))
        for layer, key in _tune._discover(model, (x,), {})
    ]


@pytest.fixture
def scripted(tmp_path):
    """Which plan wins must not depend on the host clock: ``scripted(model, x)`` stores in
    the layers' cache file (``SCRIPTED_CACHE`` under the test's tmp dir) scripted
    measurements of every task the model's problems lack (through the tuner task API:
    missing, then store, as another rank's measurements would arrive), before the layers
    tune from it. A chunk costs its rows squared (so several small chunks beat one large
    one); the whole batch costs 1 ms for direct, and its im2col candidates are recorded as
    skipped over the limit (the workspace pressure auto looks for). The plans then execute
    for real."""

    def fake(task, limit):
        micro = task["micro"]
        if task.get("split") == "spatial":
            measurements = [
                {"algo": algo, "micro": micro, "time_ms": 1e-3 * micro * micro + 1e-4 * (algo + 1),
                 "workspace_bytes": 0}
                for algo in (DIRECT, IM2COL_BATCHED, IM2COL_PER_IMAGE)
            ]
            return {"task": task, "measurements": measurements}
        return {
            "task": task,
            "measurements": [
                {"algo": DIRECT, "micro": micro, "time_ms": 1.0 * micro, "workspace_bytes": 0}
            ],
            "skipped": [
                {"algo": algo, "micro": micro, "workspace_bytes": limit + 1}
                for algo in (IM2COL_BATCHED, IM2COL_PER_IMAGE)
            ],
        }

    def script(model, x):
        tuner = Tuner(cache=str(tmp_path / SCRIPTED_CACHE))
        try:
            problems = discovered_problems(model, x)
            assert problems, "the model ran no converted convolution"
            for problem, settings in problems:
                layers = [{"layer": "scripted", "problem": problem}]
                # Two rounds: under auto, the chunk tasks appear once the batch sizes are
                # stored.
                for _ in range(2):
                    tasks = tuner.missing(layers, settings)
                    if not tasks:
                        break
                    measured = [fake(t, settings.workspace_limit) for t in tasks]
                    tuner.store({"fingerprint": tuner.fingerprint(), "measured": measured})
        finally:
            tuner.close()

    return script


#: The cache file scripted measurements go to (in the test's tmp dir).
SCRIPTED_CACHE = "scripted.sqlite"


def converted_pair(name, split, cache=False):
    build, shape, limit = MODELS[name]
    torch.manual_seed(0)
    reference = build()
    # Scripted measurements (a cache given) carry no verification: a verifying layer would
    # measure those sizes again, on the host clock.
    ours = mt.convert_(
        copy.deepcopy(reference), workspace_limit=limit, split=split,
        cache=False if cache is False else str(cache), fallback=False,
        verify=cache is False,
    )
    x = torch.randn(shape)
    return reference, ours, x


def run(model, x):
    """Output and the gradients of the input and every parameter, of a loss that weighs every
    output element differently."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    weights = torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape)
    (y * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return y.detach(), x.grad.clone(), grads


def assert_match(reference, ours, x):
    with by_pytorch():
        y0, dx0, g0 = run(reference, x)
    y1, dx1, g1 = run(ours, x)
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx1, dx0, atol=1e-5, rtol=1e-5)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")


def layers(model):
    return converted_layers(model)


def reports(model):
    """Each converted layer's single plan report."""
    out = []
    for layer in layers(model):
        plans = plans_of(layer)
        assert len(plans) == 1, str(plans)
        (report,) = plans.values()
        assert report.fallback is None, str(report)
        out.append((layer, report))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_forced_spatial_at_batch_1_matches_pytorch(name, scripted, tmp_path):
    reference, ours, x = converted_pair(name, "spatial", tmp_path / SCRIPTED_CACHE)
    scripted(ours, x)
    assert_match(reference, ours, x)
    assert fallbacks() == {}
    chunked = 0
    for layer, report in reports(ours):
        assert report.tuned_ops == ("fwd", "bwd_data", "bwd_filter"), str(report)
        # Forced: every op's plan splits the outermost spatial dimension, and says so.
        assert report.spatial_ops == report.tuned_ops, str(report)
        axis = {1: "w", 2: "h", 3: "d"}[len(layer.kernel_size)]
        for op, info in report.ops.items():
            assert info["dimension"] == "spatial", (op, info)
            assert info["split"].endswith(f" along {axis}"), (op, info)
            assert info["calls"] == sum(
                int(run.split("x")[0]) for run in info["split"].split(" ")[0].split("+")
            ), (op, info)
        # Scripted times: small chunks win wherever the axis has more than one row.
        if any(k > 1 for k in layer.kernel_size):
            assert max(info["calls"] for info in report.ops.values()) >= 2, str(report)
            chunked += 1
        text = str(plans_of(layer))
        assert f"along {axis}" in text, text
        assert options_of(layer)["settings"]["split"] == "spatial"
        if not NATIVE:  # the Python path's replaced layers show their options
            assert "split spatial" in repr(layer), repr(layer)
    assert chunked >= 2, str([str(plans_of(layer)) for layer in layers(ours)])


@pytest.mark.python_smoke
@pytest.mark.parametrize("name", ["conv2d", "conv_transpose2d"])
def test_auto_at_batch_1_matches_pytorch(name, scripted, tmp_path):
    reference, ours, x = converted_pair(name, "auto", tmp_path / SCRIPTED_CACHE)
    scripted(ours, x)
    assert_match(reference, ours, x)
    # Scripted: the batch sizes skipped im2col over the limit, and chunks are faster.
    assert any(report.spatial_ops for _, report in reports(ours)), [
        str(plans_of(layer)) for layer in layers(ours)
    ]
    for _, report in reports(ours):
        assert report.tuned_ops == ("fwd", "bwd_data", "bwd_filter"), str(report)
        for op, info in report.ops.items():
            assert info["dimension"] in ("batch", "spatial"), (op, info)
            assert (" along " in info["split"]) == (info["dimension"] == "spatial"), (op, info)


def test_batch_split_gives_batch_plans():
    reference, ours, x = converted_pair("conv2d", "batch")
    assert_match(reference, ours, x)
    for layer, report in reports(ours):
        assert report.spatial_ops == (), str(report)
        for info in report.ops.values():
            assert info["dimension"] == "batch" and " along " not in info["split"], info
        assert options_of(layer)["settings"]["split"] == "batch"


@pytest.mark.parametrize("bad", ["height", "Spatial", "", None, 1])
def test_bad_split_is_a_clear_error(bad):
    with pytest.raises((ValueError, TypeError), match="split must be 'batch', 'spatial' or 'auto'"):
        mt.Conv2d(4, 4, 3, split=bad)
    with pytest.raises((ValueError, TypeError), match="split must be 'batch', 'spatial' or 'auto'"):
        mt.convert_(nn.Sequential(nn.Conv1d(2, 2, 3)), split=bad)


def test_split_is_part_of_the_configuration():
    """The setting reaches the settings JSON and the layer's configuration text (which keys
    its prepared plans), so layers of different settings never share plans."""
    torch.manual_seed(0)
    spatial = mt.Conv2d(8, 8, 3, padding=1, split="spatial", workspace_limit="8KiB",
                        cache=False, fallback=False)
    batch = mt.Conv2d(8, 8, 3, padding=1, split="batch", workspace_limit="8KiB",
                      cache=False, fallback=False)
    default = mt.Conv2d(8, 8, 3, padding=1, workspace_limit="8KiB", cache=False, fallback=False)
    assert options_of(default)["settings"]["split"] == "auto"
    assert '"split": "auto"' in Settings().to_json()
    assert options_of(spatial)["settings"]["split"] == "spatial"
    assert options_of(batch)["settings"]["split"] == "batch"
    batch.load_state_dict(spatial.state_dict())
    x = torch.randn(1, 8, 12, 12)
    with torch.no_grad():
        y_spatial = spatial(x)
        y_batch = batch(x)
    torch.testing.assert_close(y_batch, y_spatial, atol=1e-5, rtol=1e-5)
    (r_spatial,) = spatial.plans.values()
    (r_batch,) = batch.plans.values()
    assert r_spatial.spatial_ops == ("fwd",), str(r_spatial)
    assert r_batch.spatial_ops == () and r_batch.same_as is None, str(r_batch)
    # A pickled (deep-copied) layer keeps its setting.
    assert options_of(copy.deepcopy(spatial))["settings"]["split"] == "spatial"


def test_tune_entry_point_uses_the_split_setting():
    reference, ours, x = converted_pair("conv2d", "spatial")
    summary = mt.tune(ours, x, verbose=False)
    assert summary.fallbacks == 0
    for _, report in reports(ours):
        assert report.spatial_ops == report.tuned_ops == ("fwd", "bwd_data", "bwd_filter")
    assert_match(reference, ours, x)


def test_tuner_settings_split_reaches_the_c_abi():
    """The Python tuner wrapper passes ``split`` in the settings JSON: a spatial plan says so
    (``"split": "spatial"``, its split string ``along h``), a batch plan does not, and a bad
    value is the library's INVALID_ARGUMENT."""
    from mucudnn._lib import MucudnnError
    from mucudnn._tuner import Tuner, problem

    tuner = Tuner(cache=False)
    conv = problem(n=1, c=4, h=8, w=8, k=4, r=3, s=3, padding=(1, 1))
    spatial = tuner.tune("t", conv, Settings(split="spatial", ops=("fwd",)))
    assert spatial["plans"][0]["split"] == "spatial"
    assert spatial["splits"][0].endswith(" along h"), spatial["splits"]
    assert sum(m["size"] for m in spatial["plans"][0]["micro_batches"]) == 8
    batch = tuner.tune("t", conv, Settings(split="batch", ops=("fwd",)))
    assert batch["plans"][0].get("split", "batch") == "batch"
    assert " along " not in batch["splits"][0]
    with pytest.raises(MucudnnError, match="split") as raised:
        tuner.tune("t", conv, Settings(split="height"))
    assert raised.value.status == "INVALID_ARGUMENT"
    tuner.close()
