"""Two tracing front ends with one result: ``torch.fx``'s symbolic trace and ``torch.export``.

Both give one flat fx graph whose parameters and buffers are ``get_attr`` nodes naming the model's own
tensors by their qualified names, the model's output structure with fx nodes at its leaves, and each
node's module scopes (``nn_module_stack``), from which split points are found.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from pipeloom.runtime.errors import ModelTraceError, NeedsExampleError, SplitError
from pipeloom.runtime.model.export_env import exported_program
from pipeloom.runtime.model.grad_modes import mode_change, modes, reentrant_checkpoints
from pipeloom.runtime.model.modes import train_mode
from pipeloom.runtime.model.sizes import TracedSizes, traced_sizes

if TYPE_CHECKING:
    from torch.fx.node import Argument

__all__ = ["TRACERS", "TracedModel", "module_scopes", "trace_model"]

TRACERS = ("auto", "fx", "export")
"""``tracer=`` values: ``"auto"`` tries torch.fx, then torch.export when example inputs are given."""

# torch.export's stand-in scope for nodes its passes add without one (torch/_export/passes/_node_metadata_hook.py):
# no module of the model
_NO_SCOPE = "_empty_nn_module_stack_from_metadata_hook"

_DROPPED = {  # export's runtime assertions: they check the trace device and sizes, not the model's math
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedModel:
    """One flat graph of the whole model, ready to be cut into stages."""

    root: nn.Module | dict[str, object]  # what the graph's get_attr targets resolve against
    graph: fx.Graph  # placeholders = model inputs; get_attr = the model's own parameters and buffers
    input_names: tuple[str, ...]  # the model's positional inputs, one placeholder each
    output: object  # the model's output structure (a pytree: tuple, dict, ModelOutput...) with fx.Node leaves
    tracer: str  # "fx" or "export"
    device: torch.device | None = None  # torch.export: the device of the example inputs, baked into the graph
    sizes: TracedSizes | None = None  # torch.export: the input sizes the graph holds for (None: any)


def module_scopes(node: fx.Node) -> list[str]:
    """Qualified names of the modules whose forward produced ``node`` (outermost first)."""
    names: list[str] = []
    stack = node.meta.get("nn_module_stack") or {}
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if path and path != _NO_SCOPE:
            names.append(path)
    if node.op == "call_module":
        parts = str(node.target).split(".")
        names.extend(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return list(dict.fromkeys(names))


def trace_model(model: nn.Module, *, tracer: str = "auto", leaf_modules: Sequence[str] = (),
                example_inputs: object = None, export_leaves: Sequence[str] = ()) -> TracedModel:
    """Trace ``model`` with torch.fx (``"fx"``), torch.export (``"export"``, needs ``example_inputs``) or
    torch.fx falling back to torch.export (``"auto"``). ``leaf_modules`` are module names kept whole: calls
    of the module object itself in the graph, under either tracer. ``export_leaves``: more such names, kept
    whole only when torch.export traces (a tensor-parallel plan's blocks, which torch.fx keeps calling
    shape-agnostically but torch.export would flatten with the trace's head counts baked in)."""
    if tracer not in TRACERS:
        raise SplitError(f"tracer must be one of {', '.join(map(repr, TRACERS))}, got {tracer!r}")
    if isinstance(leaf_modules, str):
        raise SplitError(f"leaf_modules must be a list of module names, got the string {leaf_modules!r}; "
                         f"write [{leaf_modules!r}]")
    modules = dict(model.named_modules())
    unknown = [name for name in (*leaf_modules, *export_leaves) if name not in modules or not name]
    if unknown:
        raise SplitError(f"leaf module(s) {unknown} are not submodules of {type(model).__name__}; give names "
                         "from model.named_modules(), e.g. 'layers.3'")
    kept = list(dict.fromkeys((*leaf_modules, *export_leaves)))
    with train_mode(model):
        if tracer == "export":
            return _export(model, example_inputs, kept)
        try:
            return _symbolic(model, leaf_modules, kept)
        except ModelTraceError as error:
            if tracer == "fx":
                raise
            if example_inputs is None:
                raise NeedsExampleError(f"{error}. Or give example_inputs=(a batch like the ones step() takes) so "
                                      "pipeloom traces it with torch.export instead") from error.__cause__
            return _export(model, example_inputs, kept)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, keeping the named modules whole (as call_module nodes) and tracing into the ``opened``
    ones, which torch.fx would keep whole (its own ``torch.nn`` modules)."""

    def __init__(self, leaves: Sequence[str], opened: Sequence[str] = ()) -> None:
        super().__init__()
        self.leaves, self.opened = set(leaves), set(opened)

    def is_leaf_module(self, m: nn.Module, name: str) -> bool:
        return name in self.leaves or name not in self.opened and super().is_leaf_module(m, name)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["modes"] = modes()  # the grad mode and autocast, which the graph does not record
        return node


def _symbolic(model: nn.Module, leaf_modules: Sequence[str], kept: Sequence[str]) -> TracedModel:
    """torch.fx's graph of ``model``. A ``torch.nn`` module torch.fx keeps whole whose parameters the graph uses more
    than once (called twice, a weight tied to another module's) is traced into, each use a node: the runtime adds a
    shared parameter's uses in one device's order only where it sees them (docs/runtime.md). Not one of or inside
    ``kept`` (leaf modules, a tensor-parallel plan's blocks: its styles act on the module's calls)."""
    traced = _traced(model, _Tracer(leaf_modules))
    opened = [name for name in _shared_builtins(traced)
              if not any(name == outer or name.startswith(outer + ".") for outer in kept)]
    found = _opened(model, leaf_modules, opened) if opened else traced
    if found is None:  # each alone then: a module torch.fx cannot trace into stays whole, as before
        opened = [name for name in opened if _opened(model, leaf_modules, [name]) is not None]
        found = _opened(model, leaf_modules, opened) if opened else traced
    return found or traced


def _opened(model: nn.Module, leaf_modules: Sequence[str], names: Sequence[str]) -> TracedModel | None:
    """torch.fx's graph of ``model`` with the modules ``names`` traced into (None where torch.fx cannot)."""
    try:
        return _traced(model, _Tracer(leaf_modules, names))
    except ModelTraceError:
        return None


def _shared_builtins(traced: TracedModel) -> list[str]:
    """The modules torch.fx's graph calls that hold a parameter the graph uses more than once: by several calls of
    modules or through their attributes."""
    root = cast(fx.GraphModule, traced.root)
    called = {str(n.target): root.get_submodule(str(n.target)) for n in traced.graph.nodes if n.op == "call_module"}
    uses = collections.Counter(id(p) for n in traced.graph.nodes if n.op == "call_module"
                               for p in called[str(n.target)].parameters())
    params = dict(root.named_parameters(remove_duplicate=False))
    uses.update(id(params[str(n.target)]) for n in traced.graph.nodes if n.op == "get_attr" and str(n.target) in params)
    return [name for name, module in called.items() if any(uses[id(p)] > 1 for p in module.parameters())]


def _traced(model: nn.Module, tracer: _Tracer) -> TracedModel:
    try:
        with torch.enable_grad(), reentrant_checkpoints([], bypass=True):  # a checkpoint's function, as it computes
            outer = modes()
            graph = tracer.trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, NotImplementedError, ValueError... alike
        raise ModelTraceError(
            f"torch.fx cannot trace {type(model).__name__}: {type(error).__name__}: {error}. Split it by hand "
            "instead: pipeloom.runtime.stages_from_modules([stage0, stage1, ...]) with one nn.Module per stage"
        ) from error
    dropped = mode_change(graph, model, outer)
    if dropped:
        raise ModelTraceError(
            f"torch.fx cannot trace {type(model).__name__} as it runs: its forward enters {dropped}, which a "
            "torch.fx graph does not record (the pieces would run that code with gradients or in the outer dtype); "
            "trace it with tracer='export' and example_inputs")
    root = fx.GraphModule(tracer.root, graph, type(model).__name__)
    output = next(n for n in root.graph.nodes if n.op == "output")
    names = tuple(str(n.target) for n in root.graph.nodes if n.op == "placeholder")
    return TracedModel(root=root, graph=root.graph, input_names=names, output=_mutable(output.args[0]), tracer="fx")


def _mutable(structure: object) -> object:
    """torch.fx's output structure with its immutable dicts and lists made plain ones, as the model returns them (a
    ``loss_fn`` that pops a key from the output had failed with torch.fx's message about ``node.args``)."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if isinstance(structure, immutable_dict):
        return {key: _mutable(value) for key, value in structure.items()}
    if isinstance(structure, immutable_list):
        return [_mutable(value) for value in structure]
    if type(structure) is tuple:
        return tuple(_mutable(value) for value in structure)
    return structure


def _export(model: nn.Module, example_inputs: object, keep: Sequence[str] = ()) -> TracedModel:
    """torch.export with every input dimension left to export (``Dim.AUTO``), then one fx graph whose
    parameters, buffers and constants are get_attr nodes of the model's own tensors. A model built on
    the meta device is traced with its example inputs there too (fake tensors refuse mixed devices).
    Each module of ``keep`` (outermost ones; export records their call signatures) becomes one call_module
    node calling the model's own module object in place of the nodes its forward was flattened into."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        example_inputs = pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t,
                                         example_inputs)
    keep = [name for name in keep if not any(name.startswith(outer + ".") for outer in keep)]
    exported = exported_program(model, example_inputs, keep)
    region = _regions(model, exported, keep)
    by_name = {node.name: node for node in exported.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, object] = {}
    names = _inputs(model, exported, graph, env, root)
    output = None
    called: set[str] = set()
    for node in exported.graph.nodes:
        if node.op == "placeholder" or (node.op == "call_function" and node.target in _DROPPED):
            continue
        if node in region:
            if region[node] not in called:
                called.add(region[node])
                _call_kept(model, exported, region[node], graph, env, root, by_name)
        elif node.op == "get_attr":  # submodules of higher-order operators
            target = f"_pipeloom_module_{node.target}"
            root[target] = getattr(exported.graph_module, str(node.target))
            env[node] = graph.get_attr(target)
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            output = node
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    assert output is not None  # every graph ends in its output node
    user = _outputs(model, exported, output, graph, env, root)
    graph.output(tuple(user))
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:  # a kept module's own tensors
        graph.erase_node(node)
    tree = pytree.tree_unflatten(user, exported.call_spec.out_spec)
    device = next(t.device for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor))
    return TracedModel(root=root, graph=graph, input_names=names, output=tree, tracer="export", device=device,
                       sizes=traced_sizes(exported, names, example_inputs))


