"""Automatic sharding search: per region of a transformer (attention, MLP, embedding, head/loss) choose
replication, Megatron column->row tensor parallelism, TP with sequence parallelism, or a
vocabulary-parallel embedding/head, minimising a training step's time under a per-rank memory limit
(CP-SAT). The result is a recipe (:mod:`pipeloom.plan.tp.recipes`) torch's ``parallelize_module`` applies.

Candidates per region and their collectives are what torch's own styles do (counted with torch's
``CommDebugMode`` and :class:`pipeloom.profile.collectives.CollectiveCounter`): ``ColwiseParallel`` all-reduces
its input gradient (backward), ``RowwiseParallel`` its output (forward), a vocabulary-parallel embedding
all-reduces its output, a vocabulary-parallel head all-gathers its logits and all-reduces its input gradient,
a loss-parallel head keeps its logits vocabulary-sharded for ``loss_parallel()``'s cross-entropy (three
all-reduces of one value per token in the forward). With sequence parallelism the residual stream between
regions is sequence-sharded: each all-reduce of the stream becomes a reduce-scatter in one direction and an
all-gather in the other, and a region with a module of its own (``PrepareModuleInput``) all-gathers its
input once instead of once per column module.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeloom.plan.errors import SolverMissingError, TensorParallelError
from pipeloom.plan.tp.collectives import Collective, CollectiveFit

__all__ = [
    "OPTIONS",
    "RegionCost",
    "RegionModules",
    "ShardingProblem",
    "ShardingResult",
    "recipe_for",
    "region_costs",
    "search_sharding",
]

OPTIONS = {"attention": ("replicate", "megatron", "megatron-sp"), "mlp": ("replicate", "megatron", "megatron-sp"),
           "embedding": ("replicate", "vocab"), "head": ("replicate", "vocab", "vocab-loss")}
"""The candidates of each region (``vocab-loss``: the vocabulary-parallel head whose logits stay sharded for
``loss_parallel()``)."""

LOSS_PARALLEL_REDUCTIONS = 3
"""All-reduces of one value per token in ``loss_parallel()``'s cross-entropy: the max, the sum of
exponentials and the target's logit (torch/distributed/tensor/parallel/loss.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionModules:
    """Module names (fnmatch patterns as torch's plans take) of each region, the model's own names."""

    attention_column: tuple[str, ...] = ()
    """Column-parallel modules of attention (q, k, v or a fused qkv), each its own input gradient all-reduce."""
    attention_row: tuple[str, ...] = ()
    """Row-parallel modules of attention (the output projection)."""
    mlp_column: tuple[str, ...] = ()
    mlp_row: tuple[str, ...] = ()
    attention_module: str | None = None
    """The attention region's own module, taking the stream as its one positional input: with ``megatron-sp``
    it all-gathers that input once (``PrepareModuleInput``); None: each column module gathers its own."""
    mlp_module: str | None = None
    """The MLP region's own module, as ``attention_module``."""
    norms: tuple[str, ...] = ()
    """Per-token modules made sequence-parallel with ``megatron-sp`` (the blocks' norms and the final one)."""
    head_norms: tuple[str, ...] = ()
    """Per-head norms after the attention's column-split heads (Qwen3's ``q_norm``/``k_norm``): the recipe's
    ``head_norm`` whenever attention is sharded, so their replicated weights' gradients are summed over tp."""
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
    """The MLP's inner width over ``hidden`` (used where ``mlp_weights`` is 0)."""
    attention_weights: int = 0
    """Weight elements of one layer's attention matrices, read from the model (GQA's smaller k/v count
    less); 0: Megatron's ``4h²``."""
    mlp_weights: int = 0
    """Weight elements of one layer's MLP matrices (a gated MLP has three); 0: ``2·ffn·h²``."""
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
    sequence_parallel: bool = True
    """Whether ``megatron-sp`` is a candidate (the model must take the sequence length from its projections,
    not from the sequence-sharded stream)."""
    loss_parallel: bool = False
    """Whether the head's ``vocab-loss`` is a candidate: the loss function must take vocabulary-sharded
    DTensor logits (run under ``loss_parallel()``), so it is the user's to allow."""
    candidates: dict[str, tuple[str, ...]] | None = None
    """Per region, the options the sharding rules at hand offer (``pipeloom.runtime.parallel.tp_rules.dtensor_options``
    reads them from DTensor's); None: every option of :data:`OPTIONS`."""
    modules: RegionModules = field(default_factory=RegionModules)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "ffn", "microbatch_size", "microbatches",
                     "bytes_per_element", "tp", "held_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TensorParallelError(f"sharding problem {name} must be a positive integer, got {value!r}")
        for name in ("attention_weights", "mlp_weights"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TensorParallelError(f"sharding problem {name} must be an integer >= 0, got {value!r}")
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

    def allows(self, region: str, option: str) -> bool:
        """Whether ``option`` is a candidate of ``region`` here. Sequence parallelism needs the embedding (it
        writes the sharded stream) and the head (it reads it)."""
        if self.candidates is not None and option not in self.candidates.get(region, ("replicate",)):
            return False
        if option == "megatron-sp":
            return self.sequence_parallel and {"embedding", "head"} <= set(self.regions)
        return option != "vocab-loss" or self.loss_parallel


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionCost:
    """One region option over the whole step: seconds, bytes per rank, collectives per micro-batch."""

    seconds: float
    memory: float
    collectives: tuple[Collective, ...]


def _stream(p: ShardingProblem) -> float:
    return p.microbatch_size * p.seq * p.hidden * p.bytes_per_element  # one (b, s, h) activation


def _times(kind: str, phase: str, nbytes: float, count: int) -> tuple[Collective, ...]:
    return (Collective(kind=kind, phase=phase, bytes=nbytes),) * count


def _block_collectives(option: str, columns: int, rows: int, gathered: bool, stream: float) -> tuple:
    """Collectives of one attention or MLP region per micro-batch. Megatron: each row-parallel output
    all-reduced (F), each column-parallel input gradient (I). With SP: the input all-gathered once per region
    (``gathered``, PrepareModuleInput; its gradient reduce-scattered once, the column gradients summing first)
    or once per column module, each row output reduce-scattered (F) and its gradient all-gathered (I)."""
    if option == "replicate":
        return ()
    if option == "megatron":
        return _times("all_reduce", "F", stream, rows) + _times("all_reduce", "I", stream, columns)
    gathers = 1 if gathered else columns
    return (_times("all_gather", "F", stream, gathers) + _times("reduce_scatter", "F", stream, rows)
            + _times("reduce_scatter", "I", stream, gathers) + _times("all_gather", "I", stream, rows))


def _end_collectives(p: ShardingProblem, region: str, option: str, sp: bool) -> tuple:
    """The embedding's and the head's collectives per micro-batch (``sp``: the stream is sequence-sharded).
    Vocabulary-parallel embedding: its output all-reduced, or reduce-scattered into the sharded stream (whose
    gradient is all-gathered back). Head: its input all-gathered from the sharded stream (SP; the gradient
    reduce-scattered) else its input gradient all-reduced; ``vocab`` gathers the logits, ``vocab-loss`` runs
    loss_parallel's per-token all-reduces instead."""
    stream = _stream(p)
    if option == "replicate":
        return ()
    if region == "embedding":
        if sp:
            return _times("reduce_scatter", "F", stream, 1) + _times("all_gather", "I", stream, 1)
        return _times("all_reduce", "F", stream, 1)
    found = (_times("all_gather", "F", stream, 1) + _times("reduce_scatter", "I", stream, 1) if sp
             else _times("all_reduce", "I", stream, 1))
    if option == "vocab":
        return found + _times("all_gather", "F", p.microbatch_size * p.seq * p.vocab * p.bytes_per_element, 1)
    per_token = p.microbatch_size * p.seq * p.bytes_per_element
    return found + _times("all_reduce", "F", per_token, LOSS_PARALLEL_REDUCTIONS)


def region_costs(p: ShardingProblem, region: str, option: str, *, sequence_parallel: bool | None = None
                 ) -> RegionCost:
    """Time, memory and collectives of ``region`` under ``option`` (see the module doc); ``sequence_parallel``
    (for the embedding and the head: whether the blocks shard the stream) defaults to False. Compute is F + 2F
    (backward) of the region's matmuls, divided by tp when sharded; memory is weights, gradients and
    optimizer state plus ``held_microbatches`` of activations (Korthikanti et al.: attention ``13sbh +
    5as²b`` of which ``5sbh`` stay whole under Megatron TP, MLP ``(5 + 4·ffn)sbh`` of which ``5sbh``; all
    divided with sequence parallelism; the head's logits divided only by ``vocab-loss``)."""
    b, s, h, e, t, M = p.microbatch_size, p.seq, p.hidden, p.bytes_per_element, p.tp, p.microbatches
    units = b * s * h * e / 2  # Korthikanti's sbh with 2-byte elements
    stream = _stream(p)
    shard = 1 if option == "replicate" else t
    m = p.modules
    comms: tuple[Collective, ...]
    if region in ("attention", "mlp"):
        if region == "attention":
            weights = p.attention_weights or 4 * h * h
            flops = 2.0 * b * s * weights + 4.0 * b * s * s * h
            whole, divided = 5 * units, 8 * units + 5 * p.heads * s * s * b * e / 2
            columns, rows, own = len(m.attention_column) or 1, len(m.attention_row) or 1, m.attention_module
        else:
            weights = p.mlp_weights or 2 * p.ffn * h * h
            flops = 2.0 * b * s * weights
            whole, divided = 5 * units, 4 * p.ffn * units
            columns, rows, own = len(m.mlp_column) or 1, len(m.mlp_row) or 1, m.mlp_module
        acts = {"replicate": whole + divided, "megatron": whole + divided / t}.get(option, (whole + divided) / t)
        comms = _block_collectives(option, columns, rows, own is not None, stream)
        params, count = weights * e, p.layers
    else:
        logits = b * s * p.vocab * e
        flops = 0.0 if region == "embedding" else 2.0 * b * s * h * p.vocab
        params = p.vocab * h * e
        acts = 0.0 if region == "embedding" else stream + (logits / t if option == "vocab-loss" else logits)
        comms = _end_collectives(p, region, option, bool(sequence_parallel))
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
    choice: dict[str, str]
    """Region -> option."""
    step_time: float
    """Predicted seconds of the regions' compute and collectives per step (the whole group's critical path)."""
    memory: float
    """Predicted bytes per rank."""
    collectives: tuple[Collective, ...]
    """Per micro-batch, in no particular order."""
    recipe: dict | None
    """The tensor-parallel plan (:func:`pipeloom.runtime.parallel.tp.recipe_styles` turns it into torch's styles);
    None when every region is replicated."""
    smallest_memory: float | None = None
    """INFEASIBLE under a memory limit: the fewest bytes per rank any choice of the search reaches (a second
    search minimising memory), as the memory constraint counts them (each region rounded up to KiB): the
    least ``memory_limit`` that is feasible. None otherwise."""
    smallest_choice: dict[str, str] = field(default_factory=dict)
    """The choice reaching :attr:`smallest_memory` (empty otherwise)."""


def search_sharding(problem: ShardingProblem, *, time_limit: float = 10.0) -> ShardingResult:
    """Choose an option per region (CP-SAT; see :class:`_Model`). SolverMissingError without OR-Tools. When
    nothing fits the memory limit, the result also holds the least memory the candidates reach
    (:attr:`ShardingResult.smallest_memory`), from the same model minimising memory without the limit."""
    result = _Model(problem).solve(time_limit)
    if result.choice or problem.memory_limit is None:
        return result
    searcher = _Model(replace(problem, memory_limit=None), objective="memory")
    least = searcher.solve(time_limit)
    if not least.choice:  # no choice at all (cannot happen: replicating every region is always a candidate)
        return result
    # in the memory constraint's own units (each region's bytes rounded up to KiB): the least limit it accepts
    kib = sum(-(-int(searcher.costs[key].memory) // 1024) for key in searcher.picked)
    return replace(result, smallest_memory=float(kib * 1024), smallest_choice=least.choice)


def _cp_model():  # noqa: ANN202 (the OR-Tools module; imported on first use)
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise SolverMissingError(f"the automatic sharding search needs OR-Tools' CP-SAT, which cannot be imported "
                                 f"({error}); install it with `pip install ortools` (a dependency of pipeloom), or "
                                 "pass torch's parallelize_module plan as a dict") from error
    return cp_model


_Key = tuple[str, str, bool]  # (region, option, whether the residual stream is sequence-sharded)


class _Model:
    """Variables ``x[r, o, sp]`` ∈ {0, 1}: region r runs option o with the residual stream sequence-sharded
    (sp) or not; the attention and MLP options fix sp (``megatron-sp``), the embedding and the head have both.

    minimise Σ x[r,o,sp]·time(r,o,sp) subject to
      one option per region:              Σ_{o,sp} x[r,o,sp] = 1
      memory:                              Σ x[r,o,sp]·memory(r,o,sp) ≤ limit
      one residual stream layout:          x[attention, megatron-sp] = x[mlp, megatron-sp] = Σ_o x[r,o,1] for the
                                           embedding and head (whose replicate option has no sp variant)

    With ``objective="memory"``: minimise Σ x[r,o,sp]·memory(r,o,sp) instead (the least memory reachable).
    """

    SCALE_TIME = 1e7  # integer units: 0.1 µs
    SCALE_BYTES = 1 / 1024  # KiB

    def __init__(self, problem: ShardingProblem, *, objective: str = "time") -> None:
        self.cp = _cp_model()
        self.p = problem
        self.model = self.cp.CpModel()
        self.costs: dict[_Key, RegionCost] = {}
        self.picked: list[_Key] = []  # the keys set in the last solution
        for r in problem.regions:
            for o in OPTIONS[r]:
                if not problem.allows(r, o):
                    continue
                layouts = [o == "megatron-sp"] if r in ("attention", "mlp") else [False, True]
                for sp in layouts:
                    if sp and (o == "replicate" or not problem.allows("attention", "megatron-sp")):
                        continue
                    self.costs[r, o, sp] = region_costs(problem, r, o, sequence_parallel=sp)
        self.x = {key: self.model.NewBoolVar("x_{}_{}_{}".format(*key)) for key in self.costs}
        self._one_option()
        self._memory()
        self._stream_layout()
        if objective == "memory":
            self.model.Minimize(sum(-(-int(c.memory) // 1024) * self.x[k] for k, c in self.costs.items()))
        else:
            self.model.Minimize(sum(round(c.seconds * self.SCALE_TIME) * self.x[k] for k, c in self.costs.items()))

    def _one_option(self) -> None:
        """Σ_{o,sp} x[r,o,sp] = 1 for every region r."""
        for region in self.p.regions:
            self.model.AddExactlyOne(var for key, var in self.x.items() if key[0] == region)

    def _memory(self) -> None:
        """Σ x[r,o,sp]·memory(r,o,sp) ≤ limit (bytes rounded up to KiB)."""
        if self.p.memory_limit is not None:
            self.model.Add(sum(-(-int(c.memory) // 1024) * self.x[k] for k, c in self.costs.items())
                           <= int(self.p.memory_limit * self.SCALE_BYTES))

    def _stream_layout(self) -> None:
        """Sequence parallelism shards the residual stream between regions, so all block regions use it or
        none, and the embedding writes and the head reads that sharded stream (their vocab options, sp)."""
        sp = {r: sum(var for key, var in self.x.items() if key[0] == r and key[2]) for r in self.p.regions}
        for region in self.p.regions:
            if region != "attention":
                self.model.Add(sp[region] == sp["attention"])

    def solve(self, time_limit: float) -> ShardingResult:
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit
        solver.parameters.num_workers = 1
        status = solver.Solve(self.model)
        name = solver.StatusName(status)
        if status not in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            return ShardingResult(status=name, choice={}, step_time=float("inf"), memory=float("inf"),
                                  collectives=(), recipe=None)
        picked = [key for key, var in self.x.items() if solver.Value(var)]
        self.picked = picked
        chosen = {r: o for r, o, _ in picked}
        costs = [self.costs[key] for key in picked]
        return ShardingResult(status=name, choice=chosen, step_time=sum(c.seconds for c in costs),
                              memory=sum(c.memory for c in costs),
                              collectives=tuple(x for c in costs for x in c.collectives),
                              recipe=recipe_for(chosen, self.p.modules))


def recipe_for(choice: dict[str, str], m: RegionModules) -> dict | None:
    """The recipe of ``choice`` (None when nothing is sharded)."""
    sp = choice.get("attention") == "megatron-sp"
    recipe: dict = {"recipe": "megatron-sp" if sp else "megatron", "column": [], "row": [],
                    "sequence": list(m.norms) if sp else [], "gather": [], "vocab_embedding": [],
                    "vocab_head": [], "loss_head": [], "head_norm": []}
    for region in ("attention", "mlp"):
        if choice.get(region, "replicate") != "replicate":
            recipe["column"] += list(getattr(m, f"{region}_column"))
            recipe["row"] += list(getattr(m, f"{region}_row"))
            recipe["head_norm"] += list(m.head_norms) if region == "attention" else []
            own = getattr(m, f"{region}_module")
            if sp and own is not None:
                recipe["gather"].append(own)
    if choice.get("embedding") == "vocab":
        recipe["vocab_embedding"].append(m.embedding)
    if choice.get("head") in ("vocab", "vocab-loss"):
        recipe["vocab_head" if choice["head"] == "vocab" else "loss_head"].append(m.head)
    sharded = ("column", "row", "vocab_embedding", "vocab_head", "loss_head")
    return recipe if any(recipe[k] for k in sharded) else None
