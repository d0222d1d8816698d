"""torch.export's symbolic sizes used across a split: computed again in the stage that uses them from sizes
it measures itself (Mamba2's scan padding, a top-k's count made in a ``no_grad`` region), or refused when the split
is made; inputs breaking a size the trace fixed (a loop unrolled for the example's length) refused when they come.
Oracle: the unsplit model's for-loop reference of DESIGN §5 (torch.equal losses and gradients)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn

from pipeloom.runtime import SplitError, TracedSizeError, pipeline, split_model


class Pooled(nn.Module):
    """Stage 1 scales by the input's length, but holds no tensor with that dimension (summed away)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[1]
        return self.b(self.a(x).sum(1)) * (n % 3 + 1)


class PaddedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h, pad):
        return torch.tanh(self.linear(nn.functional.pad(h, (0, 0, 0, pad))))[:, :h.shape[1]]


class Padded(nn.Module):
    """Every block pads to a multiple of 4 with one size computed once from the input's length, as Mamba2's
    scan does: the blocks after the split need it too."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PaddedBlock() for _ in range(2))

    def forward(self, x):
        pad = (4 - x.shape[1] % 4) % 4
        for block in self.blocks:
            x = block(x, pad)
        return x.sum(1)


class ChosenBlock(nn.Module):
    """Under ``no_grad``, picks each row's top ``min(3, length)`` positions and updates only those."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h):
        with torch.no_grad():
            keep = h.sum(-1).topk(min(3, h.shape[1]), dim=-1).indices
        mask = torch.zeros(h.shape[:2]).scatter(1, keep, 1.0)
        return h + torch.tanh(self.linear(h)) * mask[..., None]


class Chosen(nn.Module):
    """Two blocks choosing their top positions as DeepSeek's sparse attention's indexer does: torch.export makes the
    count ``Min(3, s)`` once, as an output of the first block's ``no_grad`` region, and the second block's reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ChosenBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum(1)


class ChunkScan(nn.Module):
    """A scan over chunks of 4 positions in a Python loop over ``x.shape[1] // 4`` of them (the rest left zero), as
    transformers' gated delta rule loops over its chunks: torch.export unrolls it for the example's length, so the
    graph holds for lengths with as many whole chunks only (it would leave the others' later chunks zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        out = torch.zeros_like(x)
        state = torch.zeros_like(x[:, 0])
        for i in range(x.shape[1] // 4):
            chunk = x[:, 4 * i:4 * i + 4]
            out[:, 4 * i:4 * i + 4] = chunk + state[:, None]
            state = state + torch.tanh(self.linear(chunk)).sum(1)
        return out


def test_inputs_breaking_a_size_the_trace_fixed_are_refused_and_others_run_bitwise():
    torch.manual_seed(0)
    model = ChunkScan()
    staged = split_model(model, [], tracer="export", example_inputs=(torch.randn(2, 8, 4),))
    for length in (8, 9, 11):  # two whole chunks, as the example's
        x = torch.randn(3, length, 4)
        assert torch.equal(staged.run(x), model(x))
    for length in (4, 12, 13):
        with pytest.raises(TracedSizeError, match=r"x\.shape\[1\].*example of shape \[\(2, 8, 4\)\].*unrolled"):
            staged.run(torch.randn(3, length, 4))
    with pytest.raises(TracedSizeError, match=r"x\.shape\[2\] == 4"):  # a dimension export made constant
        staged.run(torch.randn(3, 8, 5))


def test_a_trace_on_a_size_of_one_says_export_fixed_it():
    """torch.export makes a dimension of size 1 a constant: a trace on a one-token example refuses longer inputs,
    and the refusal says why and to trace on sizes above 1 (a new user's trial had been told of unrolled loops and
    padding, neither its cause)."""
    model = torch.nn.Linear(4, 4)
    staged = split_model(model, [], tracer="export", example_inputs=(torch.randn(2, 1, 4),))
    with pytest.raises(TracedSizeError, match=r"shape\[1\] == 1.*torch\.export makes a dimension of size 1 a "
                                              r"constant.*Trace on a batch whose sizes are all above 1"):
        staged.run(torch.randn(2, 16, 4))


def test_an_engine_refuses_a_step_breaking_its_trace_and_stays_usable():
    """Through ``pipeline()`` (traced on the first step's batch, length 8): a step of length 12 is refused before
    it runs, and the engine takes the next step, of length 9, bitwise as the for-loop reference."""
    torch.manual_seed(0)
    model = ChunkScan()
    reference = copy.deepcopy(model)

    def loss_fn(output, target):
        return ((output - target) ** 2).mean()

    engine = pipeline(model, schedule="1f1b", split_points=[], loss_fn=loss_fn, microbatches=2)
    for length in (8, 12, 9):
        x, y = torch.randn(4, length, 4), torch.randn(4, length, 4)
        if length == 12:
            with pytest.raises(TracedSizeError, match="unrolled"):
                engine.step(x, target=y)
            assert not engine.broken
            continue
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = engine.step(x, target=y)
        expected = torch.zeros(())
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            part = loss_fn(reference(xm), ym) / 2
            part.backward()
            expected = expected + part.detach()
        assert torch.equal(loss, expected)
        assert torch.equal(model.linear.weight.grad, reference.linear.weight.grad)


def test_a_size_no_tensor_of_the_stage_carries_is_refused_when_the_split_is_made():
    with pytest.raises(SplitError, match=r"made in stage 0 is used in stage 1 .*stages_from_modules"):
        split_model(Pooled(), ["b"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))


def test_a_size_computed_from_sizes_is_computed_again_in_the_stage_using_it():
    torch.manual_seed(0)
    model = Padded()
    staged = split_model(model, ["blocks.1"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))
    for length in (5, 6, 8):
        x = torch.randn(3, length, 4)
        assert torch.equal(staged.run(x), model(x))


def test_a_size_a_no_grad_region_returns_is_computed_again_from_its_expression():
    """``Min(3, s)`` comes out of the first block's ``no_grad`` region, no integer operation the stage could run
    again: the stage after the split builds it from its expression, ``sym_min(3, sym_size(x, 1))``, on its input, for
    lengths below, at and above 3."""
    torch.manual_seed(0)
    model = Chosen()
    staged = split_model(model, ["blocks.1"], tracer="export", example_inputs=(torch.randn(2, 5, 4),))
    for length in (2, 3, 5, 8):
        x = torch.randn(3, length, 4)
        assert torch.equal(staged.run(x), model(x))


@pytest.mark.timeout(400)
def test_mamba2_splits_after_its_first_layer_bitwise_on_two_ranks():
    pytest.importorskip("transformers")
    from mamba_jobs import mamba2_exactness
    from models import assert_bitwise_reports
    from ranks import run_ranks

    results = run_ranks(2, mamba2_exactness, [("1f1b", 2), ("zbv", 4)], timeout=360)
    for rank, key, outcome in assert_bitwise_reports(results):
        assert outcome["owned"] > 0, (rank, key)
