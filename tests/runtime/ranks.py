"""Run a function on several gloo ranks (processes of their own) and collect what each returns.

The ranks are forked from one fork server per test process that imported torch, pipeloom's runtime, the
transformers models the tests build and the rank jobs once (``PRELOAD``), not spawned: a spawned rank spends
seconds importing torch (12-15 s for two ranks on the loaded 2-core machine, against 0.4 s forked), and the
multi-rank tests start ranks a few hundred times. Every test uses the same list, so the server starts once per
test process (a few seconds of CPU) instead of again wherever two tests wanted different lists. Each test
still gets fresh processes; only the imports are shared.

Inside one rank, a model torch.export has already traced is not traced again (``_remember_exports``): tests
that build several engines of the same model on every rank (one per schedule, the engine under test beside its
reference) trace it once per rank instead of once per engine. ``PIPELOOM_TEST_EXPORT_MEMO=0`` traces every time."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path

_HF_MODELS = ["llama", "gpt2", "bert", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "mamba2",
              "t5", "bart", "whisper", "convnext"]
_JOBS = ["ranks", "hf_models", *sorted(path.stem for path in Path(__file__).parent.glob("*_jobs.py"))]
"""The modules whose functions the ranks run: this one, the model builders, and every ``*_jobs.py`` beside it."""
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.checkpoint", "torch.distributed.device_mesh", "pipeloom.runtime",
           "pipeloom.runtime.parallel.tp_auto", "pipeloom.plan.tp.sharding", "pipeloom.profile.in_engine",
           "transformers",
           *(f"transformers.models.{name}.modeling_{name}" for name in _HF_MODELS), *_JOBS]
"""Imported once by the fork server (a module that cannot be imported is skipped: transformers is optional)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_TAKEN = "port taken"
"""What a rank 0 reports when another process took the free port between :func:`free_port` and its bind."""


def _worker(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("PIPELOOM_TEST_EXPORT_MEMO") != "0":
        _remember_exports()
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        except Exception as error:
            if "EADDRINUSE" in str(error):  # the launch is retried on another port
                queue.put((rank, PORT_TAKEN, str(error)))
                return
            raise
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as error:  # noqa: BLE001 (report everything; the parent decides)
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a failed peer may have broken the group already
                dist.destroy_process_group()


def _remember_exports() -> None:
    """Make this process's torch.export of a model (pipeloom's ``tracing._exported``) return the program it
    returned before for a model of the same kind (``_model_key``: the same modules with the same attributes,
    parameter and buffer names, shapes and dtypes, example input shapes, and kept modules). torch.export traces
    with fake tensors, so the values of the tensors do not enter the graph; pipeloom builds its own graph from
    the program for each engine, bound to that engine's model's tensors, and never changes the program. A trace
    that fails is not remembered."""
    from pipeloom.runtime.model import tracing

    original = tracing._exported
    programs: dict[str, object] = {}

    def exported(model, example_inputs, keep=()):
        key = _model_key(model, example_inputs, keep)
        if key not in programs:
            programs[key] = original(model, example_inputs, keep)
        return programs[key]

    tracing._exported = exported


def _model_key(model, example_inputs, keep) -> str:
    """Every module's name, class and own attributes (config, training flag, hooks, a forward set on the object:
    functions by identity) but its parameters, buffers and children, which come next by name, shape, dtype,
    device and ``requires_grad``; the example inputs and the kept modules. A transformers config counts with all
    its fields, the private ones its ``repr`` leaves out (``_experts_implementation_internal``) included."""
    import torch
    import torch.utils._pytree as pytree

    def tensors(named):
        return [(name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in named]

    own = ("_parameters", "_buffers", "_modules")
    modules = [(name, type(m).__module__, type(m).__qualname__,
                sorted((k, _described(v)) for k, v in vars(m).items() if k not in own))
               for name, m in model.named_modules(remove_duplicate=False)]
    inputs = [(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else repr(t)
              for t in pytree.tree_leaves(example_inputs)]
    return repr((modules, tensors(model.named_parameters(remove_duplicate=False)),
                 tensors(model.named_buffers(remove_duplicate=False)), inputs, list(keep)))


def _described(value) -> str:
    if hasattr(value, "to_json_string"):  # a transformers config, nested ones (text_config...) alike
        return repr([(k, _described(v)) for k, v in sorted(vars(value).items())])
    return repr(value)


def preloaded_context():
    """The fork-server context whose server has imported ``PRELOAD``: a server started with another list (the
    server of ``pipeloom serve``'s jobs, in this process) is stopped first, and the next start imports this one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the process's one fork server (private: no public way to stop it)
    if server._preload_modules != PRELOAD and server._forkserver_pid is not None:
        server._stop()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(world: int, fn, *args, timeout: float = 120.0, context=None) -> dict[int, tuple[str, object]]:
    """``{rank: ("ok", result) | ("error", text) | ("died", exit code)}``; ranks that never answer
    within ``timeout`` are killed and reported as ("timeout", None). ``context``: the multiprocessing
    context that starts the ranks (default: the fork server preloaded with ``PRELOAD``). A launch whose free
    port another process took before rank 0 bound it is started again on another port (at most 3 times)."""
    if context is None:  # PIPELOOM_TEST_SPAWN=1: spawn every rank afresh, as before (to compare, or to debug)
        context = mp.get_context("spawn") if os.environ.get("PIPELOOM_TEST_SPAWN") == "1" else preloaded_context()
    for _ in range(3):
        results = _launch(context, world, fn, args, timeout)
        if not any(status == PORT_TAKEN for status, _ in results.values()):
            break
    return results


def _launch(ctx, world: int, fn, args, timeout: float) -> dict[int, tuple[str, object]]:
    import queue as queues
    import time

    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.2)
        except queues.Empty:
            if not any(p.is_alive() for p in procs):  # all gone: whoever did not answer died
                break
            continue
        results[rank] = (status, value)
        if status == PORT_TAKEN:  # the others wait for a rank 0 that never listens
            break
    taken = any(status == PORT_TAKEN for status, _ in results.values())
    for p in procs:
        p.join(timeout=0 if taken else 5)
        if p.is_alive():
            p.kill()
    for r in range(world):
        code = procs[r].exitcode
        results.setdefault(r, ("timeout", None) if code is None else ("died", code))
    return results
