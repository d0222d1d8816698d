"""What each spawned rank runs in the multi-rank runtime tests (importable by the child processes)."""

from __future__ import annotations

import copy
import os
import time

from pipeloom.runtime import Failures


def exactness(rank: int, world: int, cases: list[tuple[str, str, int, object]], steps: int = 2,
              batched: bool = False) -> dict:
    """For every (model, schedule, pieces, options) case: train ``steps`` SGD steps with the engine and
    with the single-device reference; report mismatching parameters and whether the losses agree."""
    import torch
    import torch.nn.functional as F
    from models import SPLITS, batch, build, mismatches, reference_step

    from pipeloom.runtime import pipeline
    from pipeloom.runtime.comm.transport import OrderedTransport

    results = {}
    for model_name, schedule, pieces, options in cases:
        key = f"{model_name}/{schedule if isinstance(schedule, str) else schedule.name}/{pieces}"
        model = build(model_name)
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=SPLITS[model_name][pieces],
            loss_fn=F.cross_entropy,
            microbatches=8,
            schedule_options=options,
            failures=Failures(timeout=30),
        )
        if batched:  # the NCCL transport (batch_isend_irecv, in posting order, no lookahead) on gloo
            engine.messenger.transport = OrderedTransport(engine.messenger.group)
        owned = {id(p) for p in engine.parameters()}
        ours = torch.optim.SGD(engine.parameters(), lr=0.1)
        theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
        problems, losses_equal = [], True
        for step in range(steps):
            inputs, target = batch(model_name, seed=step)
            loss = engine.step(inputs if len(inputs) > 1 else inputs[0], target=target)
            expected = reference_step(reference, inputs, target, 8)
            losses_equal &= torch.equal(loss, expected)
            problems += [f"step {step}: {name}" for name in mismatches(model, reference, owned)]
            ours.step()
            theirs.step()
            ours.zero_grad()
            theirs.zero_grad()
        results[key] = {"mismatches": problems, "losses_equal": bool(losses_equal), "owned": len(owned)}
    return results


def searched_schedule(world: int, microbatches: int):
    """A schedule found by pipeloom.search for a V placement with split backward on ``world`` ranks."""
    from pipeloom.search import search
    from pipeloom.search.placements import placement

    problem = placement("v", world)
    return search(problem, microbatches, memory_limit=None, time_limit=5.0, workers=1).schedule


def fault(rank: int, world: int, mode: str, fail_rank: int) -> object:
    """Rank ``fail_rank`` raises (or dies) in its third forward; every rank reports what it saw."""
    import torch
    import torch.nn.functional as F
    from models import SPLITS, build

    from pipeloom.runtime import PipelineError, pipeline

    model = build("residual")
    engine = pipeline(
        model,
        schedule="1f1b",
        split_points=SPLITS["residual"][world],
        loss_fn=F.cross_entropy,
        microbatches=8,
        failures=Failures(timeout=5),
    )
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == 3:
            if mode == "die":
                os._exit(3)
            raise ValueError("injected fault")

    if rank == fail_rank:
        engine.modules[engine.local_stages[0]].register_forward_pre_hook(hook)
    start = time.monotonic()
    x = torch.randn(16, 16)
    y = torch.randint(0, 3, (16,))
    try:
        engine.step(x, target=y)
    except PipelineError as error:
        return {"seconds": time.monotonic() - start, "message": str(error)}
    return {"seconds": time.monotonic() - start, "message": None}


