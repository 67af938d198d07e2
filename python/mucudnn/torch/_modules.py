"""The native path's modules and switch: converted convolutions adopted in place
(:func:`convert_`), mucudnn's own layers (:class:`Conv2d` and the others), the process-wide
switch (:func:`enable`, :func:`disable`, :func:`enabled`) and the account of what ran.

A converted module is the same object, of the same class, with the same forward, hooks,
parametrizations, attributes and ``state_dict``: mucudnn adds one attribute,
``module._mucudnn`` (an :class:`Adoption`: the layer's name, options and what identifies its
convolution calls), and registers it with the native runtime. The convolutions the module
performs, whatever path they take (``nn.Conv2d.forward``, a subclass's ``F.conv2d`` with a
computed weight or padding, an instance-level ``forward``, a hook, activation checkpointing's
recomputation, ``torch.func``), reach PyTorch's dispatcher, where mucudnn's kernel finds the
layer by its weight (or, for a weight computed per call, by its signature) and runs its plans.
Nothing of the module is read or written but its plain attributes (``kernel_size``,
``stride``, ``groups``, ...) and, when it holds a plain weight parameter, that parameter's
identity: a parametrized or hooked weight is never computed by mucudnn.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Type, Union

import torch
from torch import nn

from . import _native, _reports
from ._options import _OPTIONS_DOC, check_kinds, options_text

_CONV_BASES: Dict[str, Tuple[Type[nn.Module], int, bool]] = {
    "conv1d": (nn.Conv1d, 1, False),
    "conv2d": (nn.Conv2d, 2, False),
    "conv3d": (nn.Conv3d, 3, False),
    "conv_transpose1d": (nn.ConvTranspose1d, 1, True),
    "conv_transpose2d": (nn.ConvTranspose2d, 2, True),
    "conv_transpose3d": (nn.ConvTranspose3d, 3, True),
}


def _kind_of(module: nn.Module) -> Optional[str]:
    for kind, (base, _, _) in _CONV_BASES.items():
        if isinstance(module, base):
            return kind
    return None


def _values(value: Any, spatial: int) -> List[int]:
    if isinstance(value, int):
        return [value] * spatial
    values = [int(v) for v in value]
    return values * spatial if len(values) == 1 else values


def signature_of(module: nn.Module) -> Dict[str, Any]:
    """What identifies a convolution module's calls, from its attributes (never its weight):
    the weight shape its convolution receives, stride, dilation, groups, transposed."""
    kind = _kind_of(module)
    if kind is None:
        raise TypeError(f"{type(module).__name__} is not a convolution module")
    _, spatial, transposed = _CONV_BASES[kind]
    groups = int(module.groups)
    kernel = _values(module.kernel_size, spatial)
    if transposed:
        weight = [int(module.in_channels), int(module.out_channels) // groups] + kernel
    else:
        weight = [int(module.out_channels), int(module.in_channels) // groups] + kernel
    return {
        "transposed": transposed,
        "weight": weight,
        "stride": _values(module.stride, spatial),
        "dilation": _values(module.dilation, spatial),
        "groups": groups,
    }


def _computes_weight(module: nn.Module) -> bool:
    """Whether the module may hand its convolution another weight than its parameter: it has
    no plain weight parameter (a parametrization, weight norm, pruning), or a ``forward`` of
    its own (a subclass's, or one set on the instance)."""
    kind = _kind_of(module)
    base = _CONV_BASES[kind][0] if kind is not None else None
    return (
        _plain_weight(module) is None
        or "forward" in module.__dict__
        or (base is not None and type(module).forward is not base.forward)
    )


def _plain_weight(module: nn.Module) -> Optional[torch.Tensor]:
    """The module's weight parameter, when it holds one as such (a parametrized, weight-normed
    or pruned module computes its weight per call: None, and nothing is computed here)."""
    weight = module._parameters.get("weight")
    return weight if isinstance(weight, torch.Tensor) else None


def _unsupported(module: nn.Module) -> Optional[str]:
    """Why a convolution module cannot be converted (None: it can)."""
    weight = module._parameters.get("weight")
    if isinstance(weight, nn.parameter.UninitializedParameter):
        return "a lazy module must see an input before conversion"
    try:
        signature = signature_of(module)
    except (TypeError, ValueError, AttributeError) as e:
        return f"its geometry cannot be read ({e})"
    if signature["groups"] < 1 or any(v < 1 for v in signature["weight"]):
        return f"its weight shape {signature['weight']} holds no convolution"
    return None


class Adoption:
    """What mucudnn adds to a converted module (its one attribute, ``module._mucudnn``): the
    layer's name, options and signature, registered with the runtime while this object lives
    (so while the module does). Pickles as plain values; a copy registers again."""

    __slots__ = ("layer", "_weight")

    def __init__(
        self, name: str, options: str, signature: Dict[str, Any], weight: Optional[torch.Tensor]
    ):
        self.layer = _native.Layer(name, options, signature, weight)
        self._weight = None if weight is None else weakref.ref(weight)

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def options(self) -> str:
        return self.layer.options

    @property
    def signature(self) -> Dict[str, Any]:
        return self.layer.signature

    @property
    def plans(self) -> "_reports.Plans":
        """The plans prepared now for this layer's convolutions, by this layer's input shape,
        printed as a table (see :class:`mucudnn.torch.Plans`). A problem another layer tuned
        first (one of the same shape, or the convolution a transposed layer mirrors) is
        reported with ``same_as`` naming it."""
        plans = {}
        for doc in _native.reports(self.options, self.signature):
            report = _reports.from_native(doc)
            tuned_by = doc.get("name")
            # Calls matched by signature run under "<first> (or N more of its shape)": the
            # first layer's own.
            if tuned_by and tuned_by != self.name and not tuned_by.startswith(f"{self.name} (or "):
                # Another layer's tuning: this layer measured and waited for nothing.
                report.same_as = tuned_by
                report.measured = report.cached = report.skipped = 0
                report.tuning_seconds = 0.0
                report.peak_measuring_memory_bytes = 0
            plans[_reports.layer_shape(report, self.signature)] = report
        return _reports.Plans(self.name, plans)

    def is_current(self, module: nn.Module) -> bool:
        """Whether this registration still identifies ``module``'s calls: after surgery (a new
        weight parameter, another stride, kernel, dilation or groups) it does not, and the
        module's calls run PyTorch's kernels until it is converted again."""
        weight = None if self._weight is None else self._weight()
        return layer_signature(module) == self.signature and weight is _plain_weight(module)

    def __reduce__(self):
        return (_restored, (self.name, self.options, self.signature))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Adoption":
        # The module's parameters are copied before this attribute (set after them): the
        # copy's own weight is in the memo.
        weight = None if self._weight is None else self._weight()
        copied = memo.get(id(weight)) if weight is not None else None
        return Adoption(self.name, self.options, self.signature, copied)

    def __repr__(self) -> str:
        return f"mucudnn layer {self.name!r}"


def _restored(name: str, options: str, signature: Dict[str, Any]) -> Adoption:
    """pickle's constructor of an :class:`Adoption`: its module's weight is not known here, so
    the layer claims the calls of its signature until converted again."""
    return Adoption(name, options, dict(signature, computes_weight=True), None)


def layer_signature(module: nn.Module) -> Dict[str, Any]:
    """A module's signature as its registration carries it (with ``computes_weight``)."""
    return dict(signature_of(module), computes_weight=_computes_weight(module))


def adopt(module: nn.Module, name: str, options: str) -> Adoption:
    """Converts ``module`` in place: registers it as the layer ``name`` with ``options``."""
    adoption = Adoption(name, options, layer_signature(module), _plain_weight(module))
    module.__dict__["_mucudnn"] = adoption
    return adoption


def _kinds(kinds: Union[str, Iterable[str], None]) -> Tuple[str, ...]:
    return check_kinds(kinds, _CONV_BASES)


def warn_skipped(name: str, reason: str) -> None:
    """The one warning ``convert_`` gives for a module it leaves to PyTorch."""
    print(f"mucudnn: warning: {name}: left to PyTorch ({reason})", file=sys.stderr)


def convert_(
    model: nn.Module,
    *,
    kinds: Union[str, Iterable[str], None] = None,
    skip_unsupported: bool = False,
    **options: Any,
) -> nn.Module:
    """Makes every convolution module of ``model`` (``nn.Conv1d/2d/3d``,
    ``nn.ConvTranspose1d/2d/3d`` and their subclasses) run its convolutions through mucudnn,
    in place: each module stays the same object of the same class, with its forward, hooks,
    parametrizations, attributes and ``state_dict``; it gains one attribute,
    ``module._mucudnn`` (its name, options and ``plans``). ``kinds`` chooses which (names from
    ``"conv1d"``, ``"conv2d"``, ``"conv3d"``, ``"conv_transpose1d"``, ``"conv_transpose2d"``,
    ``"conv_transpose3d"``; default all); ``options`` are the layers' keyword-only options;
    each layer is named by its module path (``"conv"`` when ``model`` itself is one).

    All or nothing: a module that cannot be converted (a lazy module not yet initialised) is an
    error naming its path, and the model is left as it was; with ``skip_unsupported=True`` it
    is left to PyTorch with one warning naming it. A module converted before takes the
    ``options`` given (the others at their defaults); with none it is left as it is, unless
    surgery changed what identifies its calls (a new weight parameter, another stride,
    kernel, dilation or groups: its calls then run PyTorch's kernels), when it is registered
    again under its name and options.

    Returns ``model``."""
    if "name" in options:
        raise TypeError("convert_ names each layer by its module path; do not pass name=")
    chosen = _kinds(kinds)
    text = options_text(options, "convert_")
    targets: List[Tuple[str, nn.Module]] = []
    problems: List[Tuple[str, str]] = []
    for path, module in model.named_modules():
        kind = _kind_of(module)
        if kind is None or kind not in chosen:
            continue
        name = path or "conv"
        earlier = module.__dict__.get("_mucudnn")
        if isinstance(earlier, Adoption) and not options and earlier.is_current(module):
            continue
        reason = _unsupported(module)
        if reason is not None:
            problems.append((f"{name} ({type(module).__name__})", reason))
            continue
        if isinstance(earlier, Adoption):
            # Converted before: its name, and its options unless new ones are given.
            targets.append((earlier.name, module, text if options else earlier.options))
        else:
            targets.append((name, module, text))
    if problems and not skip_unsupported:
        first, reason = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(
            f"convert_: {first}: {reason}{more}; nothing was converted (skip_unsupported=True "
            "leaves such modules to PyTorch)"
        )
    for name, reason in problems:
        warn_skipped(name, reason)
    made: List[Tuple[nn.Module, Any]] = []
    try:
        for name, module, layer_options in targets:
            made.append((module, module.__dict__.get("_mucudnn")))
            adopt(module, name, layer_options)
    except Exception as e:
        for module, earlier in reversed(made):
            if earlier is None:
                module.__dict__.pop("_mucudnn", None)
            else:
                module.__dict__["_mucudnn"] = earlier
        raise type(e)(f"convert_: {name}: {e}; nothing was converted") from e
    return model


# ------------------------------------------------------------------------------------------
# mucudnn's own layers


class _MucudnnConv:
    """What mucudnn's layers share: the ``torch.nn`` layer, converted at construction."""

    kind: str = ""
    # torch.jit.script compiles the nn layer's forward (whose convolution mucudnn's kernel
    # runs); these Python-only reports are left out of it.
    __jit_unused_properties__ = ["mucudnn_name", "plans"]

    def __init__(
        self,
        *args: Any,
        workspace_limit: Union[int, str, None] = "64MiB",
        policy: str = "power-of-two",
        candidates: str = "all",
        cache: Any = None,
        name: Optional[str] = None,
        max_candidates: Optional[int] = None,
        prune_margin: Optional[float] = 1.5,
        verbose: bool = False,
        fallback: bool = True,
        split: str = "auto",
        verify: bool = True,
        **kwargs: Any,
    ):
        label = name or f"mucudnn.torch.{type(self).__name__}"
        text = options_text(
            dict(
                workspace_limit=workspace_limit, policy=policy, candidates=candidates,
                cache=cache, max_candidates=max_candidates, prune_margin=prune_margin,
                verbose=verbose, fallback=fallback, split=split, verify=verify,
            ),
            label,
        )
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        adopt(self, name or f"{self.kind}.{id(self):x}", text)  # type: ignore[arg-type]

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # pickle, torch.load: registered again with this module's own weight.
        super().__setstate__(state)  # type: ignore[misc]
        earlier = self.__dict__.get("_mucudnn")
        if isinstance(earlier, Adoption):
            adopt(self, earlier.name, earlier.options)  # type: ignore[arg-type]

    @property
    def mucudnn_name(self) -> str:
        return self._mucudnn.name  # type: ignore[attr-defined]

    @property
    def plans(self) -> "_reports.Plans":
        """Per input shape tuned so far (prepared now), a :class:`PlanReport`; prints as a
        table."""
        return self._mucudnn.plans  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        s = json.loads(self._mucudnn.options)["settings"]  # type: ignore[attr-defined]
        limit = s.get("workspace_limit")
        limit = "unlimited" if limit is None else f"{limit} B"
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, mucudnn: {s['policy']}, {limit}, {s['candidates']}, split {s['split']}"


def _doc(torch_name: str, extra: str = "") -> str:
    return (
        f"A ``torch.nn.{torch_name}`` (same constructor, parameters, ``state_dict`` keys, "
        "forward and semantics) whose convolutions run mucudnn's plans: each new input shape "
        "is tuned on first sight through the tuning cache (the file the ``mucudnn`` CLI "
        f"uses), then only executed.{extra}\n" + _OPTIONS_DOC
    )


class Conv1d(_MucudnnConv, nn.Conv1d):
    kind = "conv1d"
    __doc__ = _doc("Conv1d", " It runs as a 2-D convolution with a unit height.")


class Conv2d(_MucudnnConv, nn.Conv2d):
    kind = "conv2d"
    __doc__ = _doc("Conv2d")


class Conv3d(_MucudnnConv, nn.Conv3d):
    kind = "conv3d"
    __doc__ = _doc("Conv3d")


class ConvTranspose1d(_MucudnnConv, nn.ConvTranspose1d):
    kind = "conv_transpose1d"
    __doc__ = _doc("ConvTranspose1d", " It runs as its convolution problem's backward-data.")


class ConvTranspose2d(_MucudnnConv, nn.ConvTranspose2d):
    kind = "conv_transpose2d"
    __doc__ = _doc("ConvTranspose2d", " It runs as its convolution problem's backward-data.")


class ConvTranspose3d(_MucudnnConv, nn.ConvTranspose3d):
    kind = "conv_transpose3d"
    __doc__ = _doc("ConvTranspose3d", " It runs as its convolution problem's backward-data.")


#: ``convert_``'s kinds: the ``torch.nn`` class of each, and mucudnn's layer of that kind.
KINDS: Dict[str, Tuple[Type[nn.Module], Type[_MucudnnConv]]] = {
    cls.kind: (_CONV_BASES[cls.kind][0], cls)
    for cls in (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d)
}


# ------------------------------------------------------------------------------------------
# The process-wide switch


def _mucudnn_calls() -> int:
    """Convolution ops mucudnn's plans ran, over every name and op of the account."""
    return sum(
        count.get("mucudnn", 0) for ops in _native.account().values() for count in ops.values()
    )


class Switch:
    """The switch: its options, and the modules of the model ``enable`` named. Their names
    are registered (as layers) only while this switch is the one in effect: a layer claims
    its calls whatever the switch, so a switch turned off (or replaced by another) must not
    leave them registered."""

    def __init__(self, options: str, model: Optional[nn.Module]):
        self.options = options
        self._modules = _naming_modules(model)
        self.names: List[Adoption] = []
        self._start = _mucudnn_calls()

    def _register(self) -> None:
        self.names = []
        for path, ref in self._modules:
            module = ref()
            if module is not None and _unsupported(module) is None:
                self.names.append(
                    Adoption(path, self.options, layer_signature(module), _plain_weight(module))
                )

    def _unregister(self) -> None:
        self.names = []  # each registration goes with its Adoption

    @property
    def calls(self) -> int:
        """Convolution ops (forward and backward) mucudnn's plans ran since the switch was
        turned on (read from :func:`account`, so reset by :func:`reset_account`)."""
        return max(0, _mucudnn_calls() - self._start)


_switch_lock = threading.RLock()
_switch: Optional[Switch] = None


def _naming_modules(model: Optional[nn.Module]) -> List[Tuple[str, "weakref.ref[nn.Module]"]]:
    """(path, module) for the switch's names: the convolution modules of ``model`` not
    converted already (held weakly: the switch keeps no model alive)."""
    if model is None:
        return []
    return [
        (path or type(module).__name__, weakref.ref(module))
        for path, module in model.named_modules()
        if _kind_of(module) is not None
        and not isinstance(module.__dict__.get("_mucudnn"), Adoption)
    ]


def _set(switch: Optional[Switch]) -> None:
    global _switch
    if _switch is not None and _switch is not switch:
        _switch._unregister()
    if switch is not None and switch is not _switch:
        switch._register()
    _native.set_switch(None if switch is None else switch.options)
    _switch = switch


def enable(model: Optional[nn.Module] = None, **options: Any) -> None:
    """Runs every convolution PyTorch runs in this process (any thread; modules, ``F.conv*d``,
    forward and backward, checkpoint recomputation, ``torch.func``, compiled graphs) through
    mucudnn where it can, and through PyTorch's own kernel where it cannot: ``options`` are the
    layers' keyword-only options. With ``model``, the convolutions of its modules are named by
    their module path (in :func:`account` and errors), others by their problem
    (``conv2d_64x32x3x3_s1x1_p1x1_d1x1``). A second call replaces the first.
    :func:`disable` restores PyTorch's kernels."""
    if "name" in options:
        raise TypeError("enable names each convolution itself; do not pass name=")
    text = options_text(options, "mucudnn.torch.enable")
    switch = Switch(text, model)
    with _switch_lock:
        _set(switch)


def disable() -> None:
    """Undoes :func:`enable`: PyTorch's kernels run every convolution not converted with
    ``convert_`` (a no-op when not enabled). Call it when no other thread is inside a
    convolution, as for any change of PyTorch's dispatcher."""
    with _switch_lock:
        _set(None)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _switch is not None


@contextlib.contextmanager
def enabled(model: Optional[nn.Module] = None, **options: Any) -> Iterator[Switch]:
    """``with mucudnn.torch.enabled(**options):`` turns the process-wide switch on for the
    block (as :func:`enable`; every thread sees it) and restores what was in effect before
    (off, or an earlier :func:`enable`'s options) after it. Yields the switch (``calls``:
    convolution ops mucudnn ran so far)."""
    if "name" in options:
        raise TypeError("enabled names each convolution itself; do not pass name=")
    text = options_text(options, "mucudnn.torch.enabled")
    switch = Switch(text, model)
    with _switch_lock:
        before = _switch
        _set(switch)
    try:
        yield switch
    finally:
        with _switch_lock:
            if _switch is switch:
                _set(before)


# ------------------------------------------------------------------------------------------
# The account


def account() -> Dict[str, Dict[str, Dict[str, Any]]]:
    """What ran since the last :func:`reset_account`: per name (a converted layer's module
    path; under :func:`enable` without a model, the problem's name) and op (``"fwd"``,
    ``"bwd_data"``, ``"bwd_filter"`` of the convolution problem; a transposed layer's forward
    is its problem's ``bwd_data``), ``{"mucudnn": calls its plans ran, "pytorch": {reason:
    calls PyTorch's kernel ran}}``. Calls of modules sharing one signature whose weight is
    computed per call (autocast's cast copy, a parametrization) are counted under the first
    such layer's name, "... (or N more of its shape)"."""
    return _native.account()


def reset_account() -> None:
    """Zeroes :func:`account`."""
    _native.reset_account()


def plans_of(module: nn.Module) -> Optional["_reports.Plans"]:
    """The plans of a converted module (a :class:`Plans` table by input shape), or ``None`` for
    a module not converted."""
    adoption = module.__dict__.get("_mucudnn")
    return adoption.plans if isinstance(adoption, Adoption) else None


def set_plan_capacity(capacity: int) -> None:
    """Keeps at most ``capacity`` prepared plan sets (one per problem and options; default
    1024, or ``MUCUDNN_TORCH_PLAN_SETS``), evicting the least recently used: an evicted
    problem is prepared again from the cache, without measuring."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a whole number >= 1, not {capacity!r}")
    _native.set_plan_capacity(capacity)
