"""What each spawned rank runs in the training-loop helper tests (importable by the child processes),
and a model whose embedding and head share one weight."""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

from pipeloom.runtime import Failures

MICROBATCHES = 4


class Tied(nn.Module):
    """Token ids -> embedding -> residual tanh blocks -> a head whose weight is the embedding's."""

    def __init__(self, vocab: int = 11, hidden: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


class Dropped(Tied):
    """:class:`Tied` with dropout after every block: its losses depend on the engine's random seed."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.ModuleList(nn.Dropout(0.3) for _ in self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer, drop in zip(self.layers, self.drop):
            h = h + drop(torch.tanh(layer(h)))
        return self.head(h)


TIED_SPLITS = {1: [], 2: ["layers.2"], 4: ["layers.1", "layers.2", "layers.3"]}
PIECES_PER_RANK = {"1f1b": 1, "zbv": 2, "dualpipe": 1}


def model_for(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in ("tied", "dropped"):
        return Tied() if name == "tied" else Dropped()
    from models import build

    return build(name, seed=seed)


def batch_for(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, target) of 16 rows."""
    if name in ("tied", "dropped"):
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 11, (32,), generator=generator)
        return ids[:16], ids[16:]
    from models import batch

    (x,), y = batch(name, seed=seed)
    return x, y


def engine_for(model: nn.Module, schedule: str, world: int, **options):
    from models import SPLITS

    from pipeloom.runtime import pipeline

    pieces = PIECES_PER_RANK[schedule] * world
    splits = TIED_SPLITS[pieces] if isinstance(model, Tied) else SPLITS["residual"][pieces]
    return pipeline(
        model,
        schedule=schedule,
        split_points=splits,
        loss_fn=F.cross_entropy,
        microbatches=MICROBATCHES,
        **options,
        failures=Failures(timeout=30),
    )


def clip_cases(rank: int, world: int, cases: list[tuple[str, str, object]]) -> dict:
    """For every (model, schedule, norm type): one step, then the engine's clip and torch's clip on the
    single-device reference (max_norm half the reference's norm, so it scales); what differs."""
    from models import mismatches, reference_step

    results = {}
    for model_name, schedule, norm_type in cases:
        model = model_for(model_name)
        reference = copy.deepcopy(model)
        engine = engine_for(model, schedule, world)
        x, y = batch_for(model_name, 1)
        engine.step(x, target=y)
        reference_step(reference, (x,), y, MICROBATCHES)
        unclipped = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
        max_norm = float(unclipped) / 2
        ours = engine.clip_grad_norm_(max_norm, norm_type=norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
        owned = {id(p) for p in engine.parameters()}
        results[f"{model_name}/{schedule}/{norm_type}"] = {
            "total_equal": torch.equal(ours, theirs), "scaled": bool(theirs > max_norm),
            "mismatches": mismatches(model, reference, owned), "owned": len(owned),
        }
    return results


def names_job(rank: int, world: int) -> dict:
    """Each rank's named_parameters() and state_dict() keys on 1f1b, whether the named parameters are
    the model's own objects, and (Residual) what loading a whole single-device state dict does."""
    found = {}
    for model_name in ("residual", "tied"):
        model = model_for(model_name)
        engine = engine_for(model, "1f1b", world)
        named = list(engine.named_parameters())
        found[model_name] = {
            "names": [name for name, _ in named],
            "same_objects": all(p is dict(model.named_parameters())[name] for name, p in named),
            "state_keys": list(engine.state_dict()),
        }
    other = model_for("residual", seed=5).state_dict()
    result = engine_for(model_for("residual"), "1f1b", world)
    loaded = result.load_state_dict(other)
    found["residual"]["loaded"] = {
        "result": (loaded.missing_keys, loaded.unexpected_keys),
        "equal": all(torch.equal(p, other[name]) for name, p in result.named_parameters()),
    }
    return found


def _train(engine, optimizer, steps: range, model_name: str) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        x, y = batch_for(model_name, step)
        losses.append(engine.step(x, target=y))
        engine.clip_grad_norm_(0.5)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _adam_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for p in optimizer.param_groups[0]["params"] for value in optimizer.state[p].values()]


