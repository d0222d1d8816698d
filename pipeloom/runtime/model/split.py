"""Cut an unchanged ``nn.Module`` into pipeline stages with ``torch.fx``, or chain given modules.

Stages reuse the model's own Parameter objects; a frozen :class:`StageGraph` says which values each
stage consumes from which earlier stage (or from the model inputs), so stages may form a DAG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from pipeloom.runtime.errors import (
    SplitError,
    SplitOrderError,
    StageValueError,
)
from pipeloom.runtime.model.modes import switch_modes
from pipeloom.runtime.model.passes import TRACED_DEVICE, copy_mutated_inputs, localize_sizes
from pipeloom.runtime.model.sizes import TracedSizes
from pipeloom.runtime.model.split_points import stage_starts
from pipeloom.runtime.model.tracing import TracedModel, trace_model
from pipeloom.runtime.program import MODEL_INPUT, Source

__all__ = [
    "StageGraph",
    "StageSpec",
    "StagedModel",
    "ValueRef",
    "check_stage_value",
    "split_model",
    "stages_from_modules",
]



@dataclass(frozen=True, kw_only=True, slots=True)
class ValueRef:
    """One value flowing into a stage: output ``index`` of ``stage`` (or model input ``index``)."""

    stage: int | Source  # producing stage, or MODEL_INPUT
    index: int  # position among the producer's outputs (or among the model inputs)
    name: str = field(default="", compare=False)  # the fx node's name, for error messages

    def __post_init__(self) -> None:
        if (self.stage is not MODEL_INPUT and (isinstance(self.stage, bool) or not isinstance(self.stage, int)
                                               or self.stage < 0)) or self.index < 0:
            raise SplitError(f"bad value reference stage={self.stage}, index={self.index}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """What one stage consumes and produces.

    The stage module is called as ``module(*values of inputs)``; it returns the value itself when
    ``num_outputs == 1``, else a tuple of ``num_outputs`` values.
    """

    index: int  # the stage's position in StagedModel.stages
    inputs: tuple[ValueRef, ...]  # in the order of the module's forward arguments
    num_outputs: int  # how many values the stage returns

    def __post_init__(self) -> None:
        for ref in self.inputs:
            if ref.stage is not MODEL_INPUT and ref.stage >= self.index:
                raise SplitError(f"stage {self.index} consumes {ref} from a stage that is not earlier")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageGraph:
    """The dataflow between stages: every stage's inputs, and where the model outputs come from."""

    stages: tuple[StageSpec, ...]  # in execution order; stage s only reads from stages < s
    input_names: tuple[str, ...]  # the model's positional inputs (one ValueRef index each)
    output: object  # the model's output structure with ValueRef leaves (a ValueRef, tuple, dict...)

    def edges(self) -> list[tuple[int, int]]:
        """Forward edges ``(producer, consumer)`` between stages, sorted, each once.

        The list fits ``pipeloom.stages.stage_graph(..., edges=...)``.
        """
        pairs = {(ref.stage, spec.index) for spec in self.stages for ref in spec.inputs if ref.stage is not MODEL_INPUT}
        return sorted(pairs)

    def output_refs(self) -> tuple[ValueRef, ...]:
        """The ValueRef leaves of ``output`` in order (values the caller must keep)."""
        return tuple(leaf for leaf in pytree.tree_leaves(self.output) if isinstance(leaf, ValueRef))


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedModel:
    """Stage modules sharing the original parameters, and the graph that connects them."""

    stages: tuple[nn.Module, ...]  # stage s is stages[s]; its parameters are the model's own objects
    graph: StageGraph  # which values flow between the stages
    sizes: TracedSizes | None = None  # torch.export: the input sizes the stages hold for (None: any)

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.graph.stages):
            raise SplitError(f"{len(self.stages)} stage modules for {len(self.graph.stages)} stage specs")

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    def edges(self) -> list[tuple[int, int]]:
        """Forward edges between stages (see :meth:`StageGraph.edges`)."""
        return self.graph.edges()

    def run(self, *inputs: object, around: Callable[[int], AbstractContextManager] | None = None,
            record: Callable[[int, list[object], tuple[object, ...]], None] | None = None) -> object:
        """Run all stages in order on one device, checking each value passed between stages.

        Equals the original model's ``forward(*inputs)`` bitwise; autograd flows through it.
        ``around(k)``, when given, is a context manager entered around stage k's call (the runtime's
        random-number seeding: :func:`pipeloom.runtime.step.rng.reference_step`; the profiler's error
        messages). ``record(k, args, outputs)``, when given, sees what stage k read and returned.
        """
        if len(inputs) != len(self.graph.input_names):
            names = ", ".join(self.graph.input_names)
            raise SplitError(f"the model takes {len(self.graph.input_names)} inputs ({names}), got {len(inputs)}")
        self.check_sizes(inputs)
        outputs: list[tuple[object, ...]] = []
        for spec, module in zip(self.graph.stages, self.stages):
            args = [self.value(ref, outputs, inputs, consumer=f"stage {spec.index}") for ref in spec.inputs]
            with around(spec.index) if around is not None else contextlib.nullcontext():
                result = module(*args)
            outputs.append((result,) if spec.num_outputs == 1 else tuple(result))
            if record is not None:
                record(spec.index, args, outputs[-1])
        return self.model_output(outputs, inputs)

    def check_sizes(self, inputs: Sequence[object]) -> None:
        """Raise :class:`~pipeloom.runtime.errors.TracedSizeError` when model inputs of these sizes break a size
        the trace fixed (:class:`~pipeloom.runtime.model.sizes.TracedSizes`); stages not traced by torch.export
        take any."""
        if self.sizes is not None:
            self.sizes.check([tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in inputs])

    def value(self, ref: ValueRef, outputs: Sequence[Sequence[object]], inputs: Sequence[object], *,
              consumer: str) -> object:
        """The value ``ref`` names: a model input, or a stage's output (checked as a stage-boundary value)."""
        if ref.stage == MODEL_INPUT:
            return inputs[ref.index]
        value = outputs[ref.stage][ref.index]
        check_stage_value(value, name=ref.name or f"output {ref.index}", where=f"from stage {ref.stage} to {consumer}")
        return value

    def model_output(self, outputs: Sequence[Sequence[object]], inputs: Sequence[object]) -> object:
        """The model's output structure (a ModelOutput, a tuple...) around the stages' ``outputs`` (per stage,
        the values it returned) and the model's ``inputs``."""
        return pytree.tree_map(
            lambda v: self.value(v, outputs, inputs, consumer="the model output") if isinstance(v, ValueRef) else v,
            self.graph.output)


