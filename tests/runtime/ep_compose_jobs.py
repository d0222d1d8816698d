"""What each spawned rank runs in the tests of expert parallelism composed with FSDP: a tiny Qwen3-MoE on a mesh
with "ep" and data_parallel='fsdp' next to the same model on the mesh with "dp" in its place (the same replicas,
FSDP over all of them, no sharded experts)."""

from __future__ import annotations

import torch
from ep_jobs import build_moe, lm_loss, tokens

from pipeloom.runtime import Failures, Parallelism, Tracing

MESHES = {  # layout -> the mesh with "ep" (its reference: the same ranks with "ep" merged into "dp")
    "pp2_ep2": ((2, 2), ("pp", "ep")),
    "dp2_ep2": ((2, 1, 2), ("dp", "pp", "ep")),
    "dp2_pp2_ep2": ((2, 2, 2), ("dp", "pp", "ep")),
}


def _mesh(layout: str, reference: bool):
    """The layout's mesh, or its reference: every rank at its own "pp" coordinate and replica index, with
    "dp" in place of "ep" (dp × ep ranks in the order replica = dp index × ep + ep index)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if not reference:
        return mesh
    grid, kept = mesh.mesh, [n for n in names if n != "ep"]
    if "dp" in names:  # ep right after dp, then the two merged
        grid = grid.movedim(names.index("ep"), names.index("dp") + 1)
        grid = grid.reshape(*grid.shape[:names.index("dp")], -1, *grid.shape[names.index("dp") + 2:])
    else:
        kept = ["dp" if n == "ep" else n for n in names]
    return DeviceMesh("cpu", grid, mesh_dim_names=tuple(kept))


def _engine(layout: str, reference: bool, schedule: str):
    from pipeloom.runtime import pipeline

    mesh = _mesh(layout, reference)
    names = mesh.mesh_dim_names
    model = build_moe("qwen3_moe")
    common = dict(schedule=schedule, loss_fn=lm_loss, microbatches=2, failures=Failures(timeout=120),
                  parallel=Parallelism(mesh=mesh, data_parallel="fsdp"))
    if mesh.size(names.index("pp")) == 1:  # one stage: the model itself, its experts called as modules
        return pipeline(model, stages=[model], **common)
    x, _ = tokens()
    return pipeline(model, split_points=["model.layers.2"], **common,
                    tracing=Tracing(tracer="export", example_inputs=(x[:2],)))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _set_from(mine: dict, reference: dict) -> None:
    """Every parameter of ``mine`` set to the reference's (whole, then cut as each of mine is placed)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for key, p in mine.items():
            whole = _full(reference[key].detach())
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(whole)


def _train_beside(ours, theirs, mine: dict, reference: dict, steps: int) -> tuple[bool, float, set, list]:
    """``steps`` steps of both engines on the same batches: whether every loss is bitwise equal, the worst
    gradient difference relative to the reference's largest, the parameters without a gradient, the losses.
    After each step the reference takes an SGD step and ours is set to its weights."""
    equal, worst, missing, losses = True, 0.0, set(), []
    for step in range(steps):
        x, y = tokens(seed=step)
        a, b = ours.step(x, target=y), theirs.step(x, target=y)
        losses.append((float(a), float(b)))
        equal &= bool(torch.equal(a, b))
        for key in sorted(mine):
            p, q = mine[key], reference[key]
            if p.grad is None:
                missing.add(key)
                continue
            grad, expected = _full(p.grad), _full(q.grad)
            worst = max(worst, float((grad - expected).abs().max()) / (float(expected.abs().max()) or 1.0))
        with torch.no_grad():
            for q in reference.values():
                q -= 0.1 * q.grad
        _set_from(mine, reference)
        for p in (*mine.values(), *reference.values()):
            p.grad = None
    return equal, worst, missing, losses


