"""The input sizes a torch.export trace holds for (:class:`TracedSizes`): the equalities export assumed about them,
kept where pipeloom drops export's own checks, and the check that refuses inputs breaking one."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from pipeloom.runtime.errors import TracedSizeError

__all__ = ["TracedSizes", "traced_sizes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedSizes:
    """The input sizes a torch.export trace holds for. Export keeps every input dimension symbolic, but Python
    code that turns a size into an int (``for i in range(num_chunks)``, ``if n == 1``) runs once, for the
    example's value, and export records what it assumed as a guard; pipeloom drops export's own checks of them
    (``_DROPPED``, and ``ExportedProgram.module()``'s guards), so a graph run on inputs breaking one would compute
    something else without a word. This keeps the equalities among them (a size-derived count fixed to the
    example's value: Qwen3-Next's gated delta rule unrolls its loop over ``ceil(seq / 64)`` chunks) and the
    dimensions export made constant, and :meth:`check` refuses inputs that break them. Export's inequalities
    (which side of a branch the trace took: a padding above 0, more than one chunk) are not checked: the graphs
    pipeloom runs hold on both sides of those (Mamba2's scan and the padded models of tests/runtime/test_sizes.py
    run bitwise at lengths breaking them)."""

    names: tuple[str, ...]  # the model's inputs
    dims: tuple[tuple[object, ...], ...]  # per input, per dimension: its int, or a sympy expression of the symbols
    fixed: tuple[tuple[object, str], ...]  # (a sympy equality of those symbols true for the example, where it arose)
    example: tuple[tuple[int, ...], ...]  # the example's shapes
    _passed: set = field(default_factory=set, compare=False, repr=False)  # shapes checked already

    def check(self, shapes: Sequence[Sequence[int]]) -> None:
        """Raise :class:`~pipeloom.runtime.errors.TracedSizeError` unless model inputs of ``shapes`` (one per
        input) keep every size the trace fixed."""
        key = tuple(tuple(int(n) for n in shape) for shape in shapes)
        if key in self._passed:
            return
        broken: list[tuple[bool, str]] = []  # (whether torch's own code recorded it, what)
        ones = False
        bound: dict[object, int] = {}
        for name, dims, shape in zip(self.names, self.dims, key):
            if len(dims) != len(shape):
                broken.append((False, f"{name} has {len(dims)} dimensions"))
                continue
            for d, (dim, size) in enumerate(zip(dims, shape)):
                if getattr(dim, "is_Symbol", False) and dim not in bound:
                    bound[dim] = size
                    continue
                value = _evaluate(dim, bound)
                if value is not None and int(value) != size:
                    ones = ones or dim == 1  # torch.export makes a dimension of size 1 (or 0) a constant
                    broken.append((False, f"{name}.shape[{d}] == {value}"))
        for equality, where in self.fixed:
            value = _evaluate(equality, bound)
            if value is not None and not bool(value):
                broken.append((where.startswith("torch"), f"{self._readable(equality)} (recorded at {where})"))
        if broken:
            first = min(broken, key=lambda item: item[0])[1]  # the model's own code first
            more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
            why = ("torch.export makes a dimension of size 1 a constant (it specializes sizes 0 and 1), so the graph "
                   "holds for that size only. Trace on a batch whose sizes are all above 1 (the first step's, or "
                   "pipeline(..., tracing=Tracing(example_inputs=batch)))" if ones else
                   "The model's Python code ran once, for the example's sizes (a loop over a count made from the "
                   "sequence length is unrolled that many times), so the graph would compute something else for these "
                   "inputs without a word. Pad every batch to one length and trace on a batch of it (pipeline(..., "
                   "tracing=Tracing(example_inputs=batch)), or the first step's batch), or build a pipeline per length")
            raise TracedSizeError(f"inputs of shape {list(key)} break a size the model's torch.export trace fixed: "
                                  f"{first}{more}, true for its example of shape {list(self.example)}. {why}")
        self._passed.add(key)

    def _readable(self, expression: object) -> str:
        """``expression`` with each size symbol written as the input dimension it stands for."""
        names = {str(dim): f"{name}.shape[{d}]" for name, dims in zip(self.names, self.dims)
                 for d, dim in enumerate(dims) if getattr(dim, "is_Symbol", False)}
        return re.sub(r"\b[a-z]\d+\b", lambda m: names.get(m.group(0), m.group(0)), str(expression))


def _evaluate(expression: object, bound: dict[object, int]) -> Any:
    """``expression`` (an int or a sympy expression) at the ``bound`` sizes; None where a symbol is not bound."""
    if isinstance(expression, int):
        return expression
    value = expression.xreplace(bound)  # type: ignore[attr-defined]
    return None if getattr(value, "free_symbols", None) else value


def traced_sizes(exported: torch.export.ExportedProgram, names: Sequence[str], example_inputs: object) -> TracedSizes:
    """The input dimensions of ``exported`` (ints, or expressions of its size symbols) and the equalities of those
    symbols its shape environment assumed (see :class:`TracedSizes`)."""
    by_name = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    values = [by_name[name].meta.get("val") for name in names]
    dims = tuple(tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in value.shape)
                 if isinstance(value, torch.Tensor) else () for value in values)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    example = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
    symbolic = [cast("torch.SymInt", d) for value in values if isinstance(value, torch.Tensor) for d in value.shape
                if isinstance(d, torch.SymInt)]
    env = symbolic[0].node.shape_env if symbolic else None
    symbols = {dim for shape in dims for dim in shape if getattr(dim, "is_Symbol", False)}
    fixed: dict[str, tuple[object, str]] = {}
    for guard in env.guards if env is not None else ():
        if type(guard.expr).__name__ != "Equality":
            continue
        expression = env.replace(guard.expr)  # type: ignore[union-attr]
        if type(expression).__name__ != "Equality" or not expression.free_symbols <= symbols:
            continue  # true whatever the sizes, or about sizes no input gives (data-dependent ones)
        where = _where(guard.sloc)
        known = fixed.get(str(expression))
        if known is None or (known[1].startswith("torch") and not where.startswith("torch")):
            fixed[str(expression)] = (expression, where)
    return TracedSizes(names=tuple(names), dims=dims, fixed=tuple(fixed.values()), example=example)


def _where(sloc: object) -> str:
    """Where a guard arose: its frame's file (from torch's or the model's package on) and line."""
    frame = getattr(sloc, "framework_loc", None)
    if frame is None or isinstance(frame, str):
        return str(frame or getattr(sloc, "maybe_user_loc", None) or "?")
    path = os.path.normpath(frame.filename)
    parts = path.split(os.sep)
    top = next((k for k in range(len(parts) - 1, -1, -1) if parts[k] in ("site-packages", "dist-packages")), None)
    short = os.sep.join(parts[top + 1:]) if top is not None else os.path.basename(path)
    return f"{short}:{frame.lineno} in {frame.name}"
