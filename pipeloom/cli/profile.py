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
import ast
import contextlib
import importlib.util
import inspect
import io
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from pipeloom.cli.argtypes import count, number, path_with
from pipeloom.cli.common import UsageError
from pipeloom.cli.outputs import target
from pipeloom.errors import PipeloomError

__all__ = ["UserCodeError", "add_profile_parser", "cmd_profile", "load_function"]


class UserCodeError(PipeloomError):
    """The user's file raised while pipeloom ran it (importing it, building the model, making inputs,
    the forward or the loss). The first line names the file, the line and the error; the rest of
    the message is the traceback (shown with --verbose)."""


@contextlib.contextmanager
def user_code(path: str, doing: str) -> Iterator[None]:
    """Turn an exception raised by the user's code while ``doing`` into one :class:`UserCodeError`
    line naming ``path`` (and its line where the traceback passes through it). pipeloom's own
    errors pass through unchanged. What the code prints to stderr meanwhile (torch.fx prints its
    own traceback of a failing generated forward) is kept for the verbose part."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except (PipeloomError, KeyboardInterrupt) as error:
        cause = error.__cause__
        if isinstance(cause, Exception) and not isinstance(cause, PipeloomError):  # the user's model failed
            raise _user_error(path, cause, doing, printed, text=str(error)) from error
        sys.stderr.write(printed.getvalue())
        raise
    except Exception as error:  # noqa: BLE001 (any exception of the user's code is reported, not ours)
        raise _user_error(path, error, doing, printed) from error


def _lines_in(path: str, error: BaseException | None) -> list[int]:
    """The lines of ``path`` that ``error``'s traceback passes through."""
    if not isinstance(error, Exception) or isinstance(error, PipeloomError):
        return []
    where = Path(path).resolve()
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if frame.lineno is not None and Path(frame.filename).resolve() == where]
    if isinstance(error, SyntaxError) and error.lineno is not None:
        lines.append(error.lineno)
    return lines


def _user_error(path: str, error: BaseException, doing: str, printed: io.StringIO, *,
                text: str | None = None) -> UserCodeError:
    """One :class:`UserCodeError` line naming ``path`` (and its line) for ``error`` (or ``text``, pipeloom's
    own account of it, which names the fix), the traceback for ``--verbose``."""
    lines = _lines_in(path, error)
    place = f"{path}:{lines[-1]}" if lines else path
    if text is None:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        what = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
        text = f"{what} (while {doing}; fix it in your file)"
    else:
        text = f"{text} (while {doing})"
    trace = printed.getvalue() + "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return UserCodeError(f"{place}: {text}\n{trace}")


