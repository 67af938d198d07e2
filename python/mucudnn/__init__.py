"""mucudnn: a micro-batching convolution autotuner (after µ-cuDNN).

cuDNN's fast convolution algorithms need workspace that grows with the batch; under a
workspace limit mucudnn splits a mini-batch into micro-batches, each run with the fastest
algorithm that fits, chosen from measurements kept in a persistent tuning cache.

- :mod:`mucudnn.torch`: ``Conv1d``, ``Conv2d``, ``Conv3d`` and ``ConvTranspose1d/2d/3d``
  (drop-ins for the ``torch.nn`` layers), ``convert_`` and ``tune``.
- :class:`Tuner`: the layer API underneath (tune, share measurements, prepare, execute).
"""

from ._lib import MucudnnError, library_path
from ._tuner import OPS, PreparedSet, Settings, Tuner, operand_extents, problem
from ._version import __abi_version__, __version__

__all__ = [
    "MucudnnError",
    "OPS",
    "PreparedSet",
    "Settings",
    "Tuner",
    "__abi_version__",
    "__version__",
    "abi_version",
    "library_path",
    "operand_extents",
    "problem",
    "version",
]


def version() -> str:
    """The loaded library's version, ``"major.minor.patch"`` (from ``mucudnnGetVersion``); it
    equals ``__version__`` unless the package and its library come from different builds."""
    from . import _lib

    number = int(_lib.library().mucudnnGetVersion())
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}"


def abi_version() -> int:
    """The version of the C ABI the loaded library implements (``mucudnnGetAbiVersion``)."""
    from . import _lib

    return int(_lib.library().mucudnnGetAbiVersion())
