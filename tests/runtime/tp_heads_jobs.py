"""What each spawned rank runs in the per-head norm tests (tests/runtime/test_tp_heads.py): tiny random-init
Qwen3 (float64; per-head ``q_norm``/``k_norm``) with its heads split over "tp" by ``tp_plan="hf"``, by a dict
plan naming the norms, by a saved recipe's ``head_norm`` and by the search; the single-device reference; the plan
that leaves the norms plain, refused by message; ``tp_plan="auto"`` made to shard attention (importable by
the child processes)."""

from __future__ import annotations

import torch
from tp_jobs import _local, _train, rank0

from pipeloom.runtime import Failures, Parallelism, Tracing

MICROBATCHES = 2
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
RECIPE = {"recipe": "megatron", "column": [f"model.layers.*.{n}" for n in COLUMN],
          "row": [f"model.layers.*.{n}" for n in ROW], "head_norm": [f"model.layers.*.{n}" for n in HEAD_NORMS]}



def hand_plan(*, norms: bool) -> dict:
    """torch's Megatron plan for Qwen3 written by hand; ``norms``: with q_norm/k_norm as torch's
    ``SequenceParallel(sequence_dim=-2, use_local_output=True)`` (the fix the refusal names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict = {f"model.layers.*.{n}": ColwiseParallel() for n in COLUMN}
    plan.update({f"model.layers.*.{n}": RowwiseParallel() for n in ROW})
    if norms:
        plan.update({f"model.layers.*.{n}": SequenceParallel(sequence_dim=-2, use_local_output=True)
                     for n in HEAD_NORMS})
    return plan


def _plan(case: str, mesh, x: torch.Tensor) -> object:
    """The plan of ``case``; ``auto``: the search under 0.6 of the memory of replicating everything (which
    makes it shard attention, test_tp_auto.py's bound)."""
    from hf_models import build_hf

    from pipeloom.runtime.parallel.tp import recipe_styles
    from pipeloom.runtime.parallel.tp_auto import AutoPlan, auto_tp_plan

    if case == "auto":
        free = auto_tp_plan(build_hf("qwen3").double(), mesh, microbatches=MICROBATCHES, example_inputs=(x,))
        return AutoPlan(memory_limit=0.6 * free.predicted_memory, seq=x.shape[1],
                        microbatch_size=x.shape[0] // MICROBATCHES)
    return {"hf": "hf", "dict": hand_plan(norms=True), "recipe": recipe_styles(RECIPE)}[case]


def _one_device(steps: int) -> list[dict]:
    """The same micro-batch loop on the whole model: each step's gradients by name."""
    from hf_models import accumulated_step, build_hf, tokens

    model = build_hf("qwen3").double()
    x, y = tokens()

    return _train(model, model.named_parameters, steps,
                  lambda *_: accumulated_step(model, x, y, MICROBATCHES))["full"]


def _refusal(mesh) -> str:
    """pipeline() with the hand plan that splits the heads and leaves q_norm/k_norm plain: the message."""
    from hf_models import build_hf, lm_loss

    from pipeloom.runtime import pipeline

    model = build_hf("qwen3").double()
    try:
        pipeline(model, stages=[model], schedule="1f1b", microbatches=MICROBATCHES, loss_fn=lm_loss,
                 parallel=Parallelism(mesh=mesh, tp_plan=hand_plan(norms=False)), failures=Failures(timeout=60))
    except Exception as error:  # noqa: BLE001 (the test reads the message)
        return f"{type(error).__name__}: {error}"
    return "built"


def qwen3_job(rank: int, world: int, pp: int, cases: list[str], steps: int) -> dict:
    """pp x tp 2 (``world`` = 2 pp): ``steps`` SGD steps of the engine per plan case (pp 1: the model as one
    stage; pp 2: pipeloom's split at ``model.layers.2``, torch.export keeping the blocks whole); rank 0 also
    the single-device reference; pp 1 also the refusal of the plan without the norms."""
    from hf_models import build_hf, hf_splits, lm_loss, tokens
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "tp"))
    x, y = tokens()
    out: dict = {"coordinates": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))}
    for case in cases:
        model = build_hf("qwen3").double()
        where = (dict(stages=[model]) if pp == 1 else
                 dict(split_points=hf_splits("qwen3", pp), tracing=Tracing(example_inputs=(x[:4],))))
        engine = pipeline(model, schedule="1f1b", microbatches=MICROBATCHES, loss_fn=lm_loss,
                          parallel=Parallelism(mesh=mesh, tp_plan=_plan(case, mesh, x)),
                          failures=Failures(timeout=60), **where)
        out[case] = _train(engine, engine.named_parameters, steps,
                           lambda *_, engine=engine: engine.step(x, target=y))
        norms = {n: p for n, p in engine.named_parameters() if n.rsplit(".", 2)[-2] in ("q_norm", "k_norm")}
        out[case]["norm_params"] = {n: _local(p) for n, p in norms.items()}  # after the steps' updates
        out[case]["norm_grads"] = sorted({str(getattr(p.grad, "placements", "plain")) for p in norms.values()})
        if engine.tp_sharding is not None:  # tp_plan="auto": what the search chose
            out[case]["choice"] = engine.tp_sharding.result.choice
            out[case]["head_norm"] = (engine.tp_sharding.result.recipe or {}).get("head_norm")
        engine.close()
    if pp == 1:
        out["refused"] = _refusal(mesh)
    if rank0():
        out["one_device"] = _one_device(steps)
    return out


def planned_tp_job(rank: int, world: int, name: str, plan_path: str, steps: int) -> dict:
    """``name``'s tiny model (float64) trained from a saved cluster plan with tp 2 (``pipeline(model, plan=...)``:
    the recipe the planner wrote, head norms included where the family has them) for ``steps`` SGD steps; rank 0
    also the single-device reference of the plan's micro-batches."""
    from hf_models import accumulated_step, build_hf, lm_loss, tokens

    from pipeloom.plan.plan import load_plan
    from pipeloom.runtime import pipeline

    x, y = tokens()
    model = build_hf(name).double()
    engine = pipeline(model, plan=plan_path, loss_fn=lm_loss, failures=Failures(timeout=60),
                      tracing=Tracing(example_inputs=(x[:4],)))
    out: dict = {"run": _train(engine, engine.named_parameters, steps, lambda *_: engine.step(x, target=y))}
    engine.close()
    if rank0():
        reference = build_hf(name).double()
        microbatches = load_plan(plan_path).microbatches
        out["one_device"] = _train(reference, reference.named_parameters, steps,
                                   lambda *_: accumulated_step(reference, x, y, microbatches))["full"]
    return out