def _kept_refusal(model: nn.Module, name: str, why: str) -> ModelTraceError:
    return ModelTraceError(
        f"torch.export cannot keep module {name!r} of {type(model).__name__} whole (as a call of the module "
        f"itself, which leaf_modules or a tensor-parallel plan asks for): {why}. Drop it from leaf_modules (or "
        "from the tp_plan), use tracer='fx' where torch.fx traces the model, or split it by hand: "
        "pipeloom.runtime.stages_from_modules([stage0, stage1, ...])")


def _regions(model: nn.Module, exported: torch.export.ExportedProgram, keep: Sequence[str]) -> dict[fx.Node, str]:
    """Every node that a kept module's forward was flattened into -> that module's name; checked that only
    the module's recorded outputs are used outside it."""
    region: dict[fx.Node, str] = {}
    for node in exported.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        scopes = module_scopes(node)
        inside = next((name for name in keep if name in scopes), None)
        if inside is not None:
            region[node] = inside
    for name in keep:
        signature = _signature(model, exported, name)  # first: a module called twice is refused by name
        outputs = {getattr(spec, "name", None) for spec in signature.outputs}
        _release_sizes(region, name)
        for node, owner in list(region.items()):
            if owner != name or node.name in outputs:
                continue
            leaking = [user.name for user in node.users if region.get(user) != name]
            if leaking:
                raise _kept_refusal(model, name, f"its value {node.name!r} is used outside it ({leaking}) "
                                                 "without being one of its outputs")
    return region