def group_after_a_failure(rank: int, world: int, how: str) -> dict:
    """Rank 1 raises in a forward (``how="raise"``) or sleeps past the engine's timeout in one (``"hang"``: gloo
    closes the connections itself); then, on every rank: what an engine built earlier on the same group says at its
    next step, what pipeline() says on that group (both had died of gloo's "Connection closed by peer"), and whether
    an engine on a new group, as the refusal says, trains."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from models import SPLITS, build

    from pipeloom.runtime import Parallelism, PipelineError, pipeline

    options = dict(schedule="1f1b", split_points=SPLITS["residual"][world], loss_fn=F.cross_entropy, microbatches=8,
                   failures=Failures(timeout=2))
    x, y = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 3
    bystander = pipeline(build("residual"), **options)
    failing = pipeline(build("residual"), **options)

    def hook(module, args):
        if how == "hang":
            time.sleep(5)
        else:
            raise ValueError("injected fault")

    if rank == 1:
        failing.modules[failing.local_stages[0]].register_forward_pre_hook(hook)
    found: dict = {}
    for name, act in (("failed", lambda: failing.step(x, target=y)), ("bystander", lambda: bystander.step(x, target=y)),
                      ("same group", lambda: pipeline(build("residual"), **options))):
        try:
            act()
            found[name] = None
        except PipelineError as error:
            found[name] = str(error)
    failing.close()
    bystander.close()
    fresh = pipeline(build("residual"), **options, parallel=Parallelism(process_group=dist.new_group(backend="gloo")))
    loss = fresh.step(x, target=y)
    fresh.close()
    found["new group"] = None if loss is None else float(loss)
    return found


def freezing_between_steps(rank: int, world: int, schedule: str) -> dict:
    """Three SGD steps beside the single-device reference: the first piece (layers 0-3) frozen before the second
    step and unfrozen before the third, on the engine's model and the reference alike. Its output then crosses to
    the next rank without a gradient, which the engine had expected from the first step: the second step had died
    ("stage 1 expects ... requiring grad") though docs/runtime.md says freezing between steps is picked up. Per
    step: whether the loss is the reference's, and the owned parameters whose gradient or value is not."""
    import copy

    import torch
    import torch.nn.functional as F
    from models import SPLITS, batch, build, mismatches, reference_step

    from pipeloom.runtime import pipeline

    model = build("residual")
    reference = copy.deepcopy(model)
    pieces = 2 * world if schedule in ("zbv", "interleaved-1f1b") else world
    engine = pipeline(model, schedule=schedule, split_points=SPLITS["residual"][pieces], loss_fn=F.cross_entropy,
                      microbatches=4, failures=Failures(timeout=30))
    owned = {id(p) for p in engine.parameters()}
    found: dict = {"losses": [], "mismatches": []}
    for step in range(3):
        for net in (model, reference):
            for layer in list(net.layers)[:4]:
                layer.requires_grad_(step != 1)
        (x,), y = batch("residual", seed=step)
        loss = engine.step(x, target=y)
        expected = reference_step(reference, (x,), y, 4)
        found["losses"].append(loss is None or bool(torch.equal(loss, expected)))
        with torch.no_grad():
            for net in (model, reference):
                for p in net.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)
                        p.grad = None
        found["mismatches"].append(mismatches(model, reference, owned))
    engine.close()
    return found


def shape_change(rank: int, world: int) -> object:
    """The first stage's output shape changes in the second step although the inputs' do not."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pipeloom.runtime import PipelineError, pipeline

    class Grow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.calls += 1
            return self.lin(x) if self.calls <= 8 else torch.cat([self.lin(x), x], dim=1)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.LazyLinear(3)

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    first, second = Grow(), nn.Linear(4, 3)
    engine = pipeline(
        schedule="1f1b",
        stages=[first, second],
        loss_fn=F.cross_entropy,
        microbatches=8,
        failures=Failures(timeout=10),
    )
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    messages = []
    for _ in range(2):
        try:
            engine.step(x, target=y)
        except PipelineError as error:
            messages.append(str(error))
            break
    return messages


def float64_loss(rank: int, world: int) -> dict:
    """A float64 model: every rank returns the reference loss in float64, whichever holds the loss."""
    import torch
    import torch.nn.functional as F
    from models import SPLITS, batch, build, reference_step

    from pipeloom.runtime import pipeline

    found = {}
    for name, per_rank in (("1f1b", 1), ("zbv", 2), ("dualpipe", 1)):
        model = build("residual").double()
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=name,
            split_points=SPLITS["residual"][world * per_rank],
            loss_fn=F.cross_entropy,
            microbatches=8,
            failures=Failures(timeout=30),
        )
        (x,), y = batch("residual")
        loss = engine.step(x.double(), target=y)
        found[name] = loss.dtype == torch.float64 and torch.equal(loss, reference_step(reference, (x.double(),), y, 8))
    return found


def two_replicas(rank: int, world: int) -> dict:
    """Under DualPipe and Chimera (two replicas of each piece) and, to compare, 1F1B and DualPipeV: what eval_step
    returns on each rank (the whole batch's outputs, equal to one device's, or None), and what a first training step
    of a model with BatchNorm does (the replicas' running statistics differ: refused by name); the same step on two
    data-parallel replicas (replicated and FSDP)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pipeloom.runtime import pipeline

    def mlp(norm: bool) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(6, 8), nn.BatchNorm1d(8) if norm else nn.Identity(), nn.ReLU(), nn.Linear(8, 8),
                  nn.BatchNorm1d(8) if norm else nn.Identity(), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)]
        return nn.Sequential(*layers)

    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))
    found: dict = {}
    for name, splits in (("dualpipe", ["3"]), ("chimera", ["3"]), ("1f1b", ["3"]), ("dualpipev", ["2", "4", "6"])):
        reference = mlp(False).eval()
        engine = pipeline(mlp(False), schedule=name, split_points=splits, loss_fn=F.cross_entropy, microbatches=4,
                          failures=Failures(timeout=30))
        out = engine.eval_step(x)
        with torch.no_grad():  # micro-batch by micro-batch, as the engine runs them
            expected = torch.cat([reference(part) for part in x.chunk(4)])
        found[name] = "none" if out is None else bool(isinstance(out, torch.Tensor) and torch.equal(out, expected))
        engine.close()
        found[f"{name} batchnorm"] = _first_step(pipeline(mlp(True), schedule=name, split_points=splits,
                                                          loss_fn=F.cross_entropy, microbatches=4,
                                                          failures=Failures(timeout=30)), x, y)
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import Parallelism

    for sharding in ("replicate", "fsdp"):  # two data-parallel replicas of a one-rank pipeline
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
        found[f"dp {sharding} batchnorm"] = _first_step(pipeline(
            mlp(True), schedule="1f1b", split_points=[], loss_fn=F.cross_entropy, microbatches=2,
            parallel=Parallelism(mesh=mesh, data_parallel=sharding), failures=Failures(timeout=30)), x, y)
    return found