def add_profile_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``pipeloom profile``."""
    from pipeloom.cli.plan import bytes_argument

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
                         help="comma-separated module names in call order (default: the top-level children, "
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


def load_function(target: str):
    """``(module, function)`` for ``FILE.py:FUNCTION``; UsageError naming what is wrong."""
    path_text, _, name = target.rpartition(":")
    if not path_text or not name:
        raise UsageError(f"{target!r}: write FILE.py:FUNCTION, e.g. examples/train_gpt.py:build_model")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"{target!r}: no file {path_text!r}")
    spec = importlib.util.spec_from_file_location(f"pipeloom_profiled_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{target!r}: {path_text!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        with user_code(path_text, f"importing {path_text}"):
            spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"{target!r}: {path_text} defines no function {name!r}")
    return module, function


def _keywords(pairs: list[str]) -> dict:
    keywords = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--arg {pair!r}: write KEY=VALUE, e.g. --arg layers=8")
        try:
            keywords[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            keywords[key] = text
    return keywords


def _first_module(model, args: argparse.Namespace):
    """``(name, module)`` of the first module the model calls: from a torch.fx trace as the runtime makes
    it; where torch.fx cannot trace the model, its input embeddings (Hugging Face's
    ``get_input_embeddings``) or else its first embedding or linear module."""
    from torch import nn

    from pipeloom.runtime import ModelTraceError
    from pipeloom.runtime.tracing import trace_model

    if isinstance(model, (list, tuple, nn.ModuleList)):  # pieces given as modules: the first one starts
        return _first_module(model[0], args)
    try:
        traced = trace_model(model, tracer="fx", leaf_modules=_names(args.leaf_modules) or ())
    except ModelTraceError:
        embeddings = getattr(model, "get_input_embeddings", None)
        found = embeddings() if callable(embeddings) else None
        if isinstance(found, nn.Module):
            return next((n for n, m in model.named_modules() if m is found), "input embeddings"), found
        return next(((n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.Linear))),
                    ("", model))
    first = next((str(node.target) for node in traced.graph.nodes if node.op == "call_module"), None)
    return (first, model.get_submodule(first)) if first is not None else ("", model)


def _made_up_inputs(model, args: argparse.Namespace):
    """Inputs for the first module the model calls: token ids (Embedding) or noise (Linear)."""
    import torch
    from torch import nn

    first, module = _first_module(model, args)
    if isinstance(module, nn.Embedding):
        if args.seq is None:
            raise UsageError(f"the model starts with an embedding ({first}); give --seq S for its token inputs")
        return torch.randint(module.num_embeddings, (args.batch, args.seq))
    if isinstance(module, nn.Linear):
        shape = (args.batch,) + ((args.seq,) if args.seq else ()) + (module.in_features,)
        return torch.randn(shape)
    raise UsageError(f"cannot make inputs for a model starting with {type(module).__name__}; return (model, "
                     f"inputs) from the function, or define example_inputs(model, batch, seq) in the file")


def _model_and_inputs(module, function, args: argparse.Namespace):
    """``(model, inputs, target)`` by the convention of this module's docstring."""
    keywords = _keywords(args.arg)
    signature = inspect.signature(function)
    try:
        signature.bind(**keywords)
    except TypeError as error:
        parameters = signature.parameters
        unknown = sorted(set(keywords) - set(parameters)) or sorted(keywords)
        takes = ", ".join(parameters) or "nothing"
        raise UsageError(f"{args.target} cannot take {unknown} ({error}); it takes: {takes}") from None
    file = args.target.rpartition(":")[0]
    with user_code(file, f"calling {args.target}"):
        built = function(**keywords)
    parts = built if isinstance(built, tuple) else (built,)
    if not parts or not _is_model(parts[0]) or len(parts) > 3:
        raise UsageError(f"{args.target} must return a model (or its pieces as a list of modules), (model, inputs) "
                         f"or (model, inputs, target); got {type(built).__name__}")
    model, inputs, target = (list(parts) + [None, None])[:3]
    if inputs is None:
        maker = getattr(module, "example_inputs", None)
        if callable(maker):
            with user_code(file, "calling example_inputs"):
                made = maker(model, batch=args.batch, seq=args.seq)
            inputs, target = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        else:
            with user_code(file, "tracing the model to make up inputs"):
                inputs = _made_up_inputs(model, args)
    return model, inputs, target


def _is_model(value) -> bool:
    """A module, or pieces given as a non-empty list of modules."""
    from torch import nn

    if isinstance(value, list):
        return bool(value) and all(isinstance(m, nn.Module) for m in value)
    return isinstance(value, nn.Module)


def _loss(module, args: argparse.Namespace):
    if args.loss is None:
        return None
    loss = getattr(module, args.loss, None)
    if not callable(loss):
        raise UsageError(f"--loss {args.loss!r}: {args.target.rpartition(':')[0]} defines no such function")
    return loss


def _made_up_target(model, inputs):
    """Class targets for the model's output (its first tensor: a Hugging Face output's logits): integers
    below its last dimension, one per other position."""
    import torch
    import torch.utils._pytree as pytree
    from torch import nn

    with torch.no_grad():
        if isinstance(model, (list, nn.ModuleList)):  # pieces as modules: each takes the one before's output
            out = model[0](*(inputs if isinstance(inputs, tuple) else (inputs,)))
            for piece in model[1:]:
                out = piece(out)
        else:
            out = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise UsageError("cannot make up a target: the model's output holds no tensor with a class dimension; "
                         "return (model, inputs, target) from the function")
    return torch.randint(first.size(-1), first.shape[:-1])


