"""Automatic sharding search: per region of a transformer (attention, MLP, embedding, head/loss) choose
replication, Megatron column->row tensor parallelism, TP with sequence parallelism, or a
vocabulary-parallel embedding/head, minimising a training step's time under a per-rank memory limit
(CP-SAT). The result is a recipe (:mod:`pipeloom.plan.recipes`) torch's ``parallelize_module`` applies.

Candidates per region and their collectives are what torch's own styles do (counted with
:class:`pipeloom.plan.collectives.CollectiveCounter`): ``ColwiseParallel`` all-reduces its input gradient
(backward), ``RowwiseParallel`` its output (forward), a sequence-parallel region all-gathers its input and
reduce-scatters its output (and the reverse in the backward), a vocabulary-parallel embedding all-reduces
its output, a vocabulary-parallel head all-gathers its logits and all-reduces its input gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeloom.plan.tensor import Collective, CollectiveFit, TensorParallelError

__all__ = ["OPTIONS", "RegionModules", "ShardingProblem", "ShardingResult", "recipe_for", "region_costs",
           "search_sharding"]

OPTIONS = {"attention": ("replicate", "megatron", "megatron-sp"), "mlp": ("replicate", "megatron", "megatron-sp"),
           "embedding": ("replicate", "vocab"), "head": ("replicate", "vocab")}
"""The candidates of each region."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionModules:
    """Module names (fnmatch patterns as torch's plans take) of each region, the model's own names."""

    attention_column: tuple[str, ...] = ()
    """Column-parallel modules of attention (q, k, v or a fused qkv), each its own input gradient all-reduce."""
    attention_row: tuple[str, ...] = ()
    """Row-parallel modules of attention (the output projection)."""
    mlp_column: tuple[str, ...] = ()
    mlp_row: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    """Per-token modules made sequence-parallel with ``megatron-sp`` (norms; the first per-token module)."""
    embedding: str | None = None
    """The ``nn.Embedding`` (vocabulary-parallel option); None: the region is left out."""
    head: str | None = None
    """The output ``nn.Linear`` over the vocabulary; None: left out."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingProblem:
    """One tensor-parallel group's training step: ``layers`` transformer layers on ``microbatches``
    micro-batches of ``microbatch_size`` sequences of ``seq`` tokens."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 0
    """0: no embedding/head regions."""
    ffn: int = 4
    microbatch_size: int = 1
    microbatches: int = 1
    bytes_per_element: int = 2
    tp: int = 2
    flops_per_second: float
    fit: CollectiveFit = CollectiveFit()
    memory_limit: float | None = None
    """Bytes per rank; None: no limit."""
    optimizer_factor: float = 2.0
    held_microbatches: int = 1
    """Micro-batches whose activations a rank holds at its peak (1F1B's stage 0 holds the pipeline depth)."""
    modules: RegionModules = field(default_factory=RegionModules)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "ffn", "microbatch_size", "microbatches",
                     "bytes_per_element", "tp", "held_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TensorParallelError(f"sharding problem {name} must be a positive integer, got {value!r}")
        if self.heads % self.tp or self.hidden % self.tp:
            raise TensorParallelError(f"tp {self.tp} must divide the {self.heads} heads and the hidden size "
                                      f"{self.hidden}")
        if self.vocab and self.vocab % self.tp:
            raise TensorParallelError(f"tp {self.tp} must divide the vocabulary {self.vocab} (pad it)")

    @property
    def regions(self) -> tuple[str, ...]:
        present = ["attention", "mlp"]
        if self.vocab and self.modules.embedding:
            present.insert(0, "embedding")
        if self.vocab and self.modules.head:
            present.append("head")
        return tuple(present)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionCost:
    """One region option over the whole step: seconds, bytes per rank, collectives per micro-batch."""

    seconds: float
    memory: float
    collectives: tuple[Collective, ...]


def _stream(p: ShardingProblem) -> float:
    return p.microbatch_size * p.seq * p.hidden * p.bytes_per_element  # one (b, s, h) activation


