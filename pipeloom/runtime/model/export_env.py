"""What pipeloom's torch.export runs under (:func:`export_settings`, :func:`eager_branches`), each restored after it,
and the export itself (:func:`exported_program`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pipeloom.runtime.errors import ModelTraceError, NeedsExampleError
from pipeloom.runtime.model.grad_modes import reentrant_checkpoints

__all__ = ["EXPORT_SETTINGS", "QUIET_LOGGERS", "export_settings", "exported_program", "EAGER_BRANCHES",
           "eager_branches"]


EXPORT_SETTINGS = (("torch.fx.config", "do_not_emit_stack_traces", True),
                    ("torch._dynamo.config", "fake_tensor_cache_enabled", False))
"""torch settings pipeloom's export runs under, each restored after it (one a torch version lacks is left alone):
no node keeps its Python stack (pipeloom never reads it, and taking it is costly), and fake tensors are not
cached (with every input dimension symbolic, hashing the arguments and rebuilding each cached output costs more
than it saves). Together: the same graphs in 0.64-0.82 of the time on the test suite's tiny transformers models
(``benchmarks/export_time.py``, docs/runtime.md)."""
QUIET_LOGGERS = ("torch.fx.experimental.symbolic_shapes",)
"""torch loggers at ERROR while pipeloom exports: where a trace stops at a branch on tensor values, the shape solver
logs a warning with the whole graph (20 lines and more) before the error pipeloom raises names it and the way out.
Left as they are where ``TORCH_LOGS`` is set: the user asked for torch's logs."""


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
    quiet = () if os.environ.get("TORCH_LOGS") else QUIET_LOGGERS
    levels = [(logger, logger.level) for logger in map(logging.getLogger, quiet)]
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


def exported_program(model: nn.Module, example_inputs: object,
                     keep: Sequence[str] = ()) -> torch.export.ExportedProgram:
    """torch.export of ``model`` on ``example_inputs`` with every input dimension left to export (``Dim.AUTO``), under
    these settings, the modules ``keep`` recorded whole; ModelTraceError naming the way out on its first line."""
    from torch.export import Dim

    if example_inputs is None:
        raise NeedsExampleError("tracer='export' needs example_inputs=(a batch like the ones step() takes)")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise ModelTraceError(f"example_inputs must be a tensor or a tuple of tensors (the model's positional "
                              f"inputs), got {type(example_inputs).__name__}")
    dynamic = tuple({d: Dim.AUTO for d in range(a.dim())} for a in args)
    said = io.StringIO()  # what is written to stderr meanwhile: passed on after, but the partial graph torch prints
    reentrant: list[str] = []
    try:
        with export_settings(), eager_branches(model), contextlib.redirect_stderr(said), \
                reentrant_checkpoints(reentrant):
            exported = torch.export.export(model, args, dynamic_shapes=dynamic, strict=False,
                                           preserve_module_call_signature=tuple(keep))
    except Exception as error:  # export raises many kinds (Unsupported, UserError, RuntimeError...)
        sys.stderr.write(said.getvalue().replace(f"{getattr(error, 'partial_fx_graph', None)}\n", ""))
        kept = f" keeping {list(keep)} whole" if keep else ""
        first, *rest = str(error).strip().splitlines() or [""]  # the way out on the first line, torch's text after
        raise ModelTraceError(
            f"torch.export cannot trace {type(model).__name__}{kept}: {type(error).__name__}: {first[:300]}. "
            f"{_data_dependent_advice(model, error)}{_bound(model, len(args))}Split it by hand instead: "
            "pipeloom.runtime.stages_from_modules([stage0, stage1, ...])" + "".join(f"\n{line}" for line in rest[:20])
        ) from error
    sys.stderr.write(said.getvalue())
    if reentrant:
        raise ModelTraceError(
            f"torch.export cannot trace {type(model).__name__} with gradients: it runs a reentrant activation "
            f"checkpoint ({reentrant[0]}, use_reentrant=True), whose torch.no_grad() torch.export records, so "
            "nothing after it would get a gradient; use checkpoint(..., use_reentrant=False) (transformers: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or tracer='fx' "
            "where torch.fx traces the model (it traces no transformers model)")
    return exported


def _bound(model: nn.Module, count: int) -> str:
    """Which of ``model.forward``'s parameters ``count`` (> 1) positional inputs go to, and how to pass others: GPT-2
    given ``(ids, mask)`` had failed on the mask as its ``past_key_values`` with only a hand split offered."""
    import inspect

    try:
        names = list(inspect.signature(model.forward).parameters)[:count]
    except (TypeError, ValueError):
        return ""
    if count < 2 or len(names) < count:
        return ""
    return (f"The inputs go to forward's {', '.join(names)} by position; to pass others (an attention mask), wrap "
            f"the model: forward(ids, mask): return model(input_ids=ids, attention_mask=mask). ")


def _data_dependent_advice(model: nn.Module, error: Exception) -> str:
    """What works when export stopped at Python control flow on tensor values (a loop over the experts a
    batch routes to, as transformers' ``experts_implementation="eager"`` MoE blocks run)."""
    text = f"{type(error).__name__}: {error}"
    if "GuardOnDataDependentSymNode" not in text and "data-dependent" not in text:
        return ""
    advice = "The model branches or loops in Python on tensor values, which torch.export cannot follow. "
    config = getattr(model, "config", None)
    experts = getattr(config, "_experts_implementation", None)  # transformers 5 sets it on every model
    routed = any(isinstance(n, int) and n > 1 for n in (getattr(config, key, None) for key in (
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")))
    if experts == "eager" and routed:
        advice += ("Its config has experts_implementation='eager' (a Python loop over the routed experts): leave "
                   "experts_implementation unset for transformers' default experts kernel ('grouped_mm'), which "
                   "torch.export traces and pipeloom splits bitwise. ")
    return advice
