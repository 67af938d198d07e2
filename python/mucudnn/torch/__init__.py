"""mucudnn for PyTorch: drop-ins for ``torch.nn``'s convolution layers (1-D, 2-D, 3-D and
transposed) whose convolutions are micro-batched within a workspace limit, tuned once per
device and shape through a persistent cache.

>>> import mucudnn.torch as mt
>>> model = mt.convert_(model, workspace_limit="64MiB")  # every nn.Conv*d, in place
>>> mt.tune(model, example_batch)                          # optional; dealt over DDP ranks

- :class:`Conv1d`, :class:`Conv2d`, :class:`Conv3d`, :class:`ConvTranspose1d`,
  :class:`ConvTranspose2d`, :class:`ConvTranspose3d`: the ``torch.nn`` layers plus keyword-only
  mucudnn options (same constructors and ``state_dict``). 1-D layers run as 2-D with a unit
  height; a transposed layer runs its convolution problem's backward-data, so its three passes
  share that problem's plans; ``channels_last_3d`` runs as NDHWC.
- :func:`convert_`: swap the ``torch.nn`` layers of a model (parameters shared), and keep
  subclasses of them (timm's, diffusers') as they are with their convolutions through mucudnn;
  ``kinds``
  chooses which (``"conv1d"``, ``"conv2d"``, ``"conv3d"``, ``"conv_transpose1d"``,
  ``"conv_transpose2d"``, ``"conv_transpose3d"``; default all).
- :func:`enable` / :func:`disable` / :func:`enabled` (a context manager): every convolution
  PyTorch runs on the thread (modules and ``F.conv*d``, forward and backward) goes through
  mucudnn without touching the model.
- :func:`tune`: tune ahead of the first step (returns a :class:`TuneSummary`); under
  ``torch.distributed`` the measuring is dealt out over the ranks and every rank runs
  identical plans. Without it each layer tunes a new input shape on first use and says so on
  stderr (``MUCUDNN_QUIET=1`` silences that line).
- ``conv.plans``: a :class:`Plans` mapping of input shapes to :class:`PlanReport`, printed
  as a table.
- The ops ``torch.ops.mucudnn.conv2d``, ``conv2d_backward_data``, ``conv2d_backward_filter``,
  ``conv_transpose2d`` and their ``3d`` twins (``torch.library.define``/``impl`` with fake and
  autograd registrations; ``torch.compile`` compatible).
"""

import sys as _sys

from . import _native
from ._ops import (
    conv2d,
    conv2d_backward_data,
    conv2d_backward_filter,
    conv3d,
    conv3d_backward_data,
    conv3d_backward_filter,
    conv_transpose2d,
    conv_transpose3d,
)
from ._options import parse_size
from ._reports import PlanReport, Plans
from ._tune import TuneSummary

if _native.active():
    #: Which path runs this process's convolutions: ``"native"`` (mucudnn's kernels inside
    #: PyTorch's dispatcher, torch >= 2.10) or ``"python"`` (Python custom ops and a torch
    #: function mode, for older torch or ``MUCUDNN_TORCH_PATH=python``).
    PATH = "native"
    from ._modules import (
        KINDS,
        Adoption,
        Conv1d,
        Conv2d,
        Conv3d,
        ConvTranspose1d,
        ConvTranspose2d,
        ConvTranspose3d,
        account,
        convert_,
        disable,
        enable,
        enabled,
        is_enabled,
        plans_of,
        reset_account,
        set_plan_capacity,
    )
    from ._native_tune import tune
else:
    PATH = "python"
    print(
        f"mucudnn: warning: mucudnn.torch runs on its Python path ({_native.why_not}): every "
        "convolution call runs Python; torch >= 2.10 runs mucudnn inside PyTorch's dispatcher",
        file=_sys.stderr,
    )
    from ._dispatch import disable, enable, enabled, is_enabled
    from ._layer import (
        KINDS,
        Conv1d,
        Conv2d,
        Conv3d,
        ConvTranspose1d,
        ConvTranspose2d,
        ConvTranspose3d,
        convert_,
    )
    from ._legacy_account import account, plans_of, reset_account, set_plan_capacity
    from ._tune import tune

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "KINDS",
    "PATH",
    "PlanReport",
    "Plans",
    "TuneSummary",
    "account",
    "conv2d",
    "conv2d_backward_data",
    "conv2d_backward_filter",
    "conv3d",
    "conv3d_backward_data",
    "conv3d_backward_filter",
    "conv_transpose2d",
    "conv_transpose3d",
    "convert_",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "parse_size",
    "plans_of",
    "reset_account",
    "set_plan_capacity",
    "tune",
]