def ep_fsdp(rank: int, world: int, layout: str, schedule: str, steps: int, folder: str) -> dict:
    """``steps`` SGD steps of the ep + FSDP run and its reference from the same parameters (each step starts both
    from the reference's): whether the losses are bitwise equal, the largest gradient difference relative to
    its tensor's largest entry, the parameters without a gradient, which parameters are experts and over which
    mesh dimensions; then clip_grad_norm_ on both, their full state dicts, and a checkpoint saved by the ep run
    loaded by the reference after it moved on."""
    from pipeloom.runtime.parallel.ep import is_expert

    ours, theirs = _engine(layout, False, schedule), _engine(layout, True, schedule)
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    equal, worst, missing, _ = _train_beside(ours, theirs, mine, reference, steps)
    x, y = tokens(seed=steps)
    ours.step(x, target=y)
    theirs.step(x, target=y)
    norms = (float(ours.clip_grad_norm_(1e-3)), float(theirs.clip_grad_norm_(1e-3)))
    full, expected = ours.full_state_dict(), theirs.full_state_dict()
    full_equal = full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full)
    ours.save_checkpoint(folder)
    saved = ours.full_state_dict()
    with torch.no_grad():
        for q in reference.values():
            q -= q.grad  # the reference moves away from the saved state
    theirs.load_checkpoint(folder)
    loaded = theirs.full_state_dict()
    restored = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    experts = {key: (list(p.device_mesh.mesh_dim_names or ()), list(p.to_local().shape))
               for key, p in mine.items() if is_expert(p)}
    dense = sorted({str(p.device_mesh.mesh_dim_names) for p in mine.values() if not is_expert(p)})
    ours.close()
    theirs.close()
    return {"losses_equal": equal, "worst": worst, "missing": sorted(missing), "experts": experts, "dense": dense,
            "params": len(mine), "norms": norms, "full_equal": full_equal, "restored": restored,
            "ranks": len(full)}


def _attention_and_dense_plan() -> dict:
    """torch's plan for Qwen2-MoE's attention (heads split over "tp"), its dense MLP (layer 0) and its shared
    experts (dense MLPs beside the routed experts of layers 1-3). (Qwen3's per-head q/k norms would be replicated
    parameters whose gradients each tp rank sums over its own heads only: no model for this test.)"""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    for mlp in ("model.layers.0.mlp", "model.layers.*.mlp.shared_expert"):
        plan.update({f"{mlp}.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
        plan[f"{mlp}.down_proj"] = RowwiseParallel()
    return plan


def _tp_engine(dim: str, plan: object):
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", dim, "tp"))
    model = build_moe("qwen2_moe", mlp_only_layers=[0])  # layer 0 a dense MLP, layers 1-3 MoE
    return pipeline(model, stages=[model], schedule="1f1b", loss_fn=lm_loss, microbatches=2,
                    failures=Failures(timeout=120), parallel=Parallelism(mesh=mesh, tp_plan=plan))


def ep_tp(rank: int, world: int, steps: int) -> dict:
    """pp 1 × ep 2 × tp 2 next to pp 1 × dp 2 × tp 2, attention and the dense MLP tensor-parallel: ``steps`` SGD
    steps from the same parameters as in :func:`ep_fsdp` (each step's pair of losses, whether all were bitwise
    equal, the worst relative gradient difference, the parameters without a gradient, each DTensor parameter's
    mesh dimensions); clip_grad_norm_ and the full state dicts after one more step; then what pipeline() says
    to a plan that shards the experts, to SequenceParallel and to tp_plan='auto' with "ep"."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    from pipeloom.runtime import PipelineError
    from pipeloom.runtime.parallel.ep import is_expert

    plan = _attention_and_dense_plan()
    ours, theirs = _tp_engine("ep", plan), _tp_engine("dp", plan)
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    equal, worst, missing, losses = _train_beside(ours, theirs, mine, reference, steps)
    placed = {key: list(p.device_mesh.mesh_dim_names or ()) for key, p in mine.items() if hasattr(p, "device_mesh")}
    experts = sum(1 for p in mine.values() if is_expert(p))
    x, y = tokens(seed=steps)
    ours.step(x, target=y)
    theirs.step(x, target=y)
    norms = (float(ours.clip_grad_norm_(1e-3)), float(theirs.clip_grad_norm_(1e-3)))
    full, expected = ours.full_state_dict(), theirs.full_state_dict()
    full_equal = full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full)
    ours.close()
    theirs.close()
    refused = {}
    for case, bad in {"experts": {**plan, "model.layers.*.mlp.experts": ColwiseParallel()},
                      "sp": {**plan, "model.layers.*.input_layernorm": SequenceParallel()}, "auto": "auto"}.items():
        try:
            _tp_engine("ep", bad).close()
            refused[case] = "no error"
        except PipelineError as error:
            refused[case] = str(error)
    return {"losses_equal": equal, "worst": worst, "missing": sorted(missing), "placed": placed, "losses": losses,
            "experts": experts, "refused": refused, "norms": norms, "full_equal": full_equal, "keys": len(full)}