def region_costs(p: ShardingProblem, region: str, option: str) -> RegionCost:
    """Time, memory and collectives of ``region`` under ``option`` (see the module doc). Compute is F + 2F
    (backward) of the region's matmuls, divided by tp when sharded; memory is weights, gradients and
    optimizer state plus ``held_microbatches`` of activations (Korthikanti et al.: attention ``13sbh +
    5as²b`` of which ``5sbh`` stay whole under Megatron TP, MLP ``(5 + 4·ffn)sbh`` of which ``5sbh``; all
    divided with sequence parallelism)."""
    b, s, h, e, t, M = p.microbatch_size, p.seq, p.hidden, p.bytes_per_element, p.tp, p.microbatches
    units = b * s * h * e / 2  # Korthikanti's sbh with 2-byte elements
    stream = _stream(p)
    shard = 1 if option == "replicate" else t
    m = p.modules
    if region in ("attention", "mlp"):
        if region == "attention":
            flops, params = 8.0 * b * s * h * h + 4.0 * b * s * s * h, 4 * h * h * e
            whole, divided = 5 * units, 8 * units + 5 * p.heads * s * s * b * e / 2
            columns, rows = len(m.attention_column) or 1, len(m.attention_row) or 1
        else:
            flops, params = 4.0 * p.ffn * b * s * h * h, 2 * p.ffn * h * h * e
            whole, divided = 5 * units, 4 * p.ffn * units
            columns, rows = len(m.mlp_column) or 1, len(m.mlp_row) or 1
        if option == "replicate":
            acts, comms = whole + divided, ()
        elif option == "megatron":
            acts = whole + divided / t
            comms = ((Collective(kind="all_reduce", phase="F", bytes=stream),) * rows
                     + (Collective(kind="all_reduce", phase="I", bytes=stream),) * columns)
        else:
            acts = (whole + divided) / t
            comms = ((Collective(kind="all_gather", phase="F", bytes=stream),) * columns
                     + (Collective(kind="reduce_scatter", phase="F", bytes=stream),) * rows
                     + (Collective(kind="reduce_scatter", phase="I", bytes=stream),) * columns
                     + (Collective(kind="all_gather", phase="I", bytes=stream),) * rows)
        count = p.layers
    else:
        logits = b * s * p.vocab * e
        flops = 0.0 if region == "embedding" else 2.0 * b * s * h * p.vocab
        params = p.vocab * h * e
        acts = 0.0 if region == "embedding" else stream + logits  # the head's logits are gathered whole
        comms = ()
        if option == "vocab" and region == "embedding":
            comms = (Collective(kind="all_reduce", phase="F", bytes=stream),)
        elif option == "vocab":
            comms = (Collective(kind="all_gather", phase="F", bytes=logits),
                     Collective(kind="all_reduce", phase="I", bytes=stream))
        count = 1
    compute = 3 * flops / shard / p.flops_per_second
    talk = sum(p.fit.seconds(c.kind, c.bytes, t) for c in comms)
    memory = params / shard * (2 + p.optimizer_factor) + acts * p.held_microbatches
    return RegionCost(seconds=count * M * (compute + talk), memory=count * memory, collectives=comms * count)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingResult:
    """The chosen option per region, its recipe, and what the model predicts for it."""

    status: str
    """CP-SAT's status: OPTIMAL (proven), FEASIBLE, or INFEASIBLE (nothing fits the memory)."""
    choice: dict
    """Region -> option."""
    step_time: float
    """Predicted seconds of the regions' compute and collectives per step (the whole group's critical path)."""
    memory: float
    """Predicted bytes per rank."""
    collectives: tuple[Collective, ...]
    """Per micro-batch, in no particular order."""
    recipe: dict | None
    """The tensor-parallel plan (:func:`pipeloom.plan.recipes.recipe_styles` turns it into torch's styles);
    None when every region is replicated."""


def search_sharding(problem: ShardingProblem, *, time_limit: float = 10.0) -> ShardingResult:
    """Choose an option per region (CP-SAT; see :class:`_Model`)."""
    return _Model(problem).solve(time_limit)


