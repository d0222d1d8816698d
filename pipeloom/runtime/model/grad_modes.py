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

_SIZES = frozenset({"size", "dim", "numel", "get_device", "type", "element_size"})
"""Tensor methods whose results carry no gradient (sizes, counts): they may read an input under ``no_grad``."""
_TRACING = threading.local()
"""This thread's reentrant-checkpoint handling while it traces: ``"found"`` (a list the checkpoints' functions are
noted in) and ``"bypass"`` (run the function without the checkpoint: torch.fx), absent while it does not."""
_LOCK = threading.Lock()


def modes() -> tuple[bool, tuple[bool, ...]]:
    """The grad mode and the autocast state (CPU, CUDA) now: what :func:`mode_change` notes on each node."""
    return torch.is_grad_enabled(), tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def mode_change(graph: fx.Graph, root: nn.Module, outer: tuple[bool, tuple[bool, ...]]) -> str:
    """What torch.fx's ``graph`` (each node's ``meta["modes"]`` the :func:`modes` it was traced under; traced from
    ``root`` under ``outer``, grad enabled) drops of its forward ("" if nothing): an operation under another autocast,
    or one under ``no_grad`` that reads a value with a gradient (an input, a parameter that requires one, or what is
    computed from them; sizes read are not)."""
    calls = [node for node in graph.nodes if node.op in ("call_function", "call_method", "call_module")]
    if any(node.meta["modes"][1] != outer[1] for node in calls):
        return "torch.autocast"
    params = {name for name, p in root.named_parameters(remove_duplicate=False) if p.requires_grad}
    graded: set[fx.Node] = set()
    for node in graph.nodes:
        reads = any(n in graded for n in node.all_input_nodes)
        if node.op == "placeholder" or (node.op == "get_attr" and str(node.target) in params):
            graded.add(node)
        elif node in calls and not (node.op == "call_method" and node.target in _SIZES):
            if not node.meta["modes"][0]:
                if reads:
                    return "torch.no_grad() (or set_grad_enabled(False)) over a value with a gradient"
            elif reads or (node.op == "call_module" and any(
                    p.requires_grad for p in root.get_submodule(str(node.target)).parameters())):
                graded.add(node)
    return ""


@contextlib.contextmanager
def reentrant_checkpoints(found: list[str], *, bypass: bool = False) -> Iterator[None]:
    """Note in ``found`` each reentrant activation checkpoint (``checkpoint(..., use_reentrant=True)``) this thread
    runs meanwhile; with ``bypass`` run its function directly, without the checkpoint's ``no_grad`` (torch.fx's
    graph of it is the function's). Other threads' checkpoints run as ever."""
    from torch.utils import checkpoint

    function = checkpoint.CheckpointFunction
    with _LOCK:
        if "forward" not in function.__dict__ or not hasattr(function.__dict__["forward"], "pipeloom_original"):
            original = function.__dict__["forward"]

            def forward(ctx: object, run: object, preserve: object, *args: object) -> object:
                state = getattr(_TRACING, "state", None)
                if state is None:
                    return original.__func__(ctx, run, preserve, *args)
                state["found"].append(getattr(run, "__qualname__", type(run).__name__))
                if state["bypass"]:  # grad on again: an autograd Function's forward runs without
                    with torch.enable_grad():
                        return run(*args)  # type: ignore[operator]
                return original.__func__(ctx, run, preserve, *args)

            patched = staticmethod(forward)
            patched.pipeloom_original = original  # type: ignore[attr-defined]
            function.forward = patched  # type: ignore[method-assign]
    saved = getattr(_TRACING, "state", None)
    _TRACING.state = {"found": found, "bypass": bypass}
    try:
        yield
    finally:
        _TRACING.state = saved
