"""Small models for the runtime tests, and the single-device reference of docs/design.md §5."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    """``layers`` residual tanh blocks and a classifier head."""

    def __init__(self, layers: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class Skip(nn.Module):
    """A value made in the first piece is used again two pieces later (a skip connection)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.mid1 = nn.Linear(hidden, hidden)
        self.mid2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        a = torch.tanh(self.mid1(h))
        b = torch.tanh(self.mid2(a))
        return self.out(b + h)


class TwoInputs(nn.Module):
    """Two model inputs; the second one is used only by a later piece."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(4, hidden)
        self.c = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) * torch.sigmoid(self.gate(extra))
        return self.out(torch.tanh(self.c(h)))


class MultiUse(nn.Module):
    """Cut at a, c and out: piece 0's value h is used twice by piece 1 and once by piece 2, and the weight
    ``tied`` too. One device adds each one's gradients use by use, the last
    use first; grouping piece 1's two uses first gives other bits."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 3)
        self.tied = nn.Parameter(torch.randn(hidden, hidden) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        y = torch.tanh(self.a(h)) + torch.tanh(self.b(h))
        y = torch.tanh(torch.tanh(y @ self.tied) @ self.tied.T)
        z = torch.tanh(self.c(y)) * h
        return self.out(z @ self.tied)


SPLITS = {  # model -> split points for 1, 2 and 4 pieces
    "residual": {1: [], 2: ["layers.4"], 3: ["layers.3", "layers.6"], 4: ["layers.2", "layers.4", "layers.6"],
                 8: [f"layers.{i}" for i in range(1, 8)]},
    "skip": {1: [], 2: ["mid2"], 4: ["mid1", "mid2", "out"]},
    "two_inputs": {1: [], 2: ["b"], 4: ["b", "c", "out"]},
    "multi_use": {1: [], 4: ["a", "c", "out"]},
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"residual": Residual, "skip": Skip, "two_inputs": TwoInputs, "multi_use": MultiUse}[name]()


def batch(name: str, rows: int = 16, seed: int = 1) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=generator)
    y = torch.randint(0, 3, (rows,), generator=generator)
    if name == "two_inputs":
        return (x, torch.randn(rows, 4, generator=generator)), y
    return (x,), y


def reference_step(model: nn.Module, inputs: tuple, target: torch.Tensor, microbatches: int) -> torch.Tensor:
    """docs/design.md §5: ``for m: (loss_fn(model(x_m), y_m) / M).backward()``; returns the sum of the losses."""
    chunks = [torch.chunk(t, microbatches) for t in inputs]
    total = None
    for m, y in enumerate(torch.chunk(target, microbatches)):
        loss = F.cross_entropy(model(*(c[m] for c in chunks)), y) / microbatches
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def mismatches(model: nn.Module, reference: nn.Module, owned: set[int]) -> list[str]:
    """Names of owned parameters whose .grad or value is not bitwise equal to the reference's."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if id(p) not in owned:
            continue
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
            bad.append(f"{name}.grad")
        if not torch.equal(p.detach(), q.detach()):
            bad.append(name)
    return bad


def train_one_rank(model_name: str, schedule, pieces: int, steps: int = 3, **options) -> tuple[list[str], list[bool]]:
    """``steps`` SGD steps of ``model_name`` cut into ``pieces`` under ``schedule`` on one rank, next to
    the single-device reference: per step, the names of parameters whose gradient or value is not
    bitwise the reference's, and whether the loss is."""
    import copy

    from pipeloom.runtime import pipeline

    model = build(model_name)
    reference = copy.deepcopy(model)
    engine = pipeline(model, schedule=schedule, split_points=SPLITS[model_name][pieces], loss_fn=F.cross_entropy,
                      microbatches=8, **options)
    ours, theirs = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    problems, losses = [], []
    for step in range(steps):
        inputs, target = batch(model_name, seed=step)
        loss = engine.step(inputs if len(inputs) > 1 else inputs[0], target=target)
        losses.append(torch.equal(loss, reference_step(reference, inputs, target, 8)))
        problems += [f"step {step}: {n}" for n in mismatches(model, reference, {id(p) for p in model.parameters()})]
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad()
    return problems, losses


def train_beside_reference(engine, model, reference, loss_fn, batch_for, steps: int, microbatches: int = 4):
    """``steps`` SGD steps of ``engine`` (over ``model``) next to the single-device ``reference``, the batch of
    step k from ``batch_for(k)`` (inputs: a tensor, or a tuple of the model's inputs): the names of parameters
    not bitwise the reference's after each step, whether every loss was bitwise the reference's, and the ids
    of this rank's parameters (read after each step: an engine split at its first step owns its pieces only
    then)."""
    import torch

    ours = torch.optim.SGD(engine.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    problems, losses_equal, owned = [], True, set()
    for step in range(steps):
        x, y = batch_for(step)
        loss = engine.step(x, target=y)
        owned = {id(p) for p in engine.parameters()}
        expected = None
        chunks = list(zip(*(torch.chunk(t, microbatches) for t in (x if isinstance(x, tuple) else (x,)))))
        for xm, ym in zip(chunks, torch.chunk(y, microbatches)):
            part = loss_fn(reference(*xm), ym) / microbatches
            part.backward()
            expected = part.detach() if expected is None else expected + part.detach()
        losses_equal &= torch.equal(loss, expected)
        problems += [f"step {step}: {n}" for n in mismatches(model, reference, owned)]
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad()
    return problems, bool(losses_equal), owned


def assert_bitwise_reports(results: dict, cases: int | None = None) -> list[tuple[int, str, dict]]:
    """Every rank of ``run_ranks`` finished, and each of its reports (``train_beside_reference``'s outcome per
    case) has no mismatching parameter and bitwise losses; ``cases``: how many reports each rank holds. The
    (rank, case, outcome) triples, for the caller's further checks."""
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, failures
    found = []
    for rank, (_, report) in results.items():
        assert cases is None or len(report) == cases
        for key, outcome in report.items():
            assert outcome["mismatches"] == [], (rank, key, outcome["mismatches"])
            assert outcome["losses_equal"], (rank, key)
            found.append((rank, key, outcome))
    return found
