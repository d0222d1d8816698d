"""Run a function on several gloo ranks (processes of their own) and collect what each returns.

The ranks are forked from one rank server per test process, not spawned: a spawned rank spends seconds
importing torch (12-15 s for two ranks on the loaded 2-core machine, against 0.4 s forked), and the multi-rank
tests start ranks a few hundred times. The server imports torch, pipeloom's runtime, the transformers models
the tests build and the rank jobs once (``PRELOAD``), then forks each launch's ranks. Each test still gets
fresh processes; only the imports and the traces below are shared.

torch.export takes most of a rank's CPU in these tests (seconds per tiny model), and every rank of a launch
traces the same model. A model torch.export has already traced in a process is not traced again
(``_remember_exports``), and the ranks inherit what their server remembers:

- a job may name the traces it will take with :func:`traces_before_fork`; the server takes them before it
  forks the ranks, so a launch of ``world`` ranks traces each model once instead of ``world`` times, and
  later launches of this test process not at all;
- a model the ranks of one launch of 4 or more traced, or of two launches of 2 (the same test's several
  launches, or several tests' jobs), is traced by the server after that launch (:func:`_learn`), and later
  launches trace it no more;
- inside one rank, tests that build several engines of the same model (one per schedule, the engine under
  test beside its reference) trace it once.

``PIPELOOM_TEST_EXPORT_MEMO=0`` traces every time, in every rank; ``PIPELOOM_TEST_SPAWN=1`` spawns every rank
afresh instead (to compare, or to debug)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
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
"""Imported once by the rank server (a module that cannot be imported is skipped: transformers is optional)."""


def traces_before_fork(prepare):
    """Mark a rank job: ``prepare(*args)`` (the job's arguments after rank and world) builds the models the
    job will trace and traces them as the job does, in the rank server before it forks the ranks. A trace it
    takes differently from the job's is only wasted time (the ranks trace again); one it cannot take is left
    to the ranks, which report the error."""

    def mark(job):
        job.traces_before_fork = prepare
        return job

    return mark


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT_TAKEN = "port taken"
"""What a rank 0 reports when another process took the free port between :func:`free_port` and its bind."""


def _worker(launch: int, rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _remember_exports()
    if "folder" in _LEARNING:
        _LEARNING["launch"] = launch
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        except Exception as error:
            if "EADDRINUSE" in str(error):  # the launch is retried on another port
                queue.put((launch, rank, PORT_TAKEN, str(error)))
                return
            raise
        result = fn(rank, world, *args)
        queue.put((launch, rank, "ok", result))
    except BaseException as error:  # noqa: BLE001 (report everything; the parent decides)
        queue.put((launch, rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            _leave_together(rank, world)
            with contextlib.suppress(Exception):  # a failed peer may have broken the group already
                dist.destroy_process_group()


LEAVE_S = 10.0
"""How long rank 0 waits for the other ranks to finish before it leaves (:func:`_leave_together`)."""


def _leave_together(rank: int, world: int) -> None:
    """Rank 0 hosts the group's store: it leaves only once every rank has finished (or after ``LEAVE_S``, for a rank
    that died or hangs), as a rank still creating subgroups reads the store after rank 0's own part is done (a
    subgroup without rank 0: DeviceMesh's flattened groups). Rank 0 leaving first had reset another rank's store
    connection under load ("Connection reset by peer" in a passing test's rank 1)."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a store that is gone already: nothing to wait for
        store = dist.distributed_c10d._get_default_store()
        left = store.add("pipeloom-test/left", 1)
        deadline = time.monotonic() + LEAVE_S
        while rank == 0 and left < world and time.monotonic() < deadline:
            time.sleep(0.05)
            left = store.add("pipeloom-test/left", 0)


def _remember_exports() -> None:
    """Make this process's torch.export of a model (pipeloom's ``tracing.exported_program``) return the program it
    returned before for a model of the same kind (``_model_key``: the same modules with the same attributes,
    parameter and buffer names, shapes and dtypes, example input shapes, and kept modules). torch.export traces
    with fake tensors, so the values of the tensors do not enter the graph; pipeloom builds its own graph from
    the program for each engine, bound to that engine's model's tensors, and never changes the program. A trace
    that fails is not remembered. Forked processes inherit the programs remembered before the fork."""
    from pipeloom.runtime.model import tracing

    if not _memo_on() or hasattr(tracing.exported_program, "programs"):
        return  # off, or already on (a rank forked from the server inherits the server's)
    original = tracing.exported_program
    programs: dict[str, object] = {}

    def exported(model, example_inputs, keep=()):
        key = _model_key(model, example_inputs, keep)
        if key not in programs:
            programs[key] = original(model, example_inputs, keep)
            _offer(key, model, example_inputs, keep)
        return programs[key]

    exported.programs = programs
    tracing.exported_program = exported


def _memo_on() -> bool:
    """Whether traces are remembered and shared (``PIPELOOM_TEST_EXPORT_MEMO=0`` turns it off)."""
    return os.environ.get("PIPELOOM_TEST_EXPORT_MEMO") != "0"


_LEARNING: dict[str, object] = {}
"""In the rank server and the ranks it forks: ``folder`` (where a rank leaves the models it traced for the
server, :func:`_offer`), ``launch`` (in a rank: its launch), ``seen`` (in the server: per key, the launches
whose ranks traced it, one of 4 ranks or more counted twice)."""


def _offer(key: str, model, example_inputs, keep) -> None:
    """Leave a model a rank traced, with its inputs and kept modules, for the server (:func:`_learn`): once
    per launch and kind of model (the first rank to take the file's name writes it). A model that does not
    pickle is not left."""
    import hashlib
    import pickle

    if "launch" not in _LEARNING:
        return  # not a rank of the server
    name = Path(_LEARNING["folder"]) / f"{_LEARNING['launch']}-{hashlib.sha256(key.encode()).hexdigest()}"
    try:
        data = pickle.dumps((key, model, example_inputs, tuple(keep)))
    except Exception:  # noqa: BLE001 (local classes, hooks that are closures...: the ranks keep tracing it)
        return
    with contextlib.suppress(FileExistsError), open(name, "xb") as out:
        out.write(data)


def _learn(launch: int, world: int) -> None:
    """In the server, after ``launch`` of ``world`` ranks: trace each model its ranks left, so the ranks of
    later launches inherit the program instead of tracing it each. Most models are traced by one test, and a
    trace here costs a quarter or more of a launch of 4 ranks or more, half of one of 2: a model is traced
    here after its first such launch of 4 ranks or more, else after its second."""
    import pickle

    from pipeloom.runtime.model import tracing

    seen: dict[str, int] = _LEARNING.setdefault("seen", {})
    for path in sorted(Path(_LEARNING["folder"]).glob(f"{launch}-*")):
        digest = path.name.split("-", 1)[1]
        before = seen.get(digest, 0)
        seen[digest] = before + (2 if world >= 4 else 1)
        try:
            if before < 2 <= seen[digest]:  # tried once: one that fails here is left to the ranks
                key, model, example_inputs, keep = pickle.loads(path.read_bytes())
                if _model_key(model, example_inputs, keep) == key:  # else it would be remembered under another
                    tracing.exported_program(model, example_inputs, keep)
        except Exception:  # noqa: BLE001 (the ranks trace it themselves, as before)
            pass
        finally:
            path.unlink()


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


class _RankServer:
    """A process that imported ``PRELOAD`` and forks ranks on request (:func:`_serve`), one per test process;
    the ranks report on ``results`` as ``(launch, rank, status, value)``."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.requests, theirs = ctx.Pipe()
        # not a daemon: a daemon may not start processes; it ends when its pipe closes (here, or at our exit)
        self.process = ctx.Process(target=_serve, args=(theirs, self.results), name="rank server")
        self.process.start()
        theirs.close()
        self.launches = itertools.count()
        atexit.register(self.stop)

    def kill(self) -> None:
        global _server
        self.process.kill()
        self.process.join()
        if _server is self:
            _server = None

    def stop(self) -> None:
        self.requests.close()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


_server: _RankServer | None = None
_SERVER_WAIT_S = 600.0
"""How long a launch waits for the server to start its ranks (imports at its start, traces before the fork)."""


def _rank_server() -> _RankServer:
    global _server
    if _server is None or not _server.process.is_alive():
        _server = _RankServer()
    return _server


def _serve(requests, results) -> None:
    """Import ``PRELOAD``, then for each launch request: take the job's traces before the fork
    (:func:`traces_before_fork`), fork the ranks, answer their pids, wait for them, answer their exit
    codes, and trace the models later launches will likely trace again (:func:`_learn`). Ends when the test
    process closes its end of the pipe."""
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import torch

    torch.set_num_threads(1)  # the ranks run on one thread each; none is started here before they fork
    _remember_exports()
    if _memo_on():
        _LEARNING["folder"] = tempfile.mkdtemp(prefix="pipeloom-rank-server-")
    try:
        _serve_launches(requests, results)
    finally:
        if "folder" in _LEARNING:
            shutil.rmtree(_LEARNING["folder"], ignore_errors=True)


def _serve_launches(requests, results) -> None:
    import random

    import torch

    fork = mp.get_context("fork")
    seeds = torch.get_rng_state(), random.getstate()  # what every rank starts from, whatever ran here before
    while True:
        try:
            launch, world, port, fn, args = requests.recv()
        except EOFError:
            return
        prepare = getattr(fn, "traces_before_fork", None)
        if prepare is not None and _memo_on():
            with contextlib.suppress(Exception):  # the ranks trace (and report what fails) themselves
                prepare(*args)
        torch.set_rng_state(seeds[0])
        random.setstate(seeds[1])
        procs = [fork.Process(target=_worker, args=(launch, r, world, port, fn, args, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        requests.send(("started", launch, [p.pid for p in procs]))
        for p in procs:
            p.join()
        requests.send(("exited", launch, [p.exitcode for p in procs]))
        if "folder" in _LEARNING:
            _learn(launch, world)


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> dict[int, tuple[str, object]]:
    """``{rank: ("ok", result) | ("error", text) | ("died", exit code)}``; ranks that never answer
    within ``timeout`` are killed and reported as ("timeout", None). A launch whose free port another
    process took before rank 0 bound it is started again on another port (at most 3 times)."""
    launch = _spawn_launch if os.environ.get("PIPELOOM_TEST_SPAWN") == "1" else _launch
    for _ in range(3):
        results = launch(world, fn, args, timeout)
        if not any(status == PORT_TAKEN for status, _ in results.values()):
            break
    return results


def _launch(world: int, fn, args, timeout: float) -> dict[int, tuple[str, object]]:
    """One launch on the rank server. Its ranks' deadline runs from when they started: the server may first
    import (when it starts) and trace for the job. A server that does not start them within
    ``_SERVER_WAIT_S`` (or whose wait is interrupted: a test's own timeout) is stopped, and the next launch
    starts another."""
    import queue as queues

    server = _rank_server()
    launch = next(server.launches)
    pids = None
    try:
        server.requests.send((launch, world, free_port(), fn, args))
        pids = _answer(server, "started", launch, _SERVER_WAIT_S)
    finally:
        if pids is None:
            server.kill()
    if pids is None:
        return {r: ("timeout", None) for r in range(world)}
    results: dict[int, tuple[str, object]] = {}
    codes = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and codes is None and time.monotonic() < deadline:
            try:
                ran, rank, status, value = server.results.get(timeout=0.2)
            except queues.Empty:
                if server.requests.poll():
                    codes = _answer(server, "exited", launch, 0)
                continue
            if ran != launch:
                continue  # a rank of an earlier launch, killed after its deadline
            results[rank] = (status, value)
            if status == PORT_TAKEN:  # the others wait for a rank 0 that never listens
                break
        if codes is None:
            taken = any(status == PORT_TAKEN for status, _ in results.values())
            codes = None if taken else _answer(server, "exited", launch, 5)
    finally:
        killed = codes is None
        if killed:  # kill what is left, then hear how each ended
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            codes = _answer(server, "exited", launch, 30)
    with contextlib.suppress(queues.Empty):  # results put just before the last rank exited
        while len(results) < world:
            ran, rank, status, value = server.results.get(timeout=0.5)
            if ran == launch:
                results.setdefault(rank, (status, value))
    for r in range(world):  # a rank killed here never answered in time; one that ended unasked died
        code = None if codes is None else codes[r]
        if killed and code == -signal.SIGKILL:
            code = None
        results.setdefault(r, ("timeout", None) if code is None else ("died", code))
    return results


def _answer(server: _RankServer, what: str, launch: int, timeout: float):
    """The server's ``what`` answer for ``launch`` (earlier launches' answers are passed over), or None."""
    deadline = time.monotonic() + timeout
    while server.requests.poll(max(0.0, deadline - time.monotonic())):
        try:
            said, about, value = server.requests.recv()
        except (EOFError, OSError):  # the server died
            return None
        if said == what and about == launch:
            return value
    return None


def _spawn_launch(world: int, fn, args, timeout: float) -> dict[int, tuple[str, object]]:
    """Every rank spawned afresh, importing everything itself."""
    import queue as queues

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(0, r, world, port, fn, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            _, rank, status, value = queue.get(timeout=0.2)
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
