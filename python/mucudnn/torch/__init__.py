"""mucudnn for PyTorch: a drop-in ``Conv2d`` whose convolutions are micro-batched within a
workspace limit, tuned once per device and shape through a persistent cache.

>>> import mucudnn.torch as mt
>>> model = mt.convert_(model, workspace_limit="64MiB")  # every nn.Conv2d, in place
>>> mt.tune(model, example_batch)                          # optional; dealt over DDP ranks

- :class:`Conv2d`: ``torch.nn.Conv2d`` plus keyword-only mucudnn options.
- :func:`convert_`: swap every ``nn.Conv2d`` of a model (parameters shared).
- :func:`tune`: tune ahead of the first step (returns a :class:`TuneSummary`); under
  ``torch.distributed`` the measuring is dealt out over the ranks and every rank runs
  identical plans. Without it each layer tunes a new input shape on first use and says so on
  stderr (``MUCUDNN_QUIET=1`` silences that line).
- ``conv.plans``: a :class:`Plans` mapping of input shapes to :class:`PlanReport`, printed
  as a table.
- The ops ``torch.ops.mucudnn.conv2d``, ``conv2d_backward_data`` and
  ``conv2d_backward_filter`` (``torch.library.define``/``impl`` with fake and autograd
  registrations; ``torch.compile`` compatible).
"""

from ._layer import Conv2d, convert_, parse_size
from ._ops import conv2d, conv2d_backward_data, conv2d_backward_filter
from ._runtime import PlanReport, Plans
from ._tune import TuneSummary, tune

__all__ = [
    "Conv2d",
    "PlanReport",
    "Plans",
    "TuneSummary",
    "conv2d",
    "conv2d_backward_data",
    "conv2d_backward_filter",
    "convert_",
    "parse_size",
    "tune",
]
