"""I followed by W gives bitwise the gradients of one full backward (B)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn

from pipeloom.runtime.step.backward import backward_full, backward_input


class Block(nn.Module):
    """Pre-norm attention and MLP: LayerNorm used twice, a chunked projection, softmax, GELU."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Tied(nn.Module):
    """One Linear applied twice and its weight read directly: a parameter reached from two places."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))) + self.lin.weight.sum()


class Embed(nn.Module):
    """Integer inputs: nothing to send back, so I does nothing and W does the whole backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.emb(x))


def _inputs(name: str, mb: int):
    generator = torch.Generator().manual_seed(mb)
    if name == "embed":
        return torch.randint(0, 20, (3, 5), generator=generator)
    shape = (2, 5, 16) if name == "block" else (3, 8)
    return torch.randn(*shape, generator=generator).requires_grad_()


def _run(model: nn.Module, name: str, split: bool) -> tuple[list, list]:
    input_grads = []
    for mb in range(3):
        x = _inputs(name, mb)
        out = model(x)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + mb))
        if split:
            found, pending = backward_input([out], [grad], [x], list(model.parameters()))
            if mb == 0:
                assert all(p.grad is None for p in model.parameters()), "I must not touch weight gradients"
            pending.weight()
        else:
            found = backward_full([out], [grad], [x])
        input_grads.append(found[0])
    return input_grads, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["block", "tied", "embed"])
def test_input_then_weight_equals_full_backward_bitwise(name):
    torch.manual_seed(0)
    model = {"block": Block, "tied": Tied, "embed": Embed}[name]()
    full_inputs, full_weights = _run(copy.deepcopy(model), name, split=False)
    split_inputs, split_weights = _run(copy.deepcopy(model), name, split=True)
    for a, b in zip(full_inputs, split_inputs):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(full_weights, split_weights):
        assert a is not None and torch.equal(a, b)


def test_weight_work_waits_until_asked():
    model = Block()
    x = _inputs("block", 0)
    out = model(x)
    found, pending = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert found[0] is not None and found[0].shape == x.shape
    assert all(p.grad is None for p in model.parameters())
    pending.weight()
    assert all(p.grad is not None for p in model.parameters())
    pending.weight()  # a second call has nothing left to do
    assert x.grad is None