def _settings(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def checkpoint_job(rank: int, world: int, folder: str, model_name: str, schedule: str) -> dict:
    """Train 2 steps (AdamW, clipping), save with DCP, train 2 more; a fresh engine (other initial
    weights, other learning rate and weight decay) loads and trains the same 2 steps. The checkpoint goes
    to ``folder/dcp``; rank 0 saves the full state dict after the first 2 steps and the losses of steps
    2-3 to ``folder/expected.pt`` (tensors do not survive the result queue)."""
    model = model_for(model_name)
    engine = engine_for(model, schedule, world)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=0.01, weight_decay=0.1)
    _train(engine, optimizer, range(2), model_name)
    engine.save_checkpoint(os.path.join(folder, "dcp"), optimizer=optimizer)
    full = engine.full_state_dict()
    full_on_last = engine.full_state_dict(rank=world - 1)
    losses = _train(engine, optimizer, range(2, 4), model_name)

    fresh = engine_for(model_for(model_name, seed=123), schedule, world)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5, weight_decay=0.0)
    different_before = not any(torch.equal(p, q) for (_, p), (_, q) in
                               zip(fresh.named_parameters(), engine.named_parameters()))
    fresh.load_checkpoint(os.path.join(folder, "dcp"), optimizer=fresh_optimizer)
    fresh_losses = _train(fresh, fresh_optimizer, range(2, 4), model_name)
    ours, theirs = dict(engine.named_parameters()), dict(fresh.named_parameters())
    ours_state, theirs_state = _adam_state(optimizer), _adam_state(fresh_optimizer)
    if rank == 0:
        torch.save({"full": full, "losses": losses}, os.path.join(folder, "expected.pt"))
    return {
        "different_before": different_before,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, fresh_losses)),
        "params_equal": ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours),
        "state_equal": len(ours_state) == len(theirs_state) > 0
        and all(torch.equal(a, b) for a, b in zip(ours_state, theirs_state)),
        "groups_equal": [_settings(a) == _settings(b) for a, b in zip(optimizer.param_groups,
                                                                       fresh_optimizer.param_groups)],
        "full_keys": list(full), "full_on_last_keys": list(full_on_last),
    }


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 2, total: int = 6):
    """A LambdaLR rising linearly for ``warmup`` steps, then a cosine down to 0 at ``total``."""
    import math

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_scheduled(engine, optimizer, scheduler, steps: range) -> tuple[list[torch.Tensor], list[float]]:
    losses, rates = [], []
    for step in steps:
        x, y = batch_for("dropped", step)
        losses.append(engine.step(x, target=y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    return losses, rates


def scheduler_job(rank: int, world: int, folder: str, schedule: str) -> dict:
    """A model with dropout, AdamW and a warm-up/cosine LR scheduler: 2 steps, a checkpoint with
    ``extra={"scheduler": ...}``, 3 more steps. A fresh engine built with another seed (other weights,
    optimizer settings and a fresh scheduler) loads it and runs the same 3 steps; so does one that loads
    without the scheduler (what forgetting it does)."""
    path = os.path.join(folder, "dcp")
    engine = engine_for(model_for("dropped"), schedule, world, seed=7)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=0.05)
    scheduler = warmup_cosine(optimizer)
    train_scheduled(engine, optimizer, scheduler, range(2))
    engine.save_checkpoint(path, optimizer=optimizer, extra={"scheduler": scheduler})
    losses, rates = train_scheduled(engine, optimizer, scheduler, range(2, 5))

    resumed = {}
    for name, extra in (("with", True), ("without", False)):
        fresh = engine_for(model_for("dropped", seed=123), schedule, world, seed=99)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        fresh_scheduler = warmup_cosine(fresh_optimizer)
        seed_before = fresh.seed
        fresh.load_checkpoint(path, optimizer=fresh_optimizer, extra={"scheduler": fresh_scheduler} if extra else None)
        fresh_losses, fresh_rates = train_scheduled(fresh, fresh_optimizer, fresh_scheduler, range(2, 5))
        resumed[name] = {
            "seed": (seed_before, fresh.seed), "rates_equal": fresh_rates == rates,
            "losses_equal": [torch.equal(a, b) for a, b in zip(losses, fresh_losses)],
        }
    return {"seed": engine.seed, "losses": [float(loss) for loss in losses], "rates": rates, **resumed}


def checkpoint_cases(rank: int, world: int, folder: str, cases: list[tuple[str, str]]) -> dict:
    """:func:`checkpoint_job` for every (model, schedule), each in ``folder/<model>-<schedule>``."""
    return {f"{name}/{schedule}": checkpoint_job(rank, world, os.path.join(folder, f"{name}-{schedule}"),
                                                name, schedule)
            for name, schedule in cases}


def full_state_job(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """After 3 SGD steps with the engine and the single-device reference: the full state dict on rank 0
    against the reference's state_dict (keys in order, and bits); ``{}`` on the other ranks."""
    from models import reference_step

    results = {}
    for model_name, schedule in cases:
        model = model_for(model_name)
        reference = copy.deepcopy(model)
        engine = engine_for(model, schedule, world)
        ours = torch.optim.SGD(engine.parameters(), lr=0.1)
        theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch_for(model_name, step)
            engine.step(x, target=y)
            reference_step(reference, (x,), y, MICROBATCHES)
            for optimizer in (ours, theirs):
                optimizer.step()
                optimizer.zero_grad()
        full = engine.full_state_dict()
        expected = reference.state_dict()
        results[f"{model_name}/{schedule}"] = (
            {"empty": full == {}} if rank != 0 else
            {"keys": list(full), "expected_keys": list(expected),
             "values_equal": all(torch.equal(full[k], v) for k, v in expected.items() if k in full)})
    return results


def sharded_norm_job(rank: int, world: int, sizes: list[int]) -> list[dict]:
    """Per size: a float32 gradient sharded over every rank (dim 0, as FSDP2 shards it), its norm as the clip
    computes it against ``vector_norm`` of the whole gradient on one device, whether the shards' own norms
    combined (the clip's earlier way) would have differed, and that a gradient sharded over another mesh than
    FSDP's is not gathered (its norm is its shards' norms combined)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeloom.runtime.state.clip import _norms

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    found = []
    for size in sizes:
        whole = torch.randn(size, generator=torch.Generator().manual_seed(size)) * 3
        sharded = distribute_tensor(whole, mesh, [Shard(0)])
        expected = torch.linalg.vector_norm(whole, 2.0)
        ours = _norms([sharded], 2.0, None, mesh)[0]  # sharded over the mesh FSDP shards over: gathered whole
        elsewhere = _norms([sharded], 2.0, None)[0]  # over another mesh (ep's, tp's): from its shards' norms
        combined = torch.linalg.vector_norm(sharded, 2.0).full_tensor()
        found.append({"equal": torch.equal(ours, expected), "shards_differ": not torch.equal(combined, expected),
                      "elsewhere_from_shards": torch.equal(elsewhere, combined)})
    dist.barrier()
    return found


def _chain(head: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)), nn.Linear(16, head))


def refused_on_one_rank_job(rank: int, world: int, folder: str) -> dict:
    """A checkpoint only the last rank's stage cannot take (its head saved 3 wide, built 5 wide), then an optimizer
    only the last rank's parameters regroup: each rank's error, and the seconds to it (every rank must hear it, none
    left waiting in the load's collectives)."""
    import time

    from pipeloom.runtime import PipelineError, pipeline

    def engine(model: nn.Module):
        return pipeline(model, schedule="1f1b", split_points=["2"], loss_fn=F.cross_entropy, microbatches=2,
                        failures=Failures(timeout=30))

    saving = engine(_chain())
    params = dict(saving.named_parameters())
    late = [p for n, p in params.items() if n.startswith("4.")]
    adam = torch.optim.AdamW([{"params": [p for n, p in params.items() if not n.startswith("4.")]},
                              {"params": late, "weight_decay": 0.0}])
    saving.step(torch.randn(4, 16), target=torch.randint(0, 3, (4,)))
    adam.step()
    saving.save_checkpoint(os.path.join(folder, "ck"), optimizer=adam)
    found = {}
    for case in ("shape", "groups"):
        other = engine(_chain(head=5 if case == "shape" else 3))
        optimizer = torch.optim.AdamW(other.parameters()) if case == "groups" else None
        began = time.perf_counter()
        try:
            other.load_checkpoint(os.path.join(folder, "ck"), optimizer=optimizer)
            found[case] = ("loaded", time.perf_counter() - began)
        except PipelineError as error:
            found[case] = (str(error), time.perf_counter() - began)
    return found
