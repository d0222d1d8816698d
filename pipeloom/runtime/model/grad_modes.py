"""What a traced graph keeps of the grad mode and autocast a forward switches: torch.export records both; torch.fx
records neither, so its trace is checked here, node by node; and a reentrant activation checkpoint, whose
``torch.no_grad()`` torch.export records (everything after it traced without gradients) and torch.fx should not
see (its graph of the function is right without it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import fx, nn

__all__ = ["mode_change", "modes", "reentrant_checkpoints"]

_SIZES = frozenset({"size", "dim", "numel", "get_device", "element_size", "detach", "nelement"})
"""Tensor methods whose results carry no gradient (sizes, counts, a detached copy): they may read an input under
``no_grad``; so may ``type()`` without arguments and the attributes of :data:`_ATTRIBUTES`."""
_ATTRIBUTES = frozenset({"shape", "device", "dtype", "ndim", "is_cuda", "requires_grad", "layout"})
_TRACING = threading.local()
"""This thread's reentrant-checkpoint handling while it traces: ``"found"`` (a list the checkpoints' functions are
noted in) and ``"bypass"`` (run the function without the checkpoint: torch.fx), absent while it does not."""
_LOCK = threading.Lock()


_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def modes() -> tuple[bool, tuple[object, ...]]:
    """The grad mode and the autocast state (on or off, and its dtype, per device type) now: what
    :func:`mode_change` notes on each node."""
    state: list[object] = []
    for device in _DEVICES:
        try:
            state += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
        except (RuntimeError, TypeError, AttributeError):  # a device type this torch does not know
            state += [None, None]
    return torch.is_grad_enabled(), tuple(state)


def _no_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value carries no gradient whatever it reads: a size, a count, a device, a detached copy."""
    if node.op == "call_method":
        return node.target in _SIZES or (node.target == "type" and len(node.args) + len(node.kwargs) == 1)
    return node.op == "call_function" and node.target is getattr and node.args[1] in _ATTRIBUTES


def _trained(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` calls a module holding a parameter that requires a gradient."""
    return node.op == "call_module" and any(p.requires_grad for p in root.get_submodule(str(node.target)).parameters())


def _in_place(node: fx.Node) -> bool:
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and (
        (name.endswith("_") and not name.endswith("__")) or name in ("setitem", "iadd", "imul", "isub", "itruediv"))


def mode_change(graph: fx.Graph, root: nn.Module, outer: tuple[bool, tuple[object, ...]]) -> str:
    """What torch.fx's ``graph`` (each node's ``meta["modes"]`` the :func:`modes` it was traced under; traced from
    ``root`` under ``outer``, grad enabled) drops of its forward ("" if nothing): an operation under another autocast,
    or one under ``no_grad`` that reads a value with a gradient (an input, a parameter that requires one, or what is
    computed from them, an in-place change included; sizes, devices and detached copies are not) or calls a module
    with such a parameter."""
    params = {name for name, p in root.named_parameters(remove_duplicate=False) if p.requires_grad}
    graded: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            if node.op == "placeholder" or (node.op == "get_attr" and str(node.target) in params):
                graded.add(node)
            continue
        if node.meta["modes"][1] != outer[1]:
            return "torch.autocast"
        if _no_gradient(node):
            continue
        reads = any(n in graded for n in node.all_input_nodes)
        if not node.meta["modes"][0]:
            if reads or _trained(node, root):
                return "torch.no_grad() (or set_grad_enabled(False)) over a value with a gradient"
        elif reads or _trained(node, root):
            graded.add(node)
            if _in_place(node) and node.args and isinstance(node.args[0], fx.Node):
                graded.add(node.args[0])  # what it changed is read again through its first argument
    return ""



@contextlib.contextmanager
def reentrant_checkpoints(found: list[str], *, bypass: bool = False) -> Iterator[None]:
    """Note in ``found`` each reentrant activation checkpoint (``checkpoint(..., use_reentrant=True)``) this thread
    runs meanwhile; with ``bypass`` call its function directly, in the caller's grad mode, without the checkpoint
    (torch.fx's graph of it is the function's; the checkpoint would run it under ``no_grad``). Other threads'
    checkpoints, and this thread's outside these blocks, run as ever."""
    from torch.utils import checkpoint

    function = checkpoint.CheckpointFunction
    with _LOCK:
        if not getattr(function.apply, "pipeloom_hook", False):
            inherited = function.apply

            def apply(run: object, preserve: object, *args: object) -> object:
                state = getattr(_TRACING, "state", None)
                if state is not None:
                    state["found"].append(getattr(run, "__qualname__", type(run).__name__))
                    if state["bypass"]:
                        return run(*args)  # type: ignore[operator]
                return inherited(run, preserve, *args)

            apply.pipeloom_hook = True  # type: ignore[attr-defined]
            function.apply = apply  # type: ignore[method-assign]
    saved = getattr(_TRACING, "state", None)
    _TRACING.state = {"found": found, "bypass": bypass}
    try:
        yield
    finally:
        _TRACING.state = saved
