"""The keyword options every mucudnn layer (and ``convert_``, ``enable``) takes: parsing and
checking them, and their documentation."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Union

from .. import _lib
from .._lib import MucudnnError
from .._tuner import SPLITS, Settings


def parse_size(value: Union[int, str, None]) -> Optional[int]:
    """Bytes from an int, ``"64MiB"`` (or ``K``/``M``/``G``/``T``, powers of 1024; parsed by the
    library, as the CLI parses sizes), or ``None`` / ``"unlimited"`` for no limit. Decimal units
    (``"64MB"``) are refused as ambiguous."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"workspace_limit must be bytes or a size string, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"workspace_limit must be >= 0 bytes, not {value}")
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("unlimited", "none"):
            return None
        # A library that cannot be loaded (MUCUDNN_LIBRARY, a missing build) raises its own
        # error here, not one labelled as a bad workspace_limit.
        _lib.library()
        try:
            return _lib.parse_size(value)
        except MucudnnError as e:
            raise ValueError(f"workspace_limit: {e}") from None
    raise TypeError(f"workspace_limit must be bytes or a size string, not {type(value).__name__}")


_POLICIES = ("undivided", "power-of-two", "all")
_CANDIDATES = ("legacy", "engines", "all")


def make_settings(
    workspace_limit: Union[int, str, None] = "64MiB",
    policy: str = "power-of-two",
    candidates: str = "all",
    max_candidates: Optional[int] = None,
    prune_margin: Optional[float] = 1.5,
    split: str = "auto",
    verify: bool = True,
) -> Settings:
    check_split(split)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, not {verify!r}")
    if policy not in _POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(_POLICIES)}")
    if candidates not in _CANDIDATES:
        raise ValueError(f"candidates {candidates!r}: expected one of {', '.join(_CANDIDATES)}")
    if max_candidates is not None and (not isinstance(max_candidates, int) or max_candidates < 1):
        raise ValueError(f"max_candidates must be a whole number >= 1 or None, not {max_candidates!r}")
    if prune_margin is not None and not (float(prune_margin) > 1.0):
        raise ValueError(f"prune_margin must be > 1 or None, not {prune_margin!r}")
    return Settings(
        policy=policy,
        workspace_limit=parse_size(workspace_limit),
        candidates=candidates,
        max_candidates=max_candidates,
        prune_margin=None if prune_margin is None else float(prune_margin),
        split=split,
        verify=verify,
    )


#: The keyword-only options of every mucudnn layer, with their defaults.
LAYER_OPTIONS: Dict[str, Any] = dict(
    workspace_limit="64MiB", policy="power-of-two", candidates="all", cache=None,
    max_candidates=None, prune_margin=1.5, verbose=False, fallback=True, split="auto",
    verify=True,
)


def check_split(split: Any) -> None:
    """Raises unless ``split`` is one of ``"batch"``, ``"spatial"``, ``"auto"``."""
    if not isinstance(split, str) or split not in SPLITS:
        error = ValueError if isinstance(split, str) else TypeError
        raise error(f"split must be 'batch', 'spatial' or 'auto', not {split!r}")


_OPTIONS_DOC = """
    Keyword-only options: ``workspace_limit`` (bytes, ``"64MiB"``, or ``None`` for no limit;
    per layer and op), ``policy`` (``"power-of-two"``, ``"all"``, ``"undivided"``),
    ``candidates`` (``"all"``, ``"legacy"``, ``"engines"``), ``cache`` (a file path; ``None``:
    the default location; ``False``: in memory only), ``name`` (shown in plans and errors),
    ``max_candidates``, ``prune_margin``, ``verbose``, ``split`` (what a plan splits:
    ``"batch"``, micro-batches only; ``"spatial"``, chunks of rows along the outermost spatial
    dimension of the output (D for 3-D, H for 2-D, W for 1-D; exact: each chunk reads its
    input rows with their halo); ``"auto"``, the default: micro-batches, and chunks too when
    the batch is at most 4 and a candidate was skipped over the workspace limit, keeping the
    faster plan; plans are tuned and kept apart per setting), ``verify`` (default ``True``:
    each candidate's output is compared with the reference candidate's while tuning, and one
    that computes wrong numbers is never planned; ``False`` skips the comparison), and
    ``fallback`` (default ``True``: an
    input shape that no candidate supports, or whose plans cannot fit the limit, runs PyTorch's
    own convolution, with a warning on stderr and the reason in :attr:`plans`; ``False``:
    raise instead). An input shape tuned on first use (not by :func:`mucudnn.torch.tune`) prints
    one line on stderr, unless the environment sets ``MUCUDNN_QUIET=1``.

    CPU tensors run mucudnn's CPU backend (fp32, fp16, bf16); CUDA tensors run cuDNN plans on
    the current stream with workspace from PyTorch's caching allocator. ``channels_last``
    (``channels_last_3d``) inputs run as NHWC (NDHWC).
"""


def options_text(options: Dict[str, Any], label: str) -> str:
    """The canonical text of a set of layer options (the native runtime's config: tuning
    settings, cache, ``fallback``, ``verbose``), checked: an unknown option is a ``TypeError``,
    a bad value a ``TypeError`` or ``ValueError``, each naming ``label``."""
    import json
    import os

    unknown = sorted(set(options) - set(LAYER_OPTIONS))
    if unknown:
        raise TypeError(f"{label}: unknown option(s) {', '.join(unknown)}")
    o = {**LAYER_OPTIONS, **options}
    try:
        settings = make_settings(
            o["workspace_limit"], o["policy"], o["candidates"], o["max_candidates"],
            o["prune_margin"], o["split"], o["verify"],
        )
        cache = o["cache"]
        if cache is not None and cache is not False:
            if not isinstance(cache, (str, os.PathLike)) or not os.fspath(cache):
                raise TypeError(
                    f"cache must be a file path, None (the default file) or False (in memory), "
                    f"not {cache!r}"
                )
            cache = os.fspath(cache)
        for flag in ("verbose", "fallback"):
            if not isinstance(o[flag], bool):
                raise TypeError(f"{flag} must be True or False, not {o[flag]!r}")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{label}: {e}") from None
    doc = settings.to_dict()
    doc.pop("deterministic")  # read from PyTorch's switches at each call
    doc.pop("ops", None)  # decided per call: whether a backward may follow
    return json.dumps(
        {"cache": cache, "fallback": o["fallback"], "settings": doc, "verbose": o["verbose"]},
        sort_keys=True,
        separators=(",", ":"),
    )


def check_kinds(kinds: Union[str, Iterable[str], None], known: Iterable[str]) -> Tuple[str, ...]:
    """``convert_``'s ``kinds``: one name or several of ``known`` (all of them for ``None``)."""
    known = tuple(known)
    if kinds is None:
        return known
    if isinstance(kinds, str):
        kinds = (kinds,)
    try:
        chosen = tuple(kinds)
    except TypeError:
        raise TypeError(
            f"kinds must be names of layer kinds ({', '.join(known)}), not {kinds!r}"
        ) from None
    unknown = [k for k in chosen if k not in known]
    if unknown:
        raise ValueError(
            f"kinds: unknown {', '.join(map(repr, unknown))} (expected some of "
            f"{', '.join(known)})"
        )
    if not chosen:
        raise ValueError(f"kinds is empty: name at least one of {', '.join(known)}")
    return chosen