def _release_sizes(region: dict[fx.Node, str], name: str) -> None:
    """Size arithmetic of a kept module used outside it (export shares ``T·k`` between the experts and the
    next layer's ``arange``) is computed outside instead: a leaking node whose value is an int, and the
    int-valued nodes inside it that it derives from, leave the region when their tensor inputs lie outside
    it (the kept module recomputes them itself when called)."""
    def sizes_only(node: fx.Node, found: set[fx.Node]) -> bool:
        value = node.meta.get("val")
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            return False
        found.add(node)
        return all(region.get(arg) != name or arg in found or sizes_only(arg, found) for arg in node.all_input_nodes)

    for node in [n for n, owner in region.items() if owner == name]:
        if any(region.get(user) != name for user in node.users):
            found: set[fx.Node] = set()
            if sizes_only(node, found):
                for size in found:
                    del region[size]


def _signature(model: nn.Module, exported: torch.export.ExportedProgram, name: str):
    if any(e.fqn.startswith(name + "@") for e in exported.module_call_graph):
        raise _kept_refusal(model, name, "forward calls it more than once, so no one call stands for it")
    entry = next((e for e in exported.module_call_graph if e.fqn == name), None)
    if entry is None or entry.signature is None:
        raise _kept_refusal(model, name, "torch.export recorded no call of it (is it called in forward, once?)")
    return entry.signature


