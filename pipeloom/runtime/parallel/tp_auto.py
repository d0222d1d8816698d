"""``tp_plan="auto"``: find a transformer's regions (attention, MLP, embedding, head) in a torch model, build
the sharding search's problem from the model's own shapes (:mod:`pipeloom.plan.tp.sharding`, CP-SAT), and turn
the chosen recipe into torch's ``parallelize_module`` plan (:func:`pipeloom.runtime.parallel.tp.recipe_styles`),
which ``pipeline()`` then applies exactly as a plan the user gives.

The regions are found from the module tree and the ``nn.Linear`` shapes, not from names (docs/parallelism.md):
the blocks are the largest ``ModuleList``/``Sequential`` of identical modules; in a block, with ``h`` the
first linear's input width, the MLP is the linears ``h -> F`` (columns) and ``F -> h`` (rows) with ``F != h``,
attention the other linears (the last ``h -> h`` one, in registration order, is its row-parallel output, the
rest its columns; per-head norms beside the columns, Qwen3's ``q_norm``/``k_norm``, its ``head_norm``
modules: :func:`pipeloom.runtime.parallel.tp_heads.head_modules`); the embedding is the widest
``nn.Embedding`` of width ``h`` outside the blocks, the head the ``nn.Linear`` ``h -> vocab`` outside them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeloom.runtime.errors import PipelineError, RegionsNotFoundError
from pipeloom.runtime.parallel.tp_heads import per_head_modules
from pipeloom.runtime.parallel.tp_rules import dtensor_options

if TYPE_CHECKING:  # pipeloom.plan is imported where used (runtime -> plan is a function-level import)
    from pipeloom.plan.costs.table import CostTable
    from pipeloom.plan.tp.collectives import CollectiveFit
    from pipeloom.plan.tp.sharding import RegionModules, ShardingProblem, ShardingResult

__all__ = ["AutoPlan", "AutoSharding", "ModelRegions", "auto_tp_plan", "find_regions", "is_auto"]

# Rough defaults where neither a fit nor a cost table is given: (flops per second, collective latency in
# seconds, bandwidth in bytes per second) of one device and its tp link.
DEVICE_DEFAULTS = {"cpu": (5e10, 5e-5, 2e9), "cuda": (1e14, 1e-5, 1e11)}


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoPlan:
    """How ``tp_plan="auto"`` searches (``tp_plan=AutoPlan(...)`` sets these; ``"auto"`` is ``AutoPlan()``)."""

    memory_limit: float | None = None
    """Bytes per rank the regions may hold (weights, gradients, optimizer state, activations); None: no limit."""
    seq: int | None = None
    """Tokens per sequence; None: dimension 1 of ``example_inputs``' first tensor."""
    microbatch_size: int | None = None
    """Sequences per micro-batch; None: the cost table's, else dimension 0 of ``example_inputs``' first tensor
    (a batch as ``step()`` takes) over the micro-batches."""
    heads: int | None = None
    """Attention heads; None: the model's config or its attention module's ``num_heads``/``n_heads``/
    ``head_dim``."""
    flops_per_second: float | None = None
    """One rank's compute rate; None: from the cost table (a layer's measured forward), else DEVICE_DEFAULTS."""
    fit: CollectiveFit | None = None
    """Collective prices on "tp" (``fit_collectives(time_collectives(...))``); None: the cost table's, else
    DEVICE_DEFAULTS."""
    costs: CostTable | None = None
    """A profiled cost table of this model (pieces named after its blocks): it calibrates the compute rate and
    gives the link and micro-batch size."""
    sequence_parallel: bool = False
    """Let the search choose sequence parallelism: the model's attention must take the sequence length from
    its projections' output, not from the (then sequence-sharded) residual stream."""
    loss_parallel: bool = False
    """Let the search keep the head's logits vocabulary-sharded: ``loss_fn`` must run under ``loss_parallel()``."""
    time_limit: float = 10.0
    """Seconds CP-SAT may search."""

    def __post_init__(self) -> None:
        for name in ("seq", "microbatch_size", "heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PipelineError(f"AutoPlan.{name} must be a positive integer or None, got {value!r}")
        for name in ("memory_limit", "flops_per_second", "time_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not value > 0):
                raise PipelineError(f"AutoPlan.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRegions:
    """What :func:`find_regions` read from a model: the regions' module patterns and its dimensions."""

    modules: RegionModules
    blocks: str
    """The blocks' container, e.g. ``layers`` or ``model.layers``."""
    layers: int
    hidden: int
    heads: int
    ffn_width: int
    attention_weights: int
    """Weight elements of one block's attention linears."""
    mlp_weights: int
    vocab: int
    """The embedding's rows (else the head's outputs); 0 without either."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoSharding:
    """The plan ``tp_plan="auto"`` chose, with what the search predicts for it (``engine.tp_sharding``)."""

    plan: dict[str, Any]
    """torch's ``parallelize_module`` plan ({module pattern: ParallelStyle}); empty when every region is
    replicated."""
    result: ShardingResult
    """The search's choice per region, predicted step time (s), memory per rank (bytes) and collectives."""
    problem: ShardingProblem
    regions: ModelRegions
    notes: tuple[str, ...] = field(default=())
    """Where the sizes and prices came from."""

    @property
    def predicted_step_time(self) -> float:
        return self.result.step_time

    @property
    def predicted_memory(self) -> float:
        return self.result.memory


def is_auto(tp_plan: object) -> bool:
    return isinstance(tp_plan, AutoPlan) or (isinstance(tp_plan, str) and tp_plan == "auto")


# ------------------------------------------------------------------------------------------- regions


_PLAN_FIX = "pass torch's parallelize_module plan as a dict {module name or pattern: ParallelStyle}"


def _refuse(model: nn.Module, problem: str, fix: str = _PLAN_FIX) -> RegionsNotFoundError:
    return RegionsNotFoundError(f"tp_plan='auto' cannot find the transformer regions of {type(model).__name__}: "
                                f"{problem}; {fix} (docs/parallelism.md)")


def _matmul(module: nn.Module) -> bool:
    """An ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's), which torch's styles do not shard."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The largest container (by parameters) of two or more modules of one class, or of one module."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 0:
            children = list(module)
            if len({type(c) for c in children}) == 1 and any(_matmul(m) for m in children[0].modules()):
                size = sum(p.numel() for p in module.parameters())
                if best is None or size > best[0]:
                    best = (size, name, children)
    if best is None:
        raise _refuse(model, "no nn.ModuleList or nn.Sequential of identical blocks holding nn.Linear layers")
    return best[1], best[2]


def _linears(model: nn.Module, block: nn.Module) -> list[tuple[str, nn.Linear]]:
    found = []
    for name, module in block.named_modules():
        if type(module).__name__ == "Conv1D":
            raise _refuse(model, f"its blocks compute with {type(module).__module__}.Conv1D ({name!r}), which torch's "
                          "ColwiseParallel/RowwiseParallel do not shard (they take nn.Linear and nn.Embedding)")
        if isinstance(module, nn.Linear):
            found.append((name, module))
    return found


def _common_parent(names: Sequence[str]) -> str | None:
    """The deepest module holding all ``names`` below the block (None: the block itself)."""
    parts = [name.split(".")[:-1] for name in names]
    common = []
    for tokens in zip(*parts):
        if len(set(tokens)) != 1:
            break
        common.append(tokens[0])
    return ".".join(common) or None


def _heads(model: nn.Module, block: nn.Module, hidden: int, given: int | None) -> int:
    if given is not None:
        return given
    config = getattr(model, "config", None)
    for source in (config, *block.modules()):
        for attribute in ("num_attention_heads", "num_heads", "n_heads", "n_head"):
            value = getattr(source, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
    for module in block.modules():
        value = getattr(module, "head_dim", None)
        if isinstance(value, int) and value > 0 and hidden % value == 0:
            return hidden // value
    raise _refuse(model, "no head count (no config.num_attention_heads, num_heads, n_heads or head_dim attribute)",
                  f"pass tp_plan=AutoPlan(heads=...) or {_PLAN_FIX}")


def _split_block(model: nn.Module, linears: list[tuple[str, nn.Linear]]) -> tuple[int, int, dict[str, list]]:
    """(hidden, ffn width, {attention_column, attention_row, mlp_column, mlp_row: [(name, linear)]})."""
    hidden = linears[0][1].in_features
    mlp_rows = [(n, m) for n, m in linears if m.out_features == hidden and m.in_features != hidden]
    widths = {m.in_features for _, m in mlp_rows}
    if len(widths) != 1:
        raise _refuse(model, f"its blocks have no single MLP of width F != {hidden} (linears {hidden} -> F and "
                      f"F -> {hidden}; found output projections from {sorted(widths) or 'none'})")
    ffn = widths.pop()
    mlp_columns = [(n, m) for n, m in linears if m.in_features == hidden and m.out_features == ffn]
    attention = [(n, m) for n, m in linears if (n, m) not in mlp_rows + mlp_columns]
    rows = [(n, m) for n, m in attention if m.out_features == hidden]
    if not mlp_columns or not rows:
        raise _refuse(model, "its blocks have no attention output projection (a linear to the hidden width besides "
                      "the MLP's)" if mlp_columns else f"its blocks have no MLP input projection {hidden} -> {ffn}")
    row = rows[-1]
    columns = [(n, m) for n, m in attention if (n, m) != row]
    strays = [n for n, m in columns if m.in_features != hidden]
    if not columns or strays:
        raise _refuse(model, f"its attention linears {[n for n, _ in attention]} are not column-parallel projections "
                      f"of the stream (width {hidden}) followed by one output projection")
    return hidden, ffn, {"attention_column": columns, "attention_row": [row], "mlp_column": mlp_columns,
                         "mlp_row": mlp_rows}


def _outside(model: nn.Module, blocks: str, kind: type) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kind) and not n.startswith(blocks + ".")]


def find_regions(model: nn.Module, *, heads: int | None = None) -> ModelRegions:
    """The transformer regions of ``model`` (see the module doc); RegionsNotFoundError naming what is missing."""
    blocks, children = _blocks(model)
    linears = _linears(model, children[0])
    if not linears:
        raise _refuse(model, f"its blocks {blocks}.* hold no nn.Linear")
    hidden, ffn, parts = _split_block(model, linears)
    pattern = f"{blocks}.*" if len(children) > 1 else f"{blocks}.0"
    named = {key: tuple(f"{pattern}.{n}" for n, _ in found) for key, found in parts.items()}
    owners = {region: _common_parent([n for n, _ in parts[f"{region}_column"] + parts[f"{region}_row"]])
              for region in ("attention", "mlp")}
    if owners["attention"] is not None and owners["attention"] == owners["mlp"]:
        owners = {"attention": None, "mlp": None}  # one module holds both: not a region of its own
    per_head = [f"{pattern}.{n}" for n, _ in per_head_modules(children[0], [n for n, _ in parts["attention_column"]])]
    norms = [f"{pattern}.{n}" for n, m in children[0].named_modules()
             if n and "Norm" in type(m).__name__ and f"{pattern}.{n}" not in per_head]
    norms += [n for n, m in model.named_modules()
              if n and "Norm" in type(m).__name__ and not n.startswith(blocks + ".")]
    embeddings = [(n, m) for n, m in _outside(model, blocks, nn.Embedding) if m.embedding_dim == hidden]
    embed_name, embed = max(embeddings, key=lambda e: e[1].num_embeddings) if embeddings else (None, None)
    vocab = embed.num_embeddings if isinstance(embed, nn.Embedding) else 0
    heads_found = [(n, m) for n, m in _outside(model, blocks, nn.Linear)
                   if m.in_features == hidden and (m.out_features == vocab or not vocab)]
    head_name, head = heads_found[-1] if heads_found else (None, None)
    if isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight:
        embed_name = head_name = None  # tied: the runtime does not shard a tied parameter
    if not vocab and isinstance(head, nn.Linear):
        vocab = head.out_features
    from pipeloom.plan.tp.sharding import RegionModules

    modules = RegionModules(attention_column=named["attention_column"], attention_row=named["attention_row"],
                            mlp_column=named["mlp_column"], mlp_row=named["mlp_row"],
                            attention_module=owners["attention"] and f"{pattern}.{owners['attention']}",
                            mlp_module=owners["mlp"] and f"{pattern}.{owners['mlp']}", norms=tuple(norms),
                            head_norms=tuple(per_head),
                            embedding=embed_name, head=head_name)
    weights = {key: sum(m.weight.numel() for _, m in found) for key, found in parts.items()}
    return ModelRegions(modules=modules, blocks=blocks, layers=len(children), hidden=hidden,
                        heads=_heads(model, children[0], hidden, heads), ffn_width=ffn,
                        attention_weights=weights["attention_column"] + weights["attention_row"],
                        mlp_weights=weights["mlp_column"] + weights["mlp_row"], vocab=vocab)


# -------------------------------------------------------------------------------------------- search


def _first_tensor(inputs: object) -> torch.Tensor | None:
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, (tuple, list)):
        for value in inputs:
            found = _first_tensor(value)
            if found is not None:
                return found
    if isinstance(inputs, dict):
        return _first_tensor(list(inputs.values()))
    return None


def _sizes(options: AutoPlan, example_inputs: object, model: nn.Module, microbatches: int) -> tuple[int, int]:
    """(sequences per micro-batch, tokens per sequence); ``example_inputs`` is a batch as ``step()`` takes."""
    first = _first_tensor(example_inputs)
    seq = options.seq or (first.shape[1] if first is not None and first.dim() >= 2 else None)
    if seq is None:
        raise PipelineError(f"tp_plan='auto' prices {type(model).__name__}'s activations from the sequence length: "
                            "pass tracing=Tracing(example_inputs=(a batch as step() takes, batch x sequence x ...)) "
                            "or tp_plan=AutoPlan(seq=..., microbatch_size=...)")
    table = options.costs.microbatch_size if options.costs is not None else None
    size = options.microbatch_size or table or (-(-first.shape[0] // microbatches) if first is not None else 1)
    return int(size), int(seq)


def _prices(options: AutoPlan, regions: ModelRegions, device: str, size: int, seq: int,
            notes: list[str]) -> tuple[float, CollectiveFit]:
    """(flops per second, collective fit): given, else calibrated from the cost table, else the defaults."""
    from pipeloom.plan.tp.collectives import CollectiveFit

    flops, latency, bandwidth = DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"])
    fit = options.fit
    rate = options.flops_per_second
    table = options.costs
    if table is not None:
        layer = [p.f for p in table.pieces if fnmatch(p.name, f"{regions.blocks}.*") and p.f > 0]
        if rate is None and layer:
            work = 2.0 * size * seq * (regions.attention_weights + regions.mlp_weights) + 4.0 * size * seq ** 2 * \
                regions.hidden
            rate = work / statistics.median(layer)
            notes.append(f"compute rate {rate:.3g} flop/s from the cost table's {len(layer)} block pieces")
        if fit is None:
            info = table.tensor.fit if table.tensor is not None else None
            fit = info if info is not None and info.bandwidth else CollectiveFit.from_link(table.link.latency,
                                                                                          table.link.bandwidth)
            notes.append("collectives priced from the cost table")
    if rate is None:
        rate = flops
        notes.append(f"compute rate {rate:.3g} flop/s: the {device} default")
    if fit is None:
        fit = CollectiveFit.from_link(latency, bandwidth)
        notes.append(f"collectives priced on the {device} default link ({latency:g} s, {bandwidth:.3g} B/s)")
    return rate, fit


def _candidates(notes: list[str]) -> dict[str, tuple[str, ...]] | None:
    from pipeloom.plan.errors import TensorParallelError

    try:
        found = dtensor_options()
    except TensorParallelError as error:
        notes.append(f"options not checked against DTensor's rules: {error}")
        return None
    notes.append("options checked against DTensor's sharding rules (aten.mm, aten.embedding)")
    return found


def _choice_text(choice: dict[str, str]) -> str:
    """``attention megatron, mlp megatron, ...``: a search's choice per region, for messages."""
    return ", ".join(f"{region} {option}" for region, option in choice.items())


def auto_tp_plan(model: nn.Module, mesh: object, *, microbatches: int = 1, example_inputs: object = None,
                 options: AutoPlan | str = "auto") -> AutoSharding:
    """The plan ``tp_plan="auto"`` would apply to ``model`` on ``mesh`` (a ``DeviceMesh`` with ``"tp"`` and
    optionally ``"pp"``), with the search's prediction; builds no engine and moves no tensor.

    The problem is one pipeline rank's share: ``ceil(layers / pp)`` blocks, with the embedding and the head
    counted on that same rank (an upper bound), holding ``pp`` micro-batches of activations (1F1B's first
    stage). RegionsNotFoundError when the model's regions cannot be found; PipelineError when nothing fits
    ``memory_limit``; SolverMissingError (pipeloom.plan.tp.sharding) without OR-Tools."""
    from pipeloom.plan.errors import TensorParallelError
    from pipeloom.plan.tp.sharding import ShardingProblem, search_sharding
    from pipeloom.runtime.parallel.tp import recipe_styles

    options = AutoPlan() if isinstance(options, str) else options
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "tp" not in names:
        raise PipelineError("tp_plan='auto' shards over the mesh's \"tp\" dimension: pass a DeviceMesh with "
                            "mesh_dim_names holding \"tp\", e.g. init_device_mesh('cpu', (2, 2), "
                            "mesh_dim_names=('pp', 'tp'))")
    sizes = {name: mesh.size(k) for k, name in enumerate(names)}  # type: ignore[attr-defined]
    tp, pp = sizes["tp"], sizes.get("pp", 1)
    regions = find_regions(model, heads=options.heads)
    parameter = next(model.parameters())
    size, seq = _sizes(options, example_inputs, model, microbatches)
    notes: list[str] = [f"{regions.layers} blocks under {regions.blocks!r}, hidden {regions.hidden}, "
                        f"{regions.heads} heads, MLP width {regions.ffn_width}, vocabulary {regions.vocab}"]
    rate, fit = _prices(options, regions, parameter.device.type, size, seq, notes)
    vocab = regions.vocab if regions.vocab and regions.vocab % tp == 0 else 0
    if regions.vocab and not vocab:
        notes.append(f"embedding and head left whole: tp {tp} does not divide the vocabulary {regions.vocab}")
    try:
        problem = ShardingProblem(
            layers=math.ceil(regions.layers / pp), hidden=regions.hidden, heads=regions.heads, seq=seq, vocab=vocab,
            ffn=max(1, regions.ffn_width // regions.hidden), attention_weights=regions.attention_weights,
            mlp_weights=regions.mlp_weights, microbatch_size=size, microbatches=microbatches,
            bytes_per_element=parameter.element_size(), tp=tp, flops_per_second=rate, fit=fit,
            memory_limit=options.memory_limit, held_microbatches=min(pp, microbatches),
            sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel,
            candidates=_candidates(notes), modules=regions.modules)
    except TensorParallelError as error:
        raise PipelineError(f"tp_plan='auto': {error}; use a \"tp\" size that divides them or pass torch's "
                            "parallelize_module plan as a dict") from error
    result = search_sharding(problem, time_limit=options.time_limit)
    if not result.choice:
        least = (f"the least its candidates reach is {result.smallest_memory:,.0f} bytes per rank "
                 f"({_choice_text(result.smallest_choice)})" if result.smallest_memory is not None
                 else "no candidate was found")
        raise PipelineError(f"tp_plan='auto': no sharding of {type(model).__name__} fits memory_limit "
                            f"{options.memory_limit:,.0f} bytes per rank on tp {tp} x pp {pp} (CP-SAT: "
                            f"{result.status}; {least}); raise AutoPlan(memory_limit=...) to at least that, use more "
                            "tp or pp ranks, or fewer micro-batches")
    plan = recipe_styles(result.recipe) if result.recipe is not None else {}
    return AutoSharding(plan=plan, result=result, problem=problem, regions=regions, notes=tuple(notes))
