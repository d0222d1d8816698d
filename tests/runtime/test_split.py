"""split_model / stages_from_modules against the unsplit model.

Oracle: the original model on the same inputs and the same Parameter objects; outputs and parameter
gradients must be bitwise equal (torch.equal), both when autograd runs through the chained stages and
when each stage runs on detached inputs and is back-propagated on its own (as the engine will).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from pipeloom.errors import PipeloomError
from pipeloom.runtime import (
    MODEL_INPUT,
    ModelTraceError,
    SplitOrderError,
    StagedModel,
    StageValueError,
    UnknownSplitPointError,
    check_stage_value,
    split_model,
    stages_from_modules,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Skip(nn.Module):
    """Stage 0's embedding is read again by stage 2 (a skip across a stage)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.body = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        e = self.embed(x)
        h = self.body(e)
        return self.head(h + e * 0.5)


class TwoInTwoOut(nn.Module):
    """Two inputs, two tensors between stages, a model input read by a late stage, dict output."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.mix = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x, y):
        u, v = self.a(x), self.b(y)
        w = self.mix(torch.cat([u, v], dim=-1))
        return self.out(w + y), {"u": u.sum(dim=-1), "w": w}


class Scaled(nn.Module):
    """A bare Parameter (an fx get_attr) read in a later stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 0.3))

    def forward(self, x):
        h = self.a(x)
        return self.b(h) * self.scale + h


class SizeAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)
        return self.b(self.a(x)).reshape(n, -1)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return self.a(x)
        return x


def _loss(out) -> torch.Tensor:
    leaves = [out] if isinstance(out, torch.Tensor) else (
        list(out[:1]) + list(out[1].values()) if isinstance(out, tuple) else [out])
    return sum((t.float() ** 2).sum() for t in leaves)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _run_detached(staged: StagedModel, inputs: tuple) -> tuple[object, list]:
    """Forward each stage on detached inputs, then back-propagate stage by stage in reverse order."""
    outputs, leaves = [], []  # leaves[s]: (producer ref, detached tensor) of stage s's inputs
    for spec, module in zip(staged.graph.stages, staged.stages):
        args, mine = [], []
        for ref in spec.inputs:
            if ref.stage == MODEL_INPUT:
                args.append(inputs[ref.index])
            else:
                leaf = outputs[ref.stage][ref.index].detach().requires_grad_()
                args.append(leaf)
                mine.append((ref, leaf))
        result = module(*args)
        outputs.append((result,) if spec.num_outputs == 1 else tuple(result))
        leaves.append(mine)
    return outputs, leaves


def _backward_detached(staged: StagedModel, inputs: tuple) -> torch.Tensor:
    outputs, leaves = _run_detached(staged, inputs)
    final = [(ref, outputs[ref.stage][ref.index].detach().requires_grad_()) for ref in staged.graph.output_refs()]
    by_ref = {(ref.stage, ref.index): leaf for ref, leaf in final}
    from torch.fx.node import map_aggregate

    out = map_aggregate(staged.graph.output, lambda v: by_ref[(v.stage, v.index)] if hasattr(v, "stage") else v)
    loss = _loss(out)
    loss.backward()
    consumers = [ref_leaf for ref_leaf in final]
    for s in reversed(range(staged.num_stages)):
        grads: dict[int, torch.Tensor] = {}
        for ref, leaf in consumers + [p for later in leaves[s + 1:] for p in later]:
            if ref.stage == s and leaf.grad is not None:
                grads[ref.index] = leaf.grad if ref.index not in grads else grads[ref.index] + leaf.grad
        if grads:
            torch.autograd.backward([outputs[s][i] for i in grads], [grads[i] for i in grads])
    return loss


CASES = [
    (MLP, ["layers.2", "head"], lambda: (torch.randn(5, 8),), [(0, 1), (1, 2)]),
    (MLP, ["layers.1", "layers.2.fc", "layers.3"], lambda: (torch.randn(5, 8),), [(0, 1), (1, 2), (2, 3)]),
    # stage 0's embedding, read by stages 1 and 2, is threaded: stage 2 reads stage 1's unchanged copy
    (Skip, ["body.0", "body.1"], lambda: (torch.randn(5, 4),), [(0, 1), (1, 2)]),
    (TwoInTwoOut, ["b", "mix", "out"], lambda: (torch.randn(5, 6), torch.randn(5, 6)),
     [(0, 1), (1, 2), (1, 3), (2, 3)]),  # stage 3 reads u from stage 1, which reads it too (threaded)
    (Scaled, ["b"], lambda: (torch.randn(5, 4),), [(0, 1)]),
]


