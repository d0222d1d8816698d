"""What each spawned rank runs in the tests of planned tensor parallelism: collectives counted while a
searched recipe runs under torch's parallelize_module, and a saved plan with tensor_parallel run by
``pipeline(model, plan=...)`` (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tp_jobs import Block

from pipeloom.runtime import Failures

VOCAB = 16
HIDDEN = 16
SEQ = 6


class Vocab(nn.Module):
    """Token embedding, ``layers`` attention+MLP blocks (tp_jobs.Block), an LM head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def tokens(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
            torch.randint(0, VOCAB, (batch, SEQ), generator=generator))


def count_job(rank: int, world: int, recipes: list[dict], batch: int) -> list[dict]:
    """Per recipe, the collectives of one forward and one backward of ``Vocab`` under it on a ``world``-rank
    tp group: torch's CommDebugMode totals and pipeloom's (kind, bytes) records."""
    return [_count(world, recipe, batch) for recipe in recipes]


def _count(world: int, recipe: dict, batch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from pipeloom.profile.collectives import CollectiveCounter
    from pipeloom.runtime.parallel.tp import recipe_styles

    torch.manual_seed(0)
    model = Vocab().double()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, recipe_styles(recipe))
    x, y = tokens(batch)
    found = {}
    for phase in ("F", "B"):
        with CommDebugMode() as debug, CollectiveCounter() as counter:
            if phase == "F":
                loss = loss_fn(model(x), y)
            else:
                loss.backward()
        found[phase] = {"torch": debug.get_total_counts(), "records": sorted(counter.records)}
    return found


def plan_job(rank: int, world: int, plan_path: str, steps: int) -> dict:
    """``pipeline(Vocab(), plan=plan_path)`` (the plan builds its ("pp", "tp") mesh) for ``steps`` SGD steps."""
    from pipeloom.runtime import pipeline

    torch.manual_seed(0)
    model = Vocab(layers=4).double()
    engine = pipeline(model, plan=plan_path, loss_fn=loss_fn, failures=Failures(timeout=60))
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = tokens(8, seed=step)
        losses.append(float(engine.step(x, target=y)))
        missing = [name for name, p in engine.named_parameters() if p.grad is None] \
            if hasattr(engine, "named_parameters") else []
        optimizer.step()
    return {"losses": losses, "missing": missing,
            "sharded": sum(type(p).__name__ == "DTensor" for p in engine.parameters())}