class _Model:
    """Variables ``x[r, o]`` ∈ {0, 1}: region r runs option o.

    minimise Σ x[r,o]·time(r,o) subject to
      one option per region:              Σ_o x[r,o] = 1
      memory:                              Σ x[r,o]·memory(r,o) ≤ limit
      one residual stream layout:          x[attention, sp] = x[mlp, sp]; sp ⇒ vocab embedding and head
    """

    SCALE_TIME = 1e7  # integer units: 0.1 µs
    SCALE_BYTES = 1 / 1024  # KiB

    def __init__(self, problem: ShardingProblem) -> None:
        from ortools.sat.python import cp_model

        self.p = problem
        self.cp = cp_model
        self.model = cp_model.CpModel()
        self.costs = {(r, o): region_costs(problem, r, o) for r in problem.regions for o in OPTIONS[r]}
        self.x = {key: self.model.NewBoolVar(f"x_{key[0]}_{key[1]}") for key in self.costs}
        self._one_option()
        self._memory()
        self._stream_layout()
        self.model.Minimize(sum(round(c.seconds * self.SCALE_TIME) * self.x[k] for k, c in self.costs.items()))

    def _one_option(self) -> None:
        """Σ_o x[r,o] = 1 for every region r."""
        for region in self.p.regions:
            self.model.AddExactlyOne(self.x[region, o] for o in OPTIONS[region])

    def _memory(self) -> None:
        """Σ x[r,o]·memory(r,o) ≤ limit (bytes rounded up to KiB)."""
        if self.p.memory_limit is not None:
            self.model.Add(sum(-(-int(c.memory) // 1024) * self.x[k] for k, c in self.costs.items())
                           <= int(self.p.memory_limit * self.SCALE_BYTES))

    def _stream_layout(self) -> None:
        """Sequence parallelism shards the residual stream between regions, so all block regions use it or
        none, and the embedding writes and the head reads that sharded stream (their vocab options)."""
        sp_attention, sp_mlp = self.x["attention", "megatron-sp"], self.x["mlp", "megatron-sp"]
        self.model.Add(sp_attention == sp_mlp)
        for region in ("embedding", "head"):
            if region in self.p.regions:
                self.model.AddImplication(sp_attention, self.x[region, "vocab"])

    def solve(self, time_limit: float) -> ShardingResult:
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit
        solver.parameters.num_workers = 1
        status = solver.Solve(self.model)
        name = solver.StatusName(status)
        if status not in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            return ShardingResult(status=name, choice={}, step_time=float("inf"), memory=float("inf"),
                                  collectives=(), recipe=None)
        chosen = {r: o for (r, o), var in self.x.items() if solver.Value(var)}
        picked = [self.costs[r, o] for r, o in chosen.items()]
        return ShardingResult(status=name, choice=chosen, step_time=sum(c.seconds for c in picked),
                              memory=sum(c.memory for c in picked),
                              collectives=tuple(x for c in picked for x in c.collectives),
                              recipe=recipe_for(chosen, self.p.modules))


def recipe_for(choice: dict, m: RegionModules) -> dict | None:
    """The recipe of ``choice`` (None when nothing is sharded)."""
    sp = choice.get("attention") == "megatron-sp"
    recipe = {"recipe": "megatron-sp" if sp else "megatron", "column": [], "row": [],
              "sequence": list(m.norms) if sp else [], "vocab_embedding": [], "vocab_head": []}
    for region in ("attention", "mlp"):
        if choice.get(region) != "replicate":
            recipe["column"] += list(getattr(m, f"{region}_column"))
            recipe["row"] += list(getattr(m, f"{region}_row"))
    if choice.get("embedding") == "vocab":
        recipe["vocab_embedding"].append(m.embedding)
    if choice.get("head") == "vocab":
        recipe["vocab_head"].append(m.head)
    return recipe if any(recipe[k] for k in ("column", "row", "vocab_embedding", "vocab_head")) else None