def check_stage_value(value: object, *, name: str, where: str = "between stages") -> None:
    """Raise StageValueError unless ``value`` is a tensor or a (nested) tuple/list/dict of tensors."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)) and value:
        for item in value:
            check_stage_value(item, name=name, where=where)
        return
    if isinstance(value, dict) and value:
        for item in value.values():
            check_stage_value(item, name=name, where=where)
        return
    raise StageValueError(
        f"value {name!r} passed {where} is of type {type(value).__name__} ({value!r:.80}); only tensors and "
        "tuples/lists/dicts of tensors may cross a stage boundary: move the split point so that this "
        "value is made and used inside one stage, or compute it from a tensor in the consuming stage"
    )


def _assign(graph: fx.Graph, starts: list[int]) -> dict[fx.Node, int | Source]:
    """Stage of every placeholder (MODEL_INPUT) and compute node; get_attr nodes are copied per use."""
    stage_of: dict[fx.Node, int | Source] = {}
    stage = 0
    for position, node in enumerate(graph.nodes):
        while stage < len(starts) and position >= starts[stage]:
            stage += 1
        if node.op == "placeholder":
            stage_of[node] = MODEL_INPUT
        elif node.op not in ("get_attr", "output"):
            stage_of[node] = stage
    return stage_of


def _build_stage(root: nn.Module | dict, nodes: list[fx.Node], inputs: list[fx.Node],
                 outputs: list[fx.Node], index: int, device: torch.device | None = None) -> fx.GraphModule:
    """A GraphModule over ``nodes`` taking ``inputs`` and returning ``outputs`` (bare when one)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in inputs}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # a get_attr (parameter, buffer, constant) used here: copy it in
            assert node.op == "get_attr", node
            env[node] = graph.node_copy(node)
        return env[node]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    graph.lint()
    module = fx.GraphModule(root, graph, class_name=f"Stage{index}")
    if device is not None:
        module.meta[TRACED_DEVICE] = str(device)
    copy_mutated_inputs(module)  # first: it reads in-place flags that switch_modes moves into submodules
    switch_modes(module)
    return module