def _first_step(engine, x, y) -> str:
    """"ran", or the refusal of the engine's first training step; the engine closed after it."""
    from pipeloom.runtime import PipelineError

    try:
        engine.step(x, target=y)
        return "ran"
    except PipelineError as error:
        return str(error)
    finally:
        engine.close()


def replicas_eval(rank: int, world: int) -> dict:
    """On a ("dp", "pp") mesh of 2 x 2 (1f1b, and FSDP) and ("pp", "dp") with dualpipe (two replicas of each piece
    in each data-parallel replica): what eval_step without a target returns on each rank: the whole batch's
    outputs, equal to one device's, or None. Each replica had returned its own rows alone."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import Parallelism, pipeline

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    reference = mlp().eval()
    with torch.no_grad():  # micro-batch by micro-batch, as the engine runs them
        expected = torch.cat([reference(part) for part in x.chunk(8)])
    found: dict = {}
    for name, schedule, names, sharding in (("dp pp", "1f1b", ("dp", "pp"), "replicate"),
                                            ("fsdp", "1f1b", ("dp", "pp"), "fsdp"),
                                            ("dualpipe", "dualpipe", ("pp", "dp"), "replicate")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        engine = pipeline(mlp(), schedule=schedule, split_points=["2"], loss_fn=F.cross_entropy, microbatches=4,
                          parallel=Parallelism(mesh=mesh, data_parallel=sharding), failures=Failures(timeout=30))
        out = engine.eval_step(x)
        found[name] = "none" if out is None else bool(isinstance(out, torch.Tensor) and torch.equal(out, expected))
        engine.close()
    found["tp dtensor"] = _replicas_eval_dtensor()
    found.update(_replicas_eval_sequence_first())
    return found


def _replicas_eval_sequence_first() -> dict:
    """Outputs (tokens, rows, 3), the sequence first, gathered from the other replicas: had been joined along the
    sequence unchecked (the rows of other replicas' micro-batches were not this rank's to read); they come back per
    micro-batch, one device's, as on one replica."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import Parallelism, pipeline

    class Transposed(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), Transposed())

    x = torch.randn(16, 4, 3, generator=torch.Generator().manual_seed(0))  # 8 micro-batches of 2 rows, 4 tokens
    reference = model().eval()
    with torch.no_grad():
        expected = [reference(part) for part in x.chunk(8)]
    found: dict = {}
    for name, schedule, names in (("dp pp", "1f1b", ("dp", "pp")), ("dualpipe", "dualpipe", ("pp", "dp"))):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        engine = pipeline(model(), schedule=schedule, split_points=["1"], loss_fn=F.mse_loss, microbatches=4,
                          parallel=Parallelism(mesh=mesh), failures=Failures(timeout=30))
        out = engine.eval_step(x)
        found[f"{name} sequence first"] = "none" if out is None else bool(
            isinstance(out, list) and len(out) == 8 and all(torch.equal(o, e) for o, e in zip(out, expected)))
        engine.close()
    return found


