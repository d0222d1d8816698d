"""What each spawned rank runs in the scale tests: models built on the meta device and filled by the
engine, and pipelines × data-parallel replicas on a DeviceMesh (importable by the child processes)."""

from __future__ import annotations

from pipeloom.runtime import Failures, Parallelism, Tracing, Weights


def _plain(tensor):
    """A tensor as a numpy array (the whole value of an FSDP-sharded one): the bits cross the process
    boundary without torch's shared memory."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone().numpy()


def _grads(engine) -> dict:
    return {name: _plain(p.grad) for name, p in engine.named_parameters() if p.grad is not None}


def deferred(rank: int, world: int, cases: list[tuple[str, str, str]], folder: str) -> dict:
    """For each (model, schedule, source): build the model on the meta device, let the engine fill this
    rank's pieces from ``source`` ("dict", "file", "dcp", "init+dict"), take one step; report the
    gradients, the loss and which pieces' tensors were allocated."""
    import torch
    import torch.nn.functional as F
    from hf_models import build_hf, hf_splits, lm_loss, tokens
    from models import SPLITS, batch, build

    from pipeloom.runtime import pipeline

    results = {}
    for model_name, schedule, source in cases:
        hf = model_name in ("gpt2", "llama")
        with torch.device("meta"):
            model = build_hf(model_name) if hf else build(model_name)
        reference = build_hf(model_name) if hf else build(model_name)
        sources = {"dict": reference.state_dict(), "file": f"{folder}/{model_name}.pt",
                   "dcp": f"{folder}/{model_name}-dcp", "init+dict": reference.state_dict()}
        inputs, target = tokens() if hf else batch(model_name)
        init = model._init_weights if source.startswith("init") else None
        tracing = Tracing(example_inputs=(inputs,)) if hf else None
        pieces = 2 * world if schedule in ("zbv", "interleaved-1f1b") else world
        splits = hf_splits(model_name, pieces) if hf else SPLITS[model_name][pieces]
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=splits,
            microbatches=4,
            loss_fn=lm_loss if hf else F.cross_entropy,
            tracing=tracing,
            weights=Weights(state_dict=sources[source], init_weights=init),
            failures=Failures(timeout=60),
        )
        loss = engine.step(inputs if hf else inputs[0], target=target)
        local = {engine.lowering.piece_of[s] for s in engine.local_stages}
        allocated = {k: [not t.is_meta for t in (*stage.parameters(), *stage.buffers())]
                     for k, stage in enumerate(engine.staged.stages)}
        results[(model_name, schedule, source)] = {
            "loss": _plain(loss), "grads": _grads(engine), "local": sorted(local),
            "allocated": {k: (all(flags), any(flags)) for k, flags in allocated.items()},
            "model_meta": sum(p.is_meta for p in model.parameters()),
        }
        engine.close()
    return results


def meshed(rank: int, world: int, cases: list[tuple[str, int]], steps: int, folder: str,
           data_parallel: str = "replicate") -> dict:
    """For each (schedule, pieces): a (dp 2, pp 2) mesh, ``steps`` SGD steps on the global batch; report
    each step's loss and gradients (by name), the clipped norm, the full state dict on the pipeline's
    first rank, and save a checkpoint after the last."""
    import torch
    import torch.nn.functional as F
    from models import SPLITS, batch, build
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    results = {}
    for schedule, pieces in cases:
        model = build("residual")
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=SPLITS["residual"][pieces],
            loss_fn=F.cross_entropy,
            microbatches=4,
            parallel=Parallelism(mesh=mesh, data_parallel=data_parallel),
            failures=Failures(timeout=60),
        )
        optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
        losses, grads = [], []
        for step in range(steps):
            inputs, target = batch("residual", rows=32, seed=step)
            losses.append(_plain(engine.step(inputs[0], target=target)))
            grads.append(_grads(engine))
            optimizer.step()
            optimizer.zero_grad()
        inputs, target = batch("residual", rows=32, seed=steps)
        engine.step(inputs[0], target=target)
        norm = engine.clip_grad_norm_(1e-3)
        clipped = _grads(engine)
        full = {key: _plain(value) for key, value in engine.full_state_dict().items()}
        engine.save_checkpoint(f"{folder}/{schedule}", optimizer=optimizer)
        results[schedule] = {"losses": losses, "grads": grads, "norm": _plain(norm), "clipped": clipped,
                             "params": {name: _plain(p) for name, p in engine.named_parameters()},
                             "pp": engine.rank, "dp": engine.dp.rank, "full": full}
        engine.close()
    return results


def replica_fault(rank: int, world: int, linger: float) -> dict:
    """On a (dp 2, pp 2) mesh, after a good first step, global rank 3 (stage 1 of replica 1) raises in
    its third forward of the second step; every rank reports what it saw and how long its failed step
    took, and keeps its process open for ``linger`` seconds (rank 0 hosts the store the failure board
    lives in, so it must not leave before the others have looked). Engines wait up to 60 s."""
    import time

    import torch.nn.functional as F
    from models import SPLITS, batch, build
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import PipelineError, pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    engine = pipeline(
        build("residual"),
        schedule="1f1b",
        split_points=SPLITS["residual"][2],
        loss_fn=F.cross_entropy,
        microbatches=4,
        parallel=Parallelism(mesh=mesh),
        failures=Failures(timeout=60),
    )
    inputs, target = batch("residual", rows=32)
    engine.step(inputs[0], target=target)
    if rank == 3:
        calls = [0]

        def hook(module, args) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("injected fault")

        for module in engine.modules.values():
            module.register_forward_pre_hook(hook)
    start = time.monotonic()
    message = None
    try:
        engine.step(inputs[0], target=target)
    except PipelineError as error:
        message = str(error)
    seconds = time.monotonic() - start
    time.sleep(linger)
    return {"message": message, "seconds": seconds}


def planned_mesh(rank: int, world: int, plan_path: str, record: str) -> dict:
    """A plan with two replicas of a 2-rank pipeline, run by ``pipeline(model, plan=...)`` with no mesh
    given (recording to ``record``), against the same settings on an explicit (dp 2, pp 2) mesh: each rank's
    gradients after one step, and its own trace."""
    import torch.nn.functional as F
    from models import SPLITS, batch, build
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    inputs, target = batch("residual", rows=32)
    planned = pipeline(build("residual"), plan=plan_path, loss_fn=F.cross_entropy, failures=Failures(timeout=60),
                       record=record)
    planned.step(inputs[0], target=target)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    explicit = pipeline(
        build("residual"),
        schedule="zb-h1",
        split_points=SPLITS["residual"][2],
        loss_fn=F.cross_entropy,
        microbatches=4,
        parallel=Parallelism(mesh=mesh),
        failures=Failures(timeout=60),
    )
    explicit.step(inputs[0], target=target)
    result = {"dp": (planned.dp.rank, planned.dp.size), "pp": planned.rank, "planned": _grads(planned),
              "explicit": _grads(explicit), "trace": planned.trace_document()}
    planned.close()
    explicit.close()
    return result


def planned_refusal(rank: int, world: int, plan_path: str) -> str:
    """``pipeline(model, plan=...)`` on ``world`` ranks: its refusal (``"built"`` if none)."""
    import torch.nn.functional as F
    from models import build

    from pipeloom.runtime import PipelineError, pipeline

    try:
        pipeline(build("residual"), plan=plan_path, loss_fn=F.cross_entropy, failures=Failures(timeout=60)).close()
    except PipelineError as error:
        return str(error)
    return "built"
