"""mucudnn: a micro-batching convolution autotuner (after µ-cuDNN).

cuDNN's fast convolution algorithms need workspace that grows with the batch; under a
workspace limit mucudnn splits a mini-batch into micro-batches, each run with the fastest
algorithm that fits, chosen from measurements kept in a persistent tuning cache.

- :mod:`mucudnn.torch`: ``Conv2d`` (a drop-in ``torch.nn.Conv2d``), ``convert_`` and ``tune``.
- :class:`Tuner`: the layer API underneath (tune, share measurements, prepare, execute).
"""

from ._lib import MucudnnError, library_path
from ._tuner import OPS, PreparedSet, Settings, Tuner, operand_extents, problem

__version__ = "0.1.0"

__all__ = [
    "MucudnnError",
    "OPS",
    "PreparedSet",
    "Settings",
    "Tuner",
    "library_path",
    "operand_extents",
    "problem",
    "version",
]


def version() -> int:
    """The library's version number (10000 * major + 100 * minor + patch)."""
    from . import _lib

    return int(_lib.library().mucudnnGetVersion())