@pytest.mark.parametrize(("cls", "points", "make_inputs", "edges"), CASES)
def test_split_matches_unsplit_model_bitwise(cls, points, make_inputs, edges) -> None:
    torch.manual_seed(0)
    model = cls()
    inputs = make_inputs()
    staged = split_model(model, points)
    assert staged.num_stages == len(points) + 1
    assert staged.edges() == edges

    reference = model(*inputs)
    _loss(reference).backward()
    expected = _grads(model)

    out = staged.run(*inputs)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)  # same structure, bitwise values
    _loss(out).backward()
    assert all(torch.equal(g, e) for g, e in zip(_grads(model), expected))

    _backward_detached(staged, inputs)
    assert all(torch.equal(g, e) for g, e in zip(_grads(model), expected))


def test_stages_reuse_the_original_parameter_objects() -> None:
    model = Skip()
    staged = split_model(model, ["body.0", "body.1"])
    stage_params = [p for stage in staged.stages for p in stage.parameters()]
    assert {id(p) for p in stage_params} == {id(p) for p in model.parameters()}
    assert len(stage_params) == len(list(model.parameters()))  # each parameter in exactly one stage
    assert staged.stages[0].embed.weight is model.embed.weight


def test_stage_graph_describes_inputs_and_outputs() -> None:
    staged = split_model(TwoInTwoOut(), ["mix"])
    graph = staged.graph
    assert graph.input_names == ("x", "y")
    assert [(r.stage, r.index) for r in graph.stages[0].inputs] == [(MODEL_INPUT, 0), (MODEL_INPUT, 1)]
    assert graph.stages[0].num_outputs == 2  # cat and u cross (u feeds the output's "u")
    assert [r.name for r in graph.stages[1].inputs] == ["cat", "y", "a"]
    assert [(r.stage, r.index) for r in graph.stages[1].inputs] == [(0, 0), (MODEL_INPUT, 1), (0, 1)]
    assert len(graph.output_refs()) == 3


def test_manual_chain_matches_sequential() -> None:
    torch.manual_seed(1)
    parts = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4), nn.Linear(4, 2)]
    model = nn.Sequential(*parts)
    x = torch.randn(3, 4)
    staged = stages_from_modules(parts)
    assert staged.edges() == [(0, 1), (1, 2)]
    assert staged.stages[1] is parts[1]
    _loss(model(x)).backward()
    expected = _grads(model)
    out = staged.run(x)
    assert torch.equal(out, model(x))
    _loss(out).backward()
    assert all(torch.equal(g, e) for g, e in zip(_grads(model), expected))


def test_unknown_split_point_lists_valid_names() -> None:
    with pytest.raises(UnknownSplitPointError, match=r"layers\.9.*'layers\.0\.fc', 'layers\.1\.fc'"):
        split_model(MLP(), ["layers.9"])
    # the nearest names first: its parent's called modules, else the closest spelling
    layers = len(MLP().layers)
    with pytest.raises(UnknownSplitPointError, match=rf"\['layers\.9'\] \(layers calls {layers}: layers\.0, "):
        split_model(MLP(), ["layers.9"])
    with pytest.raises(UnknownSplitPointError, match=r"\['haed'\] \(did you mean 'head'\?\)"):
        split_model(MLP(), ["haed"])
    # a misspelt parent: the same child of the parent meant (a user's model.layer.3 had been told no name)
    with pytest.raises(UnknownSplitPointError, match=r"\['layer\.2'\] \(did you mean 'layers\.2'\?\)"):
        split_model(MLP(), ["layer.2"])
    # the parent example is the model's own (a fixed 'layers.4' had read as the very name a user got wrong)
    with pytest.raises(UnknownSplitPointError, match=r"\(or any parent of them, e\.g\. 'layers\.0' for "
                                                     r"'layers\.0\.fc'\)$"):
        split_model(MLP(), ["layers.9"])


