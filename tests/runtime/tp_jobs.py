"""What each spawned rank runs in the tensor-parallel tests: pipelines whose stages torch's own
``parallelize_module`` shards over the mesh's "tp" dimension, next to the same plan run by torch without
pipelining; the training-loop helpers with sharded parameters; a hung "tp" peer; 8 ranks (dp x pp x tp).
One spawn of the ranks per mesh shape (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeloom.runtime import Failures, Parallelism

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
    """``steps`` SGD steps; per step the loss and every parameter's gradient, local and whole (and, for an
    engine, the bytes its step moved between stages)."""
    optimizer = torch.optim.SGD([p for _, p in params()], lr=0.1)
    out = {"loss": [], "local": [], "full": [], "missing": [], "traffic": []}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(*batch(step))
        named = list(params())
        out["loss"].append(float(loss))
        out["missing"].append([name for name, p in named if p.grad is None])
        out["local"].append({name: _local(p.grad) for name, p in named if p.grad is not None})
        out["full"].append({name: _full(p.grad) for name, p in named if p.grad is not None})
        traffic = getattr(engine_or_model, "traffic", None)
        if traffic is not None:
            out["traffic"].append((traffic.sent_bytes, traffic.unsplit_bytes, traffic.gathered_bytes))
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


def tp_pipelines(rank: int, world: int, cases: list[tuple], shape: tuple, names: tuple, extras: str = "") -> dict:
    """For each (model, schedule, pieces, variant): ``STEPS`` steps of ``pipeline(..., mesh, tp_plan)``
    and, for each new (model, variant), the same plan without pipelining on this rank's "tp" sub-mesh
    (variant ``whole``: the plain plan with ``scatter_boundaries=False``, against the plain reference).
    With ``extras`` (a checkpoint folder): after the first case's steps its training-loop helpers
    (:func:`tp_helpers`), then what :func:`tp_refusals` finds, and last a hung "tp" peer (:func:`tp_hang`),
    which breaks the groups. ``seconds``: where the time went."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    clock = time.monotonic()
    seconds = {}
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    results: dict = {"coordinates": mesh.get_coordinate(), "seconds": seconds}
    for model_name, schedule, pieces, variant in cases:
        plan = megatron_plan(model_name, parallel_loss=variant == "loss_parallel",
                             boundary_dtensor=variant == "boundary")
        loss = parallel_loss_fn if variant == "loss_parallel" else loss_fn
        if alone_key(model_name, variant) not in results:
            results[alone_key(model_name, variant)] = tp_alone(model_name, mesh["tp"], plan, STEPS, loss)
            seconds[("alone", variant)] = time.monotonic() - clock
        splits = SPLITS["boundary"] if variant == "boundary" else SPLITS[pieces] if pieces > 1 else []
        engine = pipeline(
            build(model_name),
            schedule=schedule,
            split_points=splits,
            microbatches=MICROBATCHES,
            loss_fn=loss,
            parallel=Parallelism(mesh=mesh, tp_plan=plan, scatter_boundaries=variant != "whole"),
            failures=Failures(timeout=30),
        )
        results[(model_name, schedule, pieces, variant)] = _train(engine, engine.named_parameters, STEPS,
                                                                  lambda x, y, engine=engine: engine.step(x, target=y))
        if extras and "helpers" not in results:
            seconds["steps"] = time.monotonic() - clock
            results["helpers"] = tp_helpers(engine, mesh, plan, splits, extras)
            seconds["helpers"] = time.monotonic() - clock
        engine.close()
        seconds[(model_name, schedule, pieces, variant)] = time.monotonic() - clock
        clock = time.monotonic()
    if extras:
        results["refusals"] = tp_refusals(rank, world, mesh)
        seconds["refusals"] = time.monotonic() - clock
        results["hang"] = tp_hang(rank, mesh)
    return results


def alone_key(model_name: str, variant: str) -> tuple[str, str]:
    """Where the results hold the plan run without pipelining that case (model, variant) compares with."""
    return model_name, "" if variant == "whole" else variant


