"""What pipeloom's torch.export runs under (:func:`export_settings`, :func:`eager_branches`), each restored after it."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from torch import nn

__all__ = ["EXPORT_SETTINGS", "QUIET_LOGGERS", "export_settings", "EAGER_BRANCHES", "eager_branches"]


EXPORT_SETTINGS = (("torch.fx.config", "do_not_emit_stack_traces", True),
                    ("torch._dynamo.config", "fake_tensor_cache_enabled", False))
"""torch settings pipeloom's export runs under, each restored after it (one a torch version lacks is left alone):
no node keeps its Python stack (pipeloom never reads it, and taking it is costly), and fake tensors are not
cached (with every input dimension symbolic, hashing the arguments and rebuilding each cached output costs more
than it saves). Together: the same graphs in 0.64-0.82 of the time on the test suite's tiny transformers models
(``benchmarks/export_time.py``, docs/runtime.md)."""
QUIET_LOGGERS = ("torch.fx.experimental.symbolic_shapes",)
"""torch loggers at ERROR while pipeloom exports: where a trace stops at a branch on tensor values, the shape solver
logs a warning with the whole graph (20 lines and more) before the error pipeloom raises names it and the way out."""


@contextlib.contextmanager
def export_settings() -> Iterator[None]:
    import importlib

    saved = []
    for module_name, name, value in EXPORT_SETTINGS:
        try:
            config = importlib.import_module(module_name)
        except ImportError:  # a torch without it
            continue
        if hasattr(config, name):
            saved.append((config, name, getattr(config, name)))
            setattr(config, name, value)
    levels = [(logger, logger.level) for logger in map(logging.getLogger, QUIET_LOGGERS)]
    for logger, _ in levels:
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for config, name, value in reversed(saved):
            setattr(config, name, value)
        for logger, level in levels:
            logger.setLevel(level)


EAGER_BRANCHES = ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5",
                  "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                  "transformers.models.olmo_hybrid.modeling_olmo_hybrid")
"""Modeling modules whose code takes another branch when it is exported than it runs eagerly, one that computes other
numbers: transformers' gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid) builds each chunk's inverse by forward
substitution under ``is_torchdynamo_exporting()`` ("not all export targets support the fast triangular solver"), where
it runs ``torch.linalg.solve_triangular`` eagerly; its gradients then differ from eager's by about 1e-8. pipeloom runs
the graph in PyTorch, where the solver traces and runs: during pipeloom's export, these modules'
``is_torchdynamo_exporting`` answers False, so the graph computes what eager PyTorch does. Only these: in other modules
(Mamba's, Jamba's) the flag picks kernels, not a formula."""


@contextlib.contextmanager
def eager_branches(model: nn.Module) -> Iterator[None]:
    """The :data:`EAGER_BRANCHES` among the modules defining ``model``'s submodules take their eager branch."""
    names = {type(module).__module__ for module in model.modules()} & set(EAGER_BRANCHES)
    patched = [(sys.modules[name], getattr(sys.modules[name], _FLAG)) for name in sorted(names)
               if hasattr(sys.modules.get(name), _FLAG)]
    for module, _ in patched:
        setattr(module, _FLAG, lambda: False)
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, _FLAG, original)


_FLAG = "is_torchdynamo_exporting"