def test_the_reference_step_refuses_a_batch_torch_chunk_cuts_short():
    """6 rows for 4 micro-batches: torch.chunk makes 3; the reference says so, as the engine does (an IndexError)."""
    from pipeloom.runtime.errors import PipelineError
    from pipeloom.runtime.step.rng import reference_step

    staged = split_model(MLP(), ["layers.2"])
    # with the engine's fix: the next row count torch.chunk cuts into 4 (it had named none)
    with pytest.raises(PipelineError, match=r"torch.chunk cuts this batch of 6 rows into 3 pieces, not the 4 "
                                            r"micro-batches; use a row count it cuts into 4 \(7 rows, uneven "
                                            r"micro-batches, or a multiple of 4\)"):
        reference_step(staged, torch.randn(6, 8), torch.randn(6, 3), loss_fn=_loss2, microbatches=4, seed=0)


def _loss2(out, target):
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("points", [["head", "layers.2"], ["layers.2", "layers.2"],
                                    ["layers.2", "layers.2.fc"], ["layers.0"]])
def test_bad_split_point_order(points) -> None:
    with pytest.raises(SplitOrderError):
        split_model(MLP(), points)


def test_split_points_as_a_string_is_an_error() -> None:
    with pytest.raises(PipeloomError, match=r"\['head'\]"):
        split_model(MLP(), "head")


def test_untraceable_model_suggests_manual_mode() -> None:
    with pytest.raises(ModelTraceError, match="stages_from_modules"):
        split_model(Branchy(), ["a"])


def test_non_tensor_value_between_stages_is_named() -> None:
    staged = split_model(SizeAcross(), ["b"])
    with pytest.raises(StageValueError, match=r"'size' passed from stage 0 to stage 1 is of type int"):
        staged.run(torch.randn(3, 4))


def test_errors_are_pipeloom_errors() -> None:
    for error in (UnknownSplitPointError, SplitOrderError, ModelTraceError, StageValueError):
        assert issubclass(error, PipeloomError)


def test_check_stage_value_accepts_tensor_containers_only() -> None:
    t = torch.zeros(2)
    check_stage_value((t, [t], {"k": t}), name="ok")
    for bad in (None, 3, (t, "s"), {}, ()):
        with pytest.raises(StageValueError, match="'v'"):
            check_stage_value(bad, name="v")


class InPlaceAfterSplit(nn.Module):
    """The second stage starts with in-place operations on its input (as ResNet's ``relu`` piece does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x):
        h = self.act(self.a(x))
        h = self.b(h)
        h.mul_(2)
        return self.c(torch.nn.functional.relu(h, inplace=True))


@pytest.mark.parametrize("points", [["act"], ["b", "c"], ["c"]])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_stage_may_change_its_input_in_place(points, tracer) -> None:
    """Oracle: the unsplit model; each stage runs on detached leaf inputs as the engine runs it."""
    torch.manual_seed(0)
    model = InPlaceAfterSplit()
    x = torch.randn(3, 4)
    staged = split_model(model, points, tracer=tracer, example_inputs=(x,))
    expected = model(x)
    values = [x]
    for module in staged.stages:
        leaf = values[-1].detach().requires_grad_()
        values.append(module(leaf))
    assert torch.equal(values[-1], expected)


class Tail(nn.Module):
    """Writes into its input through views before using it."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(4, 2)

    def forward(self, h):
        h.view(-1).mul_(2)
        h.select(1, 0).zero_()
        return self.b(h)


class ViewWrites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.tail = Tail()

    def forward(self, x):
        return self.tail(torch.tanh(self.a(x)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_stage_may_write_into_its_input_through_a_view(tracer) -> None:
    """Oracle: the unsplit model; the second stage runs on a detached leaf input as the engine runs it."""
    torch.manual_seed(0)
    model = ViewWrites()
    x = torch.randn(3, 4)
    staged = split_model(model, ["tail"], tracer=tracer, example_inputs=(x,))
    expected = model(x)
    leaf = staged.stages[0](x).detach().requires_grad_()
    assert torch.equal(staged.stages[1](leaf), expected)


class SizeLater(nn.Module):
    """A size read in the first stage is used by the second stage before any tensor of its own exists."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[0]
        h = self.a(x)
        return self.post(h) + torch.arange(n, dtype=h.dtype).unsqueeze(1)


def test_a_size_from_an_earlier_stage_is_read_from_what_the_later_stage_has() -> None:
    torch.manual_seed(0)
    model = SizeLater()
    staged = split_model(model, ["post"], tracer="export", example_inputs=(torch.randn(3, 4),))
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        assert torch.equal(staged.run(x), model(x))