def tp_helpers(engine, mesh, plan: dict, splits: list, folder: str) -> dict:
    """After ``STEPS`` steps: ``eval_step``'s loss on the first batch, which state_dict values are DTensors,
    the whole model's state dict (``full_state_dict``), a DCP checkpoint saved and loaded into a fresh engine
    (its local shards), then one more step clipped with ``clip_grad_norm_`` (the total and the clipped
    gradients, whole)."""
    from pipeloom.runtime import pipeline

    found: dict = {"eval_loss": float(engine.eval_step(*batch(0)[:1], target=batch(0)[1]))}
    state = engine.state_dict()
    found["dtensors"] = sorted(key for key, value in state.items() if hasattr(value, "to_local"))
    found["full_state"] = {key: value.numpy().copy() for key, value in engine.full_state_dict().items()}
    engine.save_checkpoint(folder)
    fresh = pipeline(
        build("tiny"),
        schedule="1f1b",
        split_points=splits,
        microbatches=MICROBATCHES,
        loss_fn=loss_fn,
        parallel=Parallelism(mesh=mesh, tp_plan=plan),
        failures=Failures(timeout=30),
    )
    fresh.load_checkpoint(folder)
    found["loaded_equal"] = {key: bool(torch.equal(_local_tensor(value), _local_tensor(state[key])))
                             for key, value in fresh.state_dict().items()}
    fresh.close()
    if rank0():  # the checkpoint loaded into one unsplit model (DCP reassembles the DTensor shards)
        import torch.distributed.checkpoint as dcp

        whole = build("tiny").state_dict()
        dcp.load({"model": whole}, checkpoint_id=folder, no_dist=True)
        found["one_device_load"] = {key: value.numpy().copy() for key, value in whole.items()}
    for p in engine.parameters():
        p.grad = None
    engine.step(*batch(STEPS)[:1], target=batch(STEPS)[1])
    found["clip_total"] = float(engine.clip_grad_norm_(CLIP))
    found["clipped"] = {name: _full(p.grad) for name, p in engine.named_parameters()}
    return found


CLIP = 0.05  # below the gradient norm of step STEPS, so clipping scales


def rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _local_tensor(value):
    return value.to_local() if hasattr(value, "to_local") else value


def tp_hang(rank: int, mesh, *, timeout: float = 3.0, hung: int = 3) -> dict:
    """Global rank ``hung`` sleeps 1.5 x ``timeout`` inside a tensor-parallel region (before the row-parallel
    ``layers.2.out``, whose all-reduce its "tp" peer is then waiting in), as a hung process that never
    exits would; how long each rank took to raise, and what."""
    import time

    from pipeloom.runtime import pipeline

    engine = pipeline(
        build("tiny"),
        schedule="1f1b",
        split_points=SPLITS[2],
        microbatches=MICROBATCHES,
        loss_fn=loss_fn,
        parallel=Parallelism(mesh=mesh, tp_plan=megatron_plan("tiny")),
        failures=Failures(timeout=timeout),
    )
    woke = []
    if rank == hung:
        def sleep(module, args):
            if not woke:
                time.sleep(1.5 * timeout)
                woke.append(time.monotonic())

        for module in engine.modules.values():
            if "layers.2.out" in dict(module.named_modules()):
                module.get_submodule("layers.2.out").register_forward_pre_hook(sleep)
    start = time.monotonic()
    try:
        engine.step(*batch(0)[:1], target=batch(0)[1])
        found = {"error": "stepped"}
    except Exception as error:  # noqa: BLE001 (the test reads the message)
        found = {"error": f"{type(error).__name__}: {error}"}
    end = time.monotonic()
    found["seconds"] = end - start
    found["after_waking"] = end - woke[0] if woke else None
    found["timeout"] = timeout
    if rank != hung:  # keep the store (rank 0's) up while the sleeper reports its failure
        time.sleep(max(0.0, start + 2 * timeout - time.monotonic()))
    engine.close()
    return found


def tp_plan_without_rows(rank: int, world: int) -> str:
    """pp 1 x tp 2, the Megatron plan without its row-parallel out-projections: what the first step raises."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    plan = {key: style for key, style in megatron_plan("tiny").items() if key not in ("layers.*.out", "layers.*.down")}
    engine = pipeline(build("tiny"), schedule="1f1b", split_points=[], microbatches=MICROBATCHES, loss_fn=loss_fn,
                      parallel=Parallelism(mesh=mesh, tp_plan=plan), failures=Failures(timeout=20))
    try:
        engine.step(*batch(0)[:1], target=batch(0)[1])
        return "stepped"
    except Exception as error:  # noqa: BLE001 (the test reads the message)
        return f"{type(error).__name__}: {error}"


def tp_peer_fails(rank: int, world: int, failing: int = 3) -> str:
    """On a ("tp", "pp") mesh of 2 x 2, global rank ``failing`` raises inside a tensor-parallel region (before the
    row-parallel ``layers.2.out``, whose all-reduce its "tp" peer then waits in): what each rank raises."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    engine = pipeline(build("tiny"), schedule="1f1b", split_points=SPLITS[2], microbatches=MICROBATCHES,
                      loss_fn=loss_fn, parallel=Parallelism(mesh=mesh, tp_plan=megatron_plan("tiny")),
                      failures=Failures(timeout=20))
    if rank == failing:
        def fail(module, args):
            raise RuntimeError("the user's layer failed")

        for module in engine.modules.values():
            if "layers.2.out" in dict(module.named_modules()):
                module.get_submodule("layers.2.out").register_forward_pre_hook(fail)
    try:
        engine.step(*batch(0)[:1], target=batch(0)[1])
        return "stepped"
    except Exception as error:  # noqa: BLE001 (the test reads the message)
        return f"{type(error).__name__}: {error}"