def split_model(model: nn.Module | TracedModel, split_points: Sequence[str], *, tracer: str = "auto",
                leaf_modules: Sequence[str] = (), example_inputs: object = None,
                export_leaves: Sequence[str] = (), thread_reads: bool = True) -> StagedModel:
    """Cut ``model`` into ``len(split_points) + 1`` stages; split point s-1 is where stage s starts.

    A split point is a module name (e.g. ``"layers.4"``): the stage starts at the first node inside
    that module in the traced graph. Stage s holds the nodes from split point s-1 up to split point s.
    ``tracer``: ``"fx"`` (torch.fx), ``"export"`` (torch.export, needs ``example_inputs``: a batch like
    the ones ``step()`` takes) or ``"auto"`` (torch.fx, then torch.export when it fails and example
    inputs are given). ``leaf_modules``: module names never cut (kept as calls of the module by either tracer;
    ``export_leaves``: more, kept as calls only by torch.export, see :func:`trace_model`).
    ``model`` may be a :class:`~pipeloom.runtime.model.tracing.TracedModel` (``trace_model``), to cut one
    trace several ways. ``thread_reads``: a value two or more later stages read is threaded through its
    readers (:func:`_providers`, what the runtime needs for one device's order of additions); False hands
    every reader its value from the stage making it (the model's own dataflow, which the profiler reports
    per piece so that the planner can group pieces into stages).
    """
    if not isinstance(model, TracedModel):
        model = trace_model(model, tracer=tracer, leaf_modules=leaf_modules, example_inputs=example_inputs,
                            export_leaves=export_leaves)
    return _split(model, split_points, leaf_modules, thread_reads=thread_reads)


def _split(traced: TracedModel, split_points: Sequence[str], leaf_modules: Sequence[str], *,
           thread_reads: bool = True) -> StagedModel:
    graph = fx.Graph()  # a copy: sizes localized for this split leave the traced graph as it was
    copies: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(traced.graph, copies)
    traced_output = pytree.tree_map(lambda v: copies[v] if isinstance(v, fx.Node) else v, traced.output)
    starts = stage_starts(graph, split_points, leaf_modules)
    stage_of = _assign(graph, starts)
    localize_sizes(graph, stage_of)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    num_stages = len(starts) + 1
    nodes: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    inputs: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    outputs: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    output_nodes = [leaf for leaf in pytree.tree_leaves(traced_output) if isinstance(leaf, fx.Node)]
    for node in graph.nodes:
        if (stage := stage_of.get(node, MODEL_INPUT)) != MODEL_INPUT:
            nodes[stage].append(node)
    for s, stage_nodes in enumerate(nodes):
        if not stage_nodes:
            raise SplitOrderError(f"stage {s} would hold no computation; remove split point {split_points[s]!r}")
        for node in stage_nodes:
            for source in node.all_input_nodes:
                if stage_of.get(source, s) != s and source not in inputs[s]:
                    inputs[s].append(source)
    for source in output_nodes:
        if source.op == "get_attr":
            raise SplitError(f"the model returns the attribute {source.target!r} directly; return it from a "
                             "computation or leave it out of the output")
    provider = _providers(stage_of, inputs, output_nodes, num_stages - 1, thread=thread_reads)
    for s in range(num_stages):
        for source in inputs[s]:
            if (producer := provider.get((source, s), MODEL_INPUT)) != MODEL_INPUT and source not in outputs[producer]:
                outputs[producer].append(source)
    for source in output_nodes:
        if (producer := provider.get((source, None), MODEL_INPUT)) != MODEL_INPUT and source not in outputs[producer]:
            outputs[producer].append(source)
    for s in range(num_stages):
        if not outputs[s]:
            raise SplitOrderError(f"stage {s} computes nothing that a later stage or the model output uses; "
                                  f"move split point {split_points[s - 1] if s else split_points[0]!r}")

    def ref(node: fx.Node, consumer: int | None) -> ValueRef:
        if (stage := provider.get((node, consumer), MODEL_INPUT)) == MODEL_INPUT:
            return ValueRef(stage=MODEL_INPUT, index=placeholders.index(node), name=node.name)
        return ValueRef(stage=stage, index=outputs[stage].index(node), name=node.name)

    modules = tuple(_build_stage(traced.root, nodes[s], inputs[s], outputs[s], s, traced.device)
                    for s in range(num_stages))
    specs = tuple(StageSpec(index=s, inputs=tuple(ref(n, s) for n in inputs[s]), num_outputs=len(outputs[s]))
                  for s in range(num_stages))
    output = pytree.tree_map(lambda v: ref(v, None) if isinstance(v, fx.Node) else v, traced_output)
    return StagedModel(stages=modules, graph=StageGraph(stages=specs, input_names=traced.input_names,
                                                       output=output), sizes=traced.sizes)