def _call_kept(model: nn.Module, exported: torch.export.ExportedProgram, name: str, graph: fx.Graph,
               env: dict[fx.Node, fx.Node], root: dict[str, object], by_name: dict[str, fx.Node]) -> None:
    """One call_module node for kept module ``name``, its arguments rebuilt from the recorded signature
    (tensors and sizes from the graph, constants as traced); its outputs take the place of the flattened
    nodes that computed them."""
    from torch.export.graph_signature import ConstantArgument

    signature = _signature(model, exported, name)
    flat: list[object] = []
    for spec in signature.inputs:
        if isinstance(spec, ConstantArgument):
            flat.append(spec.value)
            continue
        source = by_name.get(getattr(spec, "name", ""))
        if source is None or source not in env:
            raise _kept_refusal(model, name, f"its input {spec} is not a value of the graph before the call")
        flat.append(env[source])
    args, kwargs = pytree.tree_unflatten(flat, signature.in_spec)
    root[name] = model.get_submodule(name)
    call = graph.call_module(name, tuple(args), dict(kwargs))
    produced = [by_name.get(getattr(spec, "name", "")) for spec in signature.outputs]
    if any(node is None for node in produced):
        raise _kept_refusal(model, name, f"it returns a non-tensor value ({signature.outputs})")
    if signature.out_spec.is_leaf():
        results = [call]
    else:
        leaves = graph.call_function(pytree.tree_leaves, (call,))
        results = [graph.call_function(operator.getitem, (leaves, k)) for k in range(len(produced))]
    for node, result in zip(produced, results):
        assert node is not None  # checked above
        result.meta = {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
        env[node] = result


def _inputs(model: nn.Module, exported: torch.export.ExportedProgram, graph: fx.Graph,
            env: dict[fx.Node, fx.Node], root: dict[str, object]) -> tuple[str, ...]:
    """Parameters, buffers and constants become get_attr nodes of the model's tensors; user inputs
    placeholders (their names returned)."""
    from torch.export.graph_signature import InputKind

    names: list[str] = []
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    signature = exported.graph_signature
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            target = str(spec.target)
            root[target] = _tensor(model, target, spec.kind == InputKind.PARAMETER)
            env[node] = graph.get_attr(target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            target = f"_pipeloom_constant_{spec.target}"
            root[target] = exported.constants[spec.target]
            env[node] = graph.get_attr(target)
        elif spec.kind == InputKind.USER_INPUT:
            env[node] = graph.placeholder(node.name)
            names.append(node.name)
        else:
            raise ModelTraceError(f"torch.export gave {type(model).__name__} an input of kind {spec.kind.name}, "
                                  "which pipeloom cannot run; split it by hand (stages_from_modules)")
        env[node].meta = dict(node.meta)
    return tuple(names)


def _outputs(model: nn.Module, exported: torch.export.ExportedProgram, output: fx.Node, graph: fx.Graph,
             env: dict[fx.Node, fx.Node], root: dict[str, object]) -> list[Argument]:
    """The user outputs (graph nodes, in the output spec's order); buffer updates are written back."""
    from torch.export.graph_signature import OutputKind

    user: list[Argument] = []
    values = cast("Sequence[Argument]", output.args[0])  # the output node's one argument: the outputs
    for value, spec in zip(values, exported.graph_signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:  # write the new value back where the model keeps it
            assert isinstance(value, fx.Node)  # a buffer's new value is computed in the graph
            if value not in env:  # computed inside a module kept whole, which updates its own buffer
                continue
            new = env[value]
            with graph.inserting_after(new):
                buffer = graph.get_attr(str(spec.target))
            with graph.inserting_after(buffer):
                graph.call_function(torch.ops.aten.copy_.default, (buffer, new))
            root[str(spec.target)] = _tensor(model, str(spec.target), False)
        elif spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            user.append(env[value] if isinstance(value, fx.Node) else value)
        else:
            what = "changes its input in place" if spec.kind == OutputKind.USER_INPUT_MUTATION else \
                f"has an output of kind {spec.kind.name}"
            raise ModelTraceError(f"{type(model).__name__} {what}, which pipeloom cannot run across stages; "
                                  "split it by hand (stages_from_modules)")
    return user


def _tensor(model: nn.Module, target: str, parameter: bool) -> torch.Tensor:
    """The model's own parameter or buffer named ``target`` (tied names resolve to the shared object)."""
    return model.get_parameter(target) if parameter else model.get_buffer(target)