def tp_refusals(rank: int, world: int, mesh) -> dict:
    """What a (pp 2, tp 2) mesh refuses, by message (each raised on every rank before any tensor moves),
    and a model parallelized after pipeline(), refused at its next step."""
    import time

    from torch.distributed.tensor.parallel import parallelize_module

    from pipeloom.runtime import pipeline

    found = {}
    attempts = {
        "dualpipe": ("dualpipe", megatron_plan("tiny")),
        "no plan": ("1f1b", None),
        "hf": ("1f1b", "hf"),
        "unknown key": ("1f1b", {"layers.*.nope": _colwise()}),
    }
    for name, (schedule, tp_plan) in attempts.items():
        try:
            pipeline(
                build("tiny"),
                schedule=schedule,
                split_points=SPLITS[2],
                microbatches=MICROBATCHES,
                loss_fn=loss_fn,
                parallel=Parallelism(mesh=mesh, tp_plan=tp_plan),
                failures=Failures(timeout=30),
            )
            found[name] = "built"
        except Exception as error:  # noqa: BLE001 (the test reads the message)
            found[name] = f"{type(error).__name__}: {error}"
    found.update(_mesh_and_tied_refusals(rank, mesh))
    model = build("tiny")
    engine = pipeline(
        model,
        schedule="1f1b",
        split_points=SPLITS[2],
        microbatches=MICROBATCHES,
        loss_fn=loss_fn,
        parallel=Parallelism(mesh=mesh, tp_plan={"layers.*.q": _colwise()}),
        failures=Failures(timeout=30),
    )
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


def _mesh_and_tied_refusals(rank: int, mesh) -> dict:
    """A tied head given a style (said alike on every rank, the ranks not holding the head included), a rank left
    out of a pp-only mesh of 3 of the 4 ranks (that rank alone calls pipeline()), and a dp 3 x pp 1 mesh of 3 of
    the 4 ranks (every rank calls it): by message."""
    from state_jobs import Tied
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    found = {}
    three = init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
    replicas = init_device_mesh("cpu", (3, 1), mesh_dim_names=("dp", "pp"))
    attempts = {"tied": (Tied(), ["layers.2"], mesh, {"head": _colwise()}),
                "outside": (build("tiny"), SPLITS[4][:2], three, None) if rank == 3 else None,
                "three replicas": (build("tiny"), [], replicas, None)}
    for name, attempt in attempts.items():
        if attempt is None:
            found[name] = "not called"
            continue
        model, splits, on, tp_plan = attempt
        try:
            pipeline(model, schedule="1f1b", split_points=splits, microbatches=MICROBATCHES, loss_fn=loss_fn,
                     parallel=Parallelism(mesh=on, tp_plan=tp_plan), failures=Failures(timeout=30)).close()
            found[name] = "built"
        except Exception as error:  # noqa: BLE001 (the test reads the message)
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def hf_tp(rank: int, world: int, steps: int) -> dict:
    """pp 1 x tp 2: tiny random-init LLaMA (float64) with ``tp_plan="hf"`` (its own plan translated to torch
    styles), ``steps`` steps, next to the same translated plan run by torch without pipelining."""
    from hf_models import build_hf, lm_loss, tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from pipeloom.runtime import pipeline
    from pipeloom.runtime.parallel.tp import hf_plan

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    whole = build_hf("llama").double()  # one stage, the model itself (torch.fx cannot trace it; torch.export
    # flattens its modules, whose hooks the styles need)
    engine = pipeline(
        whole,
        stages=[whole],
        schedule="1f1b",
        microbatches=2,
        loss_fn=lm_loss,
        parallel=Parallelism(mesh=mesh, tp_plan="hf"),
        failures=Failures(timeout=30),
    )
    model = build_hf("llama").double()
    plan = hf_plan(model)
    model = parallelize_module(model, mesh["tp"], plan)
    x, y = tokens()
    out = {"plan": sorted(plan)}
    out["pipeline"] = _train(engine, engine.named_parameters, steps, lambda *_: engine.step(x, target=y))

    def alone(*_):
        total = 0.0
        for xm, ym in zip(torch.chunk(x, 2), torch.chunk(y, 2)):
            value = lm_loss(model(xm), ym) / 2
            value.backward()
            total += float(value.detach())
        return total

    out["alone"] = _train(model, model.named_parameters, steps, alone)
    engine.close()
    if rank0():  # the single-device reference, the same for-loop on the unsplit model
        model = build_hf("llama").double()
        out["one_device"] = _train(model, model.named_parameters, steps, alone)["full"]
    return out