def _providers(stage_of: dict[fx.Node, int | Source], inputs: list[list[fx.Node]], output_nodes: list[fx.Node],
               last: int, *, thread: bool = True) -> dict[tuple[fx.Node, int | None], int | Source]:
    """Which stage hands each stage input (``(node, consumer stage)``) and each model output (``(node, None)``)
    its value: the stage making it, except for a value that may carry a gradient and that two or more later
    stages read. That one is threaded through its readers in order (the first reads it from its maker, each
    next one from the reader before it, which returns its own input unchanged), so that each reader's
    backward starts from the gradient of the readers after it and adds its own uses after it: the order of
    additions of one device's backward, which reaches the last use first (docs/design.md §5). A model output
    made before the last stage counts as a read of the last stage; the last stage then returns its own copy.
    Without ``thread``, every reader gets the value from its maker.
    """
    readers: dict[fx.Node, list[int]] = {}
    for s, stage_inputs in enumerate(inputs):
        for node in stage_inputs:
            readers.setdefault(node, []).append(s)
    early_outputs = [n for n in dict.fromkeys(output_nodes) if stage_of.get(n, last) not in (MODEL_INPUT, last)]
    for node in early_outputs if thread else ():  # the last stage reads it for the output when others do too
        if readers.get(node) and last not in readers[node] and _carries_gradient(node):
            readers[node].append(last)
            inputs[last].append(node)
    provider: dict[tuple[fx.Node, int | None], int | Source] = {}
    for node, stages in readers.items():
        maker = stage_of.get(node, MODEL_INPUT)
        threaded = thread and maker != MODEL_INPUT and len(stages) > 1 and _carries_gradient(node)
        for k, s in enumerate(stages):
            provider[(node, s)] = stages[k - 1] if threaded and k else maker
    for node in output_nodes:
        maker = stage_of.get(node, MODEL_INPUT)
        provider[(node, None)] = last if node in early_outputs and last in readers.get(node, ()) else maker
    return provider


def _carries_gradient(node: fx.Node) -> bool:
    """Whether ``node``'s value may carry a gradient: not an integer or boolean tensor (by its traced value)."""
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()


def stages_from_modules(modules: Sequence[nn.Module], *, num_inputs: int = 1) -> StagedModel:
    """Manual mode: a linear chain where stage 0 takes the ``num_inputs`` model inputs and stage s > 0
    takes stage s-1's return value as its one argument; the model output is the last stage's value."""
    modules = tuple(modules)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise SplitError(f"stages_from_modules needs a non-empty list of nn.Module, got {modules!r:.120}")
    if num_inputs < 1:
        raise SplitError(f"num_inputs must be at least 1, got {num_inputs}")
    first = tuple(ValueRef(stage=MODEL_INPUT, index=i) for i in range(num_inputs))
    specs = tuple(StageSpec(index=s, inputs=first if s == 0 else (ValueRef(stage=s - 1, index=0),),
                            num_outputs=1) for s in range(len(modules)))
    names = tuple(f"input{i}" for i in range(num_inputs))
    graph = StageGraph(stages=specs, input_names=names, output=ValueRef(stage=len(modules) - 1, index=0))
    return StagedModel(stages=modules, graph=graph)
