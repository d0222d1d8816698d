"""``pipeloom profile --in-engine`` (and ``--tp N``): every rank of a torchrun launch profiles inside the
runtime (:func:`pipeloom.profile.in_engine.profile_in_engine`), tensor-parallel stages on a ``("pp", "tp")`` mesh."""

from __future__ import annotations

import argparse

from pipeloom.cli.errors import UsageError
from pipeloom.cli.outputs import report_console
from pipeloom.cli.profile_output import print_tensor, show
from pipeloom.cli.profile_user import (
    check_batch,
    loss_function,
    made_up_target,
    model_and_inputs,
    names,
    pieces,
    user_code,
)

__all__ = ["run_in_engine"]


def run_in_engine(args: argparse.Namespace, module, function) -> int:
    """``--in-engine``: every rank profiles inside the runtime (pipeloom.profile.in_engine.profile_in_engine)."""
    import dataclasses
    import os

    import torch
    import torch.distributed as dist

    from pipeloom.profile.in_engine import profile_in_engine

    if args.device not in (None, "cpu"):
        raise UsageError(f"--in-engine profiles CPU ranks with gloo, not --device {args.device}; on a GPU, "
                         f"profile one rank without --in-engine")
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise UsageError("--in-engine runs on every rank of a launch: torchrun --nproc-per-node 2 -m pipeloom "
                         "profile FILE.py:FUNCTION ... --in-engine")
    loss = loss_function(module, args)
    if loss is None:
        raise UsageError("--in-engine runs training steps; name the loss with --loss NAME")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same model and made-up batch on every rank
        samples = args.batch * args.microbatches
        model, inputs, target = model_and_inputs(module, function, argparse.Namespace(**{**vars(args),
                                                                                          "batch": samples}))
        check_batch(inputs, samples, "--batch x --microbatches")
        if target is None:
            with user_code(args.target.rpartition(":")[0], "running the model to make up a target"):
                target = made_up_target(model, inputs, loss, args.loss)
        table = profile_in_engine(model, inputs, loss_fn=loss, target=target, microbatches=args.microbatches,
                                  pieces=pieces(args), warmup_steps=args.warmup, steps=args.repeats,
                                  bandwidth=args.bandwidth, tracer=args.tracer,
                                  leaf_modules=names(args.leaf_modules), **_tensor_parallel(args, module, model))
        table = dataclasses.replace(table, optimizer_factor=args.optimizer_factor)
        if dist.get_rank() != 0 and getattr(args, "outputs", None) is not None:
            args.outputs.discard()  # rank 0 writes the files; an empty one from here must not replace them
        if dist.get_rank() == 0:
            show(table, args)
            fitted = table.runtime
            exchange = ("none (odd ranks or micro-batches, parameters shared across ranks, or running statistics "
                        "two replicas would update apart)"
                        if fitted.replica_link is None else f"{fitted.replica_link.latency * 1e3:.2f} ms per message")
            report_console(stderr=args.json).print(
                f"fitted: latency under load {table.link.latency * 1e3:.2f} ms, per step "
                f"{fitted.step_overhead * 1e3:.2f} ms, per action {fitted.action_overhead * 1e6:.0f} us, per message "
                f"{fitted.message_cost * 1e6:.0f} us, time spread "
                f"{fitted.time_spread:.2f}, start skew {fitted.start_skew * 1e3:.2f} ms, replica exchange {exchange}",
                markup=False, soft_wrap=True)
            if table.tensor is not None:
                print_tensor(table, report_console(stderr=args.json))
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def _tensor_parallel(args: argparse.Namespace, module, model) -> dict:
    """``profile_in_engine``'s mesh, tp_plan and heads for ``--tp N`` (none for 1): a ``("pp", "tp")`` mesh
    of every rank and the plan FILE's ``--tp-plan`` function returns for ``model``."""
    if args.tp == 1:
        if args.tp_plan is not None or args.heads is not None:
            raise UsageError("--tp-plan and --heads go with --tp N (N >= 2), the tensor-parallel size to profile")
        return {}
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % args.tp or world == args.tp:
        raise UsageError(f"--tp {args.tp} must divide the {world} ranks and leave at least 2 pipeline ranks "
                         f"(the tp-1 profile needs one piece per rank either way)")
    if args.tp_plan is None or args.heads is None:
        raise UsageError("--tp needs --tp-plan NAME (a function NAME(model) in FILE returning torch's "
                         "parallelize_module plan) and --heads H")
    make = getattr(module, args.tp_plan, None)
    if not callable(make):
        raise UsageError(f"--tp-plan {args.tp_plan!r}: {args.target.rpartition(':')[0]} defines no such function")
    with user_code(args.target.rpartition(":")[0], f"calling {args.tp_plan}(model)"):
        plan = make(model)
    if not isinstance(plan, dict) or not plan:
        raise UsageError(f"--tp-plan {args.tp_plan!r} returned {type(plan).__name__}; return torch's "
                         "parallelize_module plan, a dict {module name or pattern: ParallelStyle}")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("pp", "tp"))
    return {"mesh": mesh, "tp_plan": plan, "heads": args.heads}