def mesh3d(rank: int, world: int) -> dict:
    """8 ranks, (dp 2, pp 2, tp 2): one 1f1b step of the Megatron plan; this rank's coordinates, loss and
    gradients (local and whole)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    engine = pipeline(
        build("tiny"),
        schedule="1f1b",
        split_points=SPLITS[2],
        microbatches=MICROBATCHES // 2,
        loss_fn=loss_fn,
        parallel=Parallelism(mesh=mesh, tp_plan=megatron_plan("tiny")),
        failures=Failures(timeout=60),
    )
    out = _train(engine, engine.named_parameters, 1, lambda x, y: engine.step(x, target=y))
    engine.close()
    return {"coordinates": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())), **out}


def two_ranks(rank: int, world: int, cases: list[tuple], hf_steps: int) -> dict:
    """pp 1 x tp 2 in one spawn: the engine as torch's TP alone (``cases``), then LLaMA with ``tp_plan="hf"``."""
    found = tp_pipelines(rank, world, cases, (1, 2), ("pp", "tp"))
    found["hf"] = hf_tp(rank, world, hf_steps)
    found["refusals"] = plain_refusals()
    return found


def plain_refusals() -> dict:
    """What pipeline() refuses before anything moves, without a mesh: by message."""
    from hf_models import build_hf

    from pipeloom.runtime import pipeline

    found = {}
    attempts = {"gpt2": (build_hf("gpt2"), "hf"), "no mesh": (build("tiny"), megatron_plan("tiny")),
                "auto": (build("tiny"), "auto")}
    for name, (model, plan) in attempts.items():
        try:
            pipeline(
                model,
                schedule="gpipe",
                split_points=[],
                microbatches=2,
                loss_fn=loss_fn,
                parallel=Parallelism(tp_plan=plan),
            )
            found[name] = "built"
        except Exception as error:  # noqa: BLE001 (the test reads the message)
            found[name] = f"{type(error).__name__}: {error}"
    found.update(hf_translations())
    return found


def hf_translations() -> dict:
    """transformers style names as :func:`~pipeloom.runtime.parallel.tp.hf_plan` translates them (each style's class
    and layouts, as text) on a stand-in model whose config carries a ``base_model_tp_plan``, and a style it
    does not translate, by message."""
    from types import SimpleNamespace

    from pipeloom.runtime.parallel.tp import hf_plan

    names = {"a": "colwise", "b": "rowwise", "c": "colwise_rep", "d": "rowwise_rep", "e": "sequence_parallel",
             "f": "embedding_rowwise", "g": "replicate"}
    model = nn.Module()  # a module for each key: a key naming none is left out, as transformers leaves it
    for key in names:
        model.add_module(key, nn.Linear(2, 2))
    model.add_module("layers", nn.ModuleList([nn.Module()]))
    model.layers[0].add_module("mlp", nn.Module())
    model.layers[0].mlp.add_module("experts", nn.Linear(2, 2))
    model.config = SimpleNamespace(base_model_tp_plan=names)
    found = {"translated": {key: (type(style).__name__, str(getattr(style, "input_layouts", None)),
                                  str(getattr(style, "output_layouts", None)))
                            for key, style in hf_plan(model).items()}}
    model.config = SimpleNamespace(base_model_tp_plan={"layers.*.mlp.experts": "moe_tp_experts"})
    try:
        hf_plan(model)
        found["untranslated"] = "translated"
    except Exception as error:  # noqa: BLE001
        found["untranslated"] = f"{type(error).__name__}: {error}"
    return found
