"""``pipeloom profile FILE.py:FUNCTION``: build a model with a user's function, measure its cost table
on this machine and save it (imports torch, only when the command runs).

FUNCTION convention: it is called with the ``--arg KEY=VALUE`` keywords and returns the model, or
``(model, inputs)``, or ``(model, inputs, target)``. The model may be its pieces as modules (an
``nn.ModuleList`` or a list: piece k takes piece k-1's output), for a model no tracer can cut. Without
inputs, FILE may define ``example_inputs(model, batch, seq)`` returning inputs or ``(inputs, target)``;
else inputs are made from the first module the model calls (without a torch.fx trace, its input
embeddings or its first embedding or linear module): token ids below ``num_embeddings`` for an
``nn.Embedding`` (``--seq`` needed), normal noise for an ``nn.Linear``.
"""

from __future__ import annotations

import argparse

from pipeloom.cli.argtypes import count, number, path_with
from pipeloom.cli.errors import UsageError
from pipeloom.cli.profile_engine import run_in_engine
from pipeloom.cli.profile_output import show
from pipeloom.cli.profile_user import (
    check_batch,
    load_function,
    loss_function,
    made_up_target,
    model_and_inputs,
    names,
    pieces,
    user_code,
)

__all__ = ["add_profile_parser", "cmd_profile"]


def add_profile_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``pipeloom profile``."""
    from pipeloom.cli.argtypes import bytes_argument

    profile = commands.add_parser(
        "profile", help="measure a model's cost table (needs torch)",
        description="Build a model with FILE.py:FUNCTION, time every piece's F, I and W and count its bytes "
                    "(see docs/plan.md for the FUNCTION convention).")
    profile.add_argument("target", metavar="FILE.py:FUNCTION", help="the function that builds the model")
    profile.add_argument("--batch", type=count, required=True, metavar="N", help="samples per micro-batch")
    profile.add_argument("--seq", type=count, metavar="S", help="tokens per sample, for made-up token inputs")
    profile.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                         help="keyword argument for FUNCTION (a Python literal, else a string); repeatable")
    profile.add_argument("--loss", metavar="NAME",
                         help="a function loss(output, target) in FILE, run in the last piece")
    profile.add_argument("--pieces", metavar="NAMES",
                         help="comma-separated module names in call order, each piece running from its module to "
                              "the next's, the first from the model's start (default: the top-level children, "
                              "ModuleLists expanded)")
    profile.add_argument("--tracer", choices=("auto", "fx", "export"), default="auto",
                         help="how the model is traced to cut it, as pipeline(tracer=...): torch.fx, torch.export "
                              "on the inputs, or auto (torch.fx, then torch.export; the default)")
    profile.add_argument("--leaf-modules", metavar="NAMES",
                         help="comma-separated module names kept whole (never cut inside), as "
                              "pipeline(leaf_modules=...)")
    profile.add_argument("--device", help="cpu, cuda, cuda:1... (default: cuda when available, else cpu)")
    profile.add_argument("--warmup", type=number(int, "an integer >= 0", 0), default=2, metavar="N",
                         help="untimed runs per piece (default 2)")
    profile.add_argument("--repeats", type=count, default=5, metavar="N", help="timed runs per piece (default 5)")
    profile.add_argument("--threads", type=count, metavar="N", help="torch CPU threads (default: torch's)")
    profile.add_argument("--optimizer-factor", type=number(float, "a number >= 0", 0), default=2.0,
                         metavar="X", help="optimizer-state bytes per parameter byte (default 2: Adam)")
    profile.add_argument("--latency", type=number(float, "a number of seconds >= 0", 0), default=0.0,
                         metavar="S", help="link latency between ranks in seconds (default 0)")
    profile.add_argument("--bandwidth", type=bytes_argument, metavar="SIZE",
                         help="link bytes per second between ranks, e.g. 10GB (default: unlimited)")
    profile.add_argument("--in-engine", action="store_true",
                         help="time the pieces inside the runtime on the ranks that will train (every rank of a "
                              "torchrun launch runs it; CPU ranks with gloo; rank 0 saves and prints); "
                              "--warmup and --repeats count profiling steps, and the latency (--latency is "
                              "not used), per-step, per-action and per-message costs, time spread, start skew and "
                              "replica link are fitted")
    profile.add_argument("--microbatches", type=count, default=4, metavar="M",
                         help="--in-engine: micro-batches per profiling step (default 4; the inputs hold "
                              "--batch x M samples)")
    profile.add_argument("--tp", type=count, default=1, metavar="N",
                         help="--in-engine: also profile the stages tensor-parallel on a (ranks/N, N) (\"pp\", \"tp\") "
                              "mesh, their collectives counted and timed, into the table's tensor field (needs "
                              "--tp-plan and --heads; default 1: no tensor parallelism)")
    profile.add_argument("--tp-plan", metavar="NAME",
                         help="--tp: a function NAME(model) in FILE returning torch's parallelize_module plan "
                              "({module name or pattern: ParallelStyle})")
    profile.add_argument("--heads", type=count, metavar="H",
                         help="--tp: attention heads per layer (the tensor-parallel sizes the planner tries divide it)")
    profile.add_argument("--save", type=path_with(".json"), help="write the cost table (pipeloom.costs/2)")
    profile.add_argument("--json", action="store_true", help="print the cost table's JSON instead of a table")
    profile.set_defaults(handler=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """``pipeloom profile``: build, profile, save, then print the cost table."""
    try:
        import torch
    except ImportError:
        raise UsageError("pipeloom profile needs torch; install it (pip install torch)") from None
    from pipeloom.plan.costs.parts import Link
    from pipeloom.profile.model import profile_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tp > 1 and not args.in_engine:
        raise UsageError("--tp profiles tensor-parallel stages inside the runtime; add --in-engine (under torchrun)")
    module, function = load_function(args.target)
    if args.in_engine:
        return run_in_engine(args, module, function)
    model, inputs, target = model_and_inputs(module, function, args)
    check_batch(inputs, args.batch, "--batch")
    loss = loss_function(module, args)
    file = args.target.rpartition(":")[0]
    if loss is not None and target is None:
        with user_code(file, "running the model to make up a target"):
            target = made_up_target(model, inputs, loss, args.loss)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with user_code(file, "profiling the model (its forward, backward and loss)"):
        table = profile_model(model, inputs, pieces=pieces(args), tracer=args.tracer,
                              leaf_modules=names(args.leaf_modules), device=device, warmup=args.warmup,
                              repeats=args.repeats, loss_fn=loss, target=target,
                              optimizer_factor=args.optimizer_factor,
                              link=Link(latency=args.latency, bandwidth=args.bandwidth))
    show(table, args)
    return 0