def _replicas_eval_dtensor() -> str | bool:
    """("dp", "pp", "tp") = (2, 1, 2) with a head whose logits stay a sharded DTensor: each rank's eval_step output,
    made whole, against one device's; the other replica's DTensors had kept their sender's process groups."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from tp_jobs import batch, build, megatron_plan

    from pipeloom.runtime import Parallelism, pipeline

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    x = batch(0)[0]
    reference = build("mlp").eval()
    with torch.no_grad():
        expected = torch.cat([reference(part) for part in x.chunk(8)])
    engine = pipeline(build("mlp"), schedule="1f1b", split_points=[], microbatches=4, loss_fn=F.mse_loss,
                      parallel=Parallelism(mesh=mesh, tp_plan=megatron_plan("mlp", parallel_loss=True)),
                      failures=Failures(timeout=30))
    out = engine.eval_step(x)
    whole = out.full_tensor() if hasattr(out, "full_tensor") else out
    engine.close()
    return bool(torch.allclose(whole, expected)) if isinstance(whole, torch.Tensor) else type(out).__name__


def waited_works(rank: int, world: int) -> list[int]:
    """After each of two steps: how many waited gloo works the messenger still holds (test_exit.py's guard:
    Python, not gloo's worker thread, must free the last collective, the loss all-reduce)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pipeloom.runtime import pipeline

    torch.manual_seed(0)
    engine = pipeline(schedule="1f1b", stages=[nn.Linear(8, 8), nn.Linear(8, 3)], loss_fn=F.cross_entropy,
                      microbatches=4, failures=Failures(timeout=30))
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    kept = []
    for _ in range(2):
        engine.step(x, target=y)
        kept.append(len(engine.messenger._waited))
    engine.close()
    return kept


def profile_in_engine_job(rank: int, world: int, folder: str) -> dict:
    """profile_in_engine on the residual model; the table as JSON, and what an in-memory trace left behind."""
    import torch.nn.functional as F
    from models import batch, build

    from pipeloom.plan.costs.file import costs_to_json
    from pipeloom.profile.in_engine import profile_in_engine
    from pipeloom.runtime import pipeline

    model = build("residual")
    (x,), y = batch("residual")
    folder = os.path.join(folder, f"rank{rank}")
    os.chdir(folder)  # an in-memory trace must write nothing here
    table = profile_in_engine(model, x, loss_fn=F.cross_entropy, target=y, microbatches=4, warmup_steps=1, steps=2)
    grads = [p.grad is None for p in model.parameters()]
    engine = pipeline(
        model,
        schedule="1f1b",
        split_points=["layers.4"],
        loss_fn=F.cross_entropy,
        microbatches=4,
        record=True,
    )
    engine.step(x, target=y)
    engine.step(x, target=y)  # the first step discovers the shapes; the second posts receives ahead
    kinds = sorted({event["kind"] for event in engine.trace_steps[-1]["events"]})
    return {"table": costs_to_json(table), "trace_steps": len(engine.trace_steps), "files": os.listdir(folder),
            "grads": grads, "kinds": kinds}


def profile_in_engine_odd_job(rank: int, world: int) -> str:
    """profile_in_engine on 3 ranks (no two-replica pipeline: the middle rank would hold both copies)."""
    import torch.nn.functional as F
    from models import batch, build

    from pipeloom.plan.costs.file import costs_to_json
    from pipeloom.profile.in_engine import profile_in_engine

    model = build("residual")
    (x,), y = batch("residual")
    return costs_to_json(profile_in_engine(model, x, loss_fn=F.cross_entropy, target=y, microbatches=4,
                                           warmup_steps=1, steps=2))


def profile_in_engine_batchnorm_job(rank: int, world: int) -> str:
    """profile_in_engine on 2 ranks of a model with BatchNorm (no two-replica pipeline: its replicas would update
    the running statistics apart, which the runtime refuses after a step)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pipeloom.plan.costs.file import costs_to_json
    from pipeloom.profile.in_engine import profile_in_engine

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()) for _ in range(4)))
    x, y = torch.randn(16, 8), torch.randint(0, 8, (16,))
    return costs_to_json(profile_in_engine(model, x, loss_fn=F.cross_entropy, target=y, microbatches=4,
                                           warmup_steps=1, steps=2))


def profile_cli_job(rank: int, world: int, example: str, out: str) -> int:
    """``pipeloom profile ... --in-engine`` on every rank of an already started group; its exit code."""
    import contextlib
    import io

    from pipeloom.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["profile", f"{example}:build_model", "--batch", "2", "--seq", "8", "--arg", "layers=2",
                     "--arg", "seq_len=8", "--loss", "lm_loss", "--in-engine", "--microbatches", "4",
                     "--warmup", "1", "--repeats", "2", "--optimizer-factor", "6", "--save", out])
