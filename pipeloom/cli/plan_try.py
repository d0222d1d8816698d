"""``pipeloom plan --try K``: run the K best predicted plans for a few steps in the engine on every rank of a
torchrun launch and keep the fastest measured (:func:`pipeloom.profile.trials.try_plans`); the model comes
from ``--build FILE.py:FUNCTION`` as ``pipeloom profile`` takes it, the loss from ``--loss NAME``."""

from __future__ import annotations

import argparse

from pipeloom.cli.argtypes import count, number
from pipeloom.cli.errors import UsageError
from pipeloom.plan.race import SPREAD, TrialBudget

__all__ = ["add_try_arguments", "budget", "check_try", "trial_lines", "try_in_engine"]


def add_try_arguments(plan: argparse.ArgumentParser) -> None:
    """``--try K`` and what it needs: ``--build``, ``--loss``, ``--arg``, ``--seq``, ``--try-steps``,
    ``--try-seconds``, ``--try-spread``."""
    default = TrialBudget()
    group = plan.add_argument_group("choosing by measurement (--try; run under torchrun, one process per rank)")
    group.add_argument("--try", dest="try_k", type=count, metavar="K",
                       help="run the K best predicted plans for a few steps in the engine on the ranks of this "
                            "launch and choose the fastest measured; the plan file keeps the measurements")
    group.add_argument("--build", metavar="FILE.py:FUNCTION",
                       help="with --try: the function that builds the model (and one step's inputs and target), "
                            "as `pipeloom profile` takes it; called again for each plan tried")
    group.add_argument("--loss", metavar="NAME", help="with --try: the loss function NAME(output, target) in FILE")
    group.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                       help="with --try: a keyword for FUNCTION (repeatable)")
    group.add_argument("--try-spread", type=number(float, "a fraction >= 0", 0.0), metavar="F",
                       help="with --try: a shape (micro-batches, stages per rank) whose best plan is predicted within "
                            "F of the best takes a trial slot ahead of better predicted plans of shapes already tried "
                            f"(default {SPREAD:g}, the planner's stated accuracy)")
    group.add_argument("--try-steps", type=count, metavar="N",
                       help="with --try: at most N timed steps per plan, in rounds of "
                            f"{default.round_steps} that interleave the plans, after {default.warmup} "
                            f"untimed ones (default {default.steps})")
    group.add_argument("--try-seconds", type=number(float, "a number of seconds > 0", 0.001),
                       metavar="S",
                       help="with --try: start no new round once the trial steps took S seconds (default "
                            f"{default.seconds:g}); a plan clearly slower than the leader leaves earlier")


def check_try(args: argparse.Namespace) -> None:
    """UsageError, before planning, when ``--try`` lacks what it needs or runs outside a launch."""
    import os

    flags = (("--build", args.build), ("--loss", args.loss), ("--try-steps", args.try_steps),
             ("--try-seconds", args.try_seconds), ("--try-spread", args.try_spread))
    given = [flag for flag, value in flags if value is not None]
    if args.try_k is None:
        if given:
            raise UsageError(f"{' and '.join(given)} go{'es' if len(given) == 1 else ''} with --try K (the plans to "
                             "run in the engine)")
        return
    if args.build is None or args.loss is None:
        raise UsageError("--try runs the plans in the engine: give --build FILE.py:FUNCTION and --loss NAME")
    if args.server is not None:
        raise UsageError("--try runs the plans here, on the ranks of this launch; leave out --server")
    import torch.distributed as dist

    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise UsageError(f"--try runs on every rank of a launch: torchrun --nproc-per-node {args.ranks} -m pipeloom "
                         "plan ... --try K")


def try_in_engine(args: argparse.Namespace, result):
    """``result`` with the fastest measured of its ``--try`` best plans (every rank calls this)."""
    import os

    import torch
    import torch.distributed as dist

    from pipeloom.cli.profile_user import (
        check_batch,
        load_function,
        loss_function,
        made_up_target,
        model_and_inputs,
        user_code,
    )
    from pipeloom.profile.trials import check_world, try_plans
    from pipeloom.runtime.options import Tracing

    module, function = load_function(args.build)
    request = argparse.Namespace(target=args.build, arg=args.arg, batch=args.global_batch, seq=args.seq, loss=args.loss,
                                 leaf_modules=None)  # profile's flags that made-up inputs read
    loss = loss_function(module, request)
    created = not dist.is_initialized()
    if created:
        check_world(result, int(os.environ["WORLD_SIZE"]))  # before the group: no rank left waiting in it
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same model and batch on every rank
        model, inputs, target = model_and_inputs(module, function, request)
        check_batch(inputs, args.global_batch, "--global-batch")
        if target is None:
            with user_code(args.build.rpartition(":")[0], "running the model to make up a target"):
                target = made_up_target(model, inputs, loss, args.loss)

        def build():
            torch.manual_seed(0)
            return model_and_inputs(module, function, request)[0]

        # the split settled at pipeline(): torch.fx first, torch.export on this batch where fx cannot trace
        tried = try_plans(result, build=build, inputs=inputs, target=target, loss_fn=loss, k=args.try_k,
                          spread=SPREAD if args.try_spread is None else args.try_spread, budget=budget(args),
                          tracing=Tracing(example_inputs=inputs))
        if dist.get_rank() != 0 and getattr(args, "outputs", None) is not None:
            args.outputs.discard()  # rank 0 writes the files; an empty one from here must not replace them
        return tried
    finally:
        if created:
            dist.destroy_process_group()


def budget(args: argparse.Namespace) -> TrialBudget:
    """The trial budget of ``--try-steps`` and ``--try-seconds``, the defaults where not given."""
    default = TrialBudget()
    return TrialBudget(steps=args.try_steps or default.steps,
                       seconds=default.seconds if args.try_seconds is None else args.try_seconds)


def trial_lines(plan) -> list[str]:
    """One line per plan tried: its label, predicted and measured step time (median of how many steps, in how
    many rounds), whether it left the race early, and which was chosen."""
    lines = []
    for k, trial in enumerate(plan.trials):
        if trial.get("measured") is None:
            measured = f"not run: {trial.get('error', '')}"
        else:
            measured = (f"measured {trial['measured']:#.4g} s (median of {len(trial.get('step_times', ()))} steps "
                        f"in {trial.get('rounds', 1)} rounds)")
        if "dropped_after" in trial:
            measured += f", dropped after round {trial['dropped_after']} as clearly slower"
        chosen = "  <- chosen" if k == 0 else ""
        lines.append(f"tried {trial['label']}: predicted {trial['predicted']:#.4g} s, {measured}{chosen}")
    return lines
