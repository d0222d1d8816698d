"""What each spawned rank runs in the tensor-parallel tests: pipelines whose stages torch's own
``parallelize_module`` shards over the mesh's "tp" dimension, next to the same plan run by torch without
pipelining (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 5
STEPS = 3
MICROBATCHES = 4


class Block(nn.Module):
    """Attention (heads inferred from the local width, so a column-parallel q/k/v works) and an MLP."""

    def __init__(self, hidden: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, hidden)
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1) @ v  # (B, heads, T, hd)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Tiny(nn.Module):
    """A transformer-ish model: input projection, ``layers`` blocks, classifier head per position."""

    def __init__(self, layers: int = 4, features: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MLP(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, features)
        self.fc3 = nn.Linear(features, hidden)
        self.fc4 = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc2(F.gelu(self.fc1(x))))
        return self.fc4(F.gelu(self.fc3(x)))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"tiny": Tiny, "mlp": MLP}[name]().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (8 samples x 6 positions x 8 features) and per-position class targets of one step."""
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 6, 8, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (8, 6), generator=generator))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, CLASSES), target.reshape(-1))


def parallel_loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The head's logits stay class-sharded (a DTensor): torch's loss_parallel cross-entropy."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(output.reshape(-1, CLASSES), target.reshape(-1))


def megatron_plan(model: str, *, boundary_dtensor: bool = False, parallel_loss: bool = False) -> dict:
    """Column-parallel q/k/v and MLP-in, row-parallel out-projections (Megatron). ``boundary_dtensor``:
    the MLP-in's output stays a DTensor (it crosses the stage boundary cut just before ``layers.1.down``);
    ``parallel_loss``: the head is column-parallel and its logits stay sharded for loss_parallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if model == "mlp":
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "fc3": ColwiseParallel(),
                "fc4": RowwiseParallel()}
        if parallel_loss:
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
                    "fc4": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        return plan
    plan = {f"layers.*.{name}": ColwiseParallel() for name in ("q", "k", "v", "up")}
    plan.update({"layers.*.out": RowwiseParallel(), "layers.*.down": RowwiseParallel()})
    if boundary_dtensor:  # gelu(layers.1.up) crosses the boundary as a Shard(-1) DTensor
        del plan["layers.*.up"]
        plan["layers.[023].up"] = ColwiseParallel()
        plan["layers.1.up"] = ColwiseParallel(use_local_output=False)
    return plan


SPLITS = {2: ["layers.2"], 4: ["layers.1", "layers.2", "layers.3"], "boundary": ["layers.1.down"]}


def _full(tensor) -> object:
    """The whole value as a numpy array (a DTensor gathered over its mesh: a collective)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone().numpy()


def _local(tensor) -> object:
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.detach().cpu().clone().numpy()


def _train(engine_or_model, params, steps: int, step_fn) -> dict:
    """``steps`` SGD steps; per step the loss and every parameter's gradient, local and whole."""
    optimizer = torch.optim.SGD([p for _, p in params()], lr=0.1)
    out = {"loss": [], "local": [], "full": [], "missing": []}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(*batch(step))
        named = list(params())
        out["loss"].append(float(loss))
        out["missing"].append([name for name, p in named if p.grad is None])
        out["local"].append({name: _local(p.grad) for name, p in named if p.grad is not None})
        out["full"].append({name: _full(p.grad) for name, p in named if p.grad is not None})
        optimizer.step()
    return out


def tp_alone(model_name: str, tp_mesh, plan: dict, steps: int, loss=loss_fn) -> dict:
    """The same plan run by torch without pipelining: every micro-batch's loss / M, backward in order."""
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = parallelize_module(build(model_name), tp_mesh, plan)
    around = loss_parallel if loss is parallel_loss_fn else None

    def step_fn(x, y):
        total = 0.0
        for xm, ym in zip(torch.chunk(x, MICROBATCHES), torch.chunk(y, MICROBATCHES)):
            value = loss(model(xm), ym) / MICROBATCHES
            if around is not None:
                with around():
                    value.backward()
                value = value.full_tensor()
            else:
                value.backward()
            total += float(value.detach())
        return total

    return _train(model, model.named_parameters, steps, step_fn)


def tp_pipelines(rank: int, world: int, cases: list[tuple], shape: tuple, names: tuple,
                 refusals: bool = False) -> dict:
    """For each (model, schedule, pieces, variant): ``STEPS`` steps of ``pipeline(..., mesh, tp_plan)``
    and, for each new (model, variant), the same plan without pipelining on this rank's "tp" sub-mesh;
    then, with ``refusals``, what :func:`tp_refusals` finds (one spawn of the ranks for both)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    results: dict = {"coordinates": mesh.get_coordinate()}
    for model_name, schedule, pieces, variant in cases:
        plan = megatron_plan(model_name, parallel_loss=variant == "loss_parallel",
                             boundary_dtensor=variant == "boundary")
        loss = parallel_loss_fn if variant == "loss_parallel" else loss_fn
        if (model_name, variant) not in results:
            results[(model_name, variant)] = tp_alone(model_name, mesh["tp"], plan, STEPS, loss)
        splits = SPLITS["boundary"] if variant == "boundary" else SPLITS[pieces] if pieces > 1 else []
        engine = pipeline(build(model_name), schedule=schedule, split_points=splits, microbatches=MICROBATCHES,
                          loss_fn=loss, mesh=mesh, tp_plan=plan, timeout=30)
        results[(model_name, schedule, pieces, variant)] = _train(engine, engine.named_parameters, STEPS,
                                                                  lambda x, y: engine.step(x, target=y))
        engine.close()
    if refusals:
        results["refusals"] = tp_refusals(rank, world)
    return results


def tp_refusals(rank: int, world: int) -> dict:
    """What a (pp 2, tp 2) mesh refuses, by message (each raised on every rank before any tensor moves),
    and a model parallelized after pipeline(), refused at its next step."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    found = {}
    attempts = {
        "dualpipe": dict(schedule="dualpipe", split_points=SPLITS[2], tp_plan=megatron_plan("tiny")),
        "no plan": dict(schedule="1f1b", split_points=SPLITS[2]),
        "hf": dict(schedule="1f1b", split_points=SPLITS[2], tp_plan="hf"),
        "unknown key": dict(schedule="1f1b", split_points=SPLITS[2], tp_plan={"layers.*.nope": _colwise()}),
    }
    for name, kwargs in attempts.items():
        try:
            pipeline(build("tiny"), microbatches=MICROBATCHES, loss_fn=loss_fn, mesh=mesh, timeout=30, **kwargs)
            found[name] = "built"
        except Exception as error:  # noqa: BLE001 (the test reads the message)
            found[name] = f"{type(error).__name__}: {error}"
    model = build("tiny")
    engine = pipeline(model, schedule="1f1b", split_points=SPLITS[2], microbatches=MICROBATCHES, loss_fn=loss_fn,
                      mesh=mesh, timeout=30, tp_plan={"layers.*.q": _colwise()})
    parallelize_module(model, mesh["tp"], {"layers.*.k": _colwise()})  # too late
    start = time.monotonic()
    try:
        engine.step(*batch(0)[:1], target=batch(0)[1])
        found["late"] = "stepped"
    except Exception as error:  # noqa: BLE001
        found["late"] = f"{type(error).__name__}: {error}"
    found["late_s"] = time.monotonic() - start
    engine.close()
    return found


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()