def _pieces_table(table):
    from rich.table import Table

    from pipeloom.plan.costs import format_bytes

    view = Table(title=f"cost table: {table.device}, micro-batch of {table.microbatch_size}")
    view.add_column("piece", min_width=max(len(name) for name in table.names))
    for column in ("F (ms)", "I (ms)", "W (ms)", "saved", "params", "output"):
        view.add_column(column, justify="right", no_wrap=True)
    if not table.is_chain:  # say which pieces each one reads, when it is not simply the one before
        view.add_column("reads", overflow="fold")
    for piece in table.pieces:
        reads = [", ".join(piece.inputs or ()) or "(inputs)"] if not table.is_chain else []
        view.add_row(piece.name, f"{piece.f * 1e3:.3f}", f"{piece.i * 1e3:.3f}", f"{piece.w * 1e3:.3f}",
                     format_bytes(piece.activation_bytes), format_bytes(piece.param_bytes),
                     format_bytes(piece.output_bytes), *reads)
    return view


def _print_shared(table, console: Console) -> None:
    """One line per parameter several pieces use (counted once, in its first user's params)."""
    from pipeloom.plan.costs import format_bytes

    for entry in table.shared:
        console.print(f"shared: {entry.name or 'a parameter'} ({format_bytes(entry.bytes)}, counted once) used by "
                      f"{', '.join(entry.pieces)}", markup=False, soft_wrap=True)


def cmd_profile(args: argparse.Namespace) -> int:
    """``pipeloom profile``: build, profile, save, then print the cost table."""
    try:
        import torch
    except ImportError:
        raise UsageError("pipeloom profile needs torch; install it (pip install torch)") from None
    from pipeloom.plan.costs import Link
    from pipeloom.plan.profile import profile_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tp > 1 and not args.in_engine:
        raise UsageError("--tp profiles tensor-parallel stages inside the runtime; add --in-engine (under torchrun)")
    module, function = load_function(args.target)
    if args.in_engine:
        return _profile_in_engine(args, module, function)
    model, inputs, target = _model_and_inputs(module, function, args)
    _check_batch(inputs, args.batch, "--batch")
    loss = _loss(module, args)
    file = args.target.rpartition(":")[0]
    if loss is not None and target is None:
        with user_code(file, "running the model to make up a target"):
            target = _made_up_target(model, inputs)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with user_code(file, "profiling the model (its forward, backward and loss)"):
        table = profile_model(model, inputs, pieces=_pieces(args), tracer=args.tracer,
                              leaf_modules=_names(args.leaf_modules), device=device, warmup=args.warmup,
                              repeats=args.repeats, loss_fn=loss, target=target,
                              optimizer_factor=args.optimizer_factor,
                              link=Link(latency=args.latency, bandwidth=args.bandwidth))
    _show(table, args)
    return 0


def _names(text: str | None) -> list[str]:
    """``a,b,c`` as names (none for None)."""
    return [name.strip() for name in text.split(",") if name.strip()] if text else []


def _pieces(args: argparse.Namespace) -> list[str] | None:
    """``--pieces a,b,c`` as names (None: the profiler's default pieces)."""
    return _names(args.pieces) or None


def _check_batch(inputs, samples: int, what: str) -> None:
    import torch

    first = next((t for t in (inputs if isinstance(inputs, tuple) else (inputs,))
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None or first.size(0) != samples:
        held = "no tensor" if first is None else f"{first.size(0)} samples"
        raise UsageError(f"the inputs hold {held} but {what} is {samples}; make the function's inputs match {what}")


def _show(table, args: argparse.Namespace) -> None:
    from pipeloom.plan.costs import costs_to_json, save_costs

    if args.save:
        save_costs(table, target(args, args.save))
    console = Console(stderr=args.json, highlight=False)
    if args.json:
        print(costs_to_json(table, indent=None))
    else:
        console.print(_pieces_table(table))
        _print_shared(table, console)
    if args.save:
        console.print(f"wrote cost table {args.save}", markup=False, soft_wrap=True)


def _profile_in_engine(args: argparse.Namespace, module, function) -> int:
    """``--in-engine``: every rank profiles inside the runtime (pipeloom.plan.profile_in_engine)."""
    import dataclasses
    import os

    import torch
    import torch.distributed as dist

    from pipeloom.plan.inplace import profile_in_engine

    if args.device not in (None, "cpu"):
        raise UsageError(f"--in-engine profiles CPU ranks with gloo, not --device {args.device}; on a GPU, "
                         f"profile one rank without --in-engine")
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise UsageError("--in-engine runs on every rank of a launch: torchrun --nproc-per-node 2 -m pipeloom "
                         "profile FILE.py:FUNCTION ... --in-engine")
    loss = _loss(module, args)
    if loss is None:
        raise UsageError("--in-engine runs training steps; name the loss with --loss NAME")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same model and made-up batch on every rank
        samples = args.batch * args.microbatches
        model, inputs, target = _model_and_inputs(module, function, argparse.Namespace(**{**vars(args),
                                                                                          "batch": samples}))
        _check_batch(inputs, samples, "--batch x --microbatches")
        if target is None:
            with user_code(args.target.rpartition(":")[0], "running the model to make up a target"):
                target = _made_up_target(model, inputs)
        table = profile_in_engine(model, inputs, loss_fn=loss, target=target, microbatches=args.microbatches,
                                  pieces=_pieces(args), warmup_steps=args.warmup, steps=args.repeats,
                                  bandwidth=args.bandwidth, tracer=args.tracer,
                                  leaf_modules=_names(args.leaf_modules), **_tensor_parallel(args, module, model))
        table = dataclasses.replace(table, optimizer_factor=args.optimizer_factor)
        if dist.get_rank() != 0 and getattr(args, "outputs", None) is not None:
            args.outputs.discard()  # rank 0 writes the files; an empty one from here must not replace them
        if dist.get_rank() == 0:
            _show(table, args)
            exchange = ("none (odd ranks or micro-batches, or parameters shared across ranks)"
                        if table.replica_link is None else f"{table.replica_link.latency * 1e3:.2f} ms per message")
            Console(stderr=args.json, highlight=False).print(
                f"fitted: latency under load {table.link.latency * 1e3:.2f} ms, per step "
                f"{table.step_overhead * 1e3:.2f} ms, per action {table.action_overhead * 1e6:.0f} us, per message "
                f"{table.message_cost * 1e6:.0f} us, time spread "
                f"{table.time_spread:.2f}, start skew {table.start_skew * 1e3:.2f} ms, replica exchange {exchange}",
                markup=False, soft_wrap=True)
            if table.tensor is not None:
                _print_tensor(table, Console(stderr=args.json, highlight=False))
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


def _print_tensor(table, console: Console) -> None:
    """What the tensor-parallel profile measured: per size, the layer pieces' times and collectives; the fit."""
    info = table.tensor
    for profile in info.profiles:
        layers = [p for p in profile.pieces if p.name in info.layers]
        counted = sorted({f"{c.kind} {c.phase}" for p in layers for c in p.collectives})
        per_layer = {text: sum(f"{c.kind} {c.phase}" == text for c in layers[0].collectives) for text in counted} \
            if layers else {}
        console.print(f"tensor parallel (tp {profile.size}, measured): layers {', '.join(info.layers)}; per layer "
                      f"and micro-batch {', '.join(f'{n} {t}' for t, n in per_layer.items()) or 'no collective'}; "
                      f"F+B of the layers {sum(p.f + (p.full_backward or p.i + p.w) for p in layers) * 1e3:.2f} ms "
                      f"(tp 1: {sum(p.f + p.full_backward for p in table.pieces if p.name in info.layers) * 1e3:.2f} "
                      f"ms)", markup=False, soft_wrap=True)
    for kind, overhead in info.fit.overhead.items():
        bandwidth = info.fit.bandwidth.get(kind)
        console.print(f"fitted {kind}: {overhead * 1e6:.0f} us per collective, "
                      f"{'unlimited' if bandwidth is None else f'{bandwidth / 1e6:.1f} MB/s'}",
                      markup=False, soft_wrap=True)
