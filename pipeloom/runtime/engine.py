"""Run a pipeloom schedule on ``torch.distributed``: :func:`pipeline` builds a :class:`PipelineEngine`
whose ``step`` trains one batch and returns the loss on every rank, exactly as one device would.

Every rank builds the same model and calls the same ``step``; the engine keeps the stages its rank
holds, lowers the compute schedule (receives posted early in each sender's order, sends after each
action), runs F, B, I and W with autograd, and hands values between stages of one rank in memory.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.ir.json_io import schedule_to_json
from pipeloom.runtime import state
from pipeloom.runtime.checkpoint import load_checkpoint, save_checkpoint
from pipeloom.runtime.clip import clip_grad_norm_
from pipeloom.runtime.agree import StepMismatchError, agree_on_step
from pipeloom.runtime.backward import add_in_order
from pipeloom.runtime.comm import Messenger
from pipeloom.runtime.dp import GradientBuckets, Layout, layout_of
from pipeloom.runtime.fsdp import ShardedGradients, shard_pieces
from pipeloom.runtime.lower import Lowering, PipelineError
from pipeloom.runtime.materialize import StateSource, place_pieces
from pipeloom.runtime.shared import SharedParameters, check_placement, shared_parameters
from pipeloom.runtime.setup import (
    default_store,
    device_for,
    lower_for,
    resolve_schedule,
    shared_run_id,
    shared_seed,
    staged_model,
)
from pipeloom.runtime.split import StagedModel
from pipeloom.runtime.state import LoadResult, ModelNames, model_names
from pipeloom.runtime.pieces import RankPieces
from pipeloom.runtime.step import StepRun
from pipeloom.runtime.timing import ActionClock

__all__ = ["PipelineEngine", "PipelineError", "pipeline"]

TRACE_ENV = "PIPELOOM_TRACE"
_LIVE: weakref.WeakSet = weakref.WeakSet()  # engines not yet collected


@atexit.register
def _close_live_engines() -> None:
    """Close every engine still alive at exit (their threads and group references), while the
    interpreter is still whole."""
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.close()
_LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # agreed on across ranks


def pipeline(
    model: nn.Module | None = None,
    *,
    schedule: object = None,
    split_points: Sequence[str] | None = None,
    stages: StagedModel | Sequence[nn.Module] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    microbatches: int | None = None,
    process_group: object = None,
    schedule_options: dict | None = None,
    device: torch.device | str | None = None,
    trace: str | Path | bool | None = None,
    timeout: float = 60.0,
    plan: str | Path | None = None,
    tracer: str = "auto",
    leaf_modules: Sequence[str] = (),
    example_inputs: object = None,
    seed: int | None = None,
    mesh: object = None,
    state_dict: StateSource | None = None,
    init_weights: Callable[[nn.Module], object] | None = None,
    data_parallel: str = "replicate",
) -> PipelineEngine:
    """Build the engine that runs ``schedule`` over ``model`` cut into stages on this process group.

    ``schedule``: a built-in name (built for this world size, ``microbatches`` and the model's
    pieces), a :class:`~pipeloom.Schedule`, or a saved ``.json``/``.csv`` file. ``plan``: a plan file
    of ``pipeloom plan`` (split points, schedule and micro-batches; explicit arguments win).
    ``trace``: a folder to write ``rank<R>.json`` to after every step, or True to record the steps
    in memory only (``engine.trace_steps``; ``engine.write_trace(path)`` writes them).
    ``tracer``/``leaf_modules``/``example_inputs``: how ``split_points`` cut the model
    (:func:`~pipeloom.runtime.split_model`: torch.fx, or torch.export from example inputs).
    ``seed``: the random numbers of every piece's forward derive from it (default: rank 0's
    ``torch.initial_seed()``), so dropout draws the same on any number of ranks (docs/runtime.md).
    ``mesh``: a ``DeviceMesh`` with a ``"pp"`` dimension (the pipeline) and optionally ``"dp"`` (replicas of
    it, each running its share of the global batch; :mod:`pipeloom.runtime.dp`), instead of ``process_group``.
    ``state_dict``/``init_weights``: for a model built on the meta device, what fills this rank's pieces
    (a state dict, a ``torch.save`` file or a ``torch.distributed.checkpoint`` folder; a function called on
    every module this rank holds); other ranks' tensors are never allocated.
    ``data_parallel``: how the mesh's ``"dp"`` replicas hold the pieces: ``"replicate"`` (whole, gradients
    all-reduced) or ``"fsdp"`` (sharded with torch's ``fully_shard``; :mod:`pipeloom.runtime.fsdp`).
    """
    if plan is not None:
        from pipeloom.plan import load_plan

        chosen = load_plan(plan)
        split_points = chosen.split_points if split_points is None and stages is None else split_points
        schedule = chosen.schedule if schedule is None else schedule
        schedule_options = dict(chosen.schedule_options) if schedule_options is None else schedule_options
        microbatches = chosen.microbatches if microbatches is None else microbatches
    if schedule is None:
        raise PipelineError("say which schedule to run: schedule='1f1b' (see `pipeloom list`), a Schedule or a file")
    if loss_fn is None:
        raise PipelineError("give loss_fn=, called as loss_fn(output, target) for every micro-batch")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise PipelineError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise PipelineError(f"microbatches must be a positive integer, got {microbatches!r}")
    layout = layout_of(process_group, mesh)
    rank, world = layout.rank, layout.world
    staged = staged_model(model, split_points, stages, tracer=tracer, leaf_modules=leaf_modules,
                          example_inputs=example_inputs)
    sched = resolve_schedule(schedule, num_ranks=world, num_pieces=staged.num_stages,
                             microbatches=microbatches, options=schedule_options or {})
    lowering = lower_for(sched, staged, world=world, microbatches=microbatches)
    shared = shared_parameters(staged.stages)
    check_placement(shared, lowering)
    names = model_names(model, staged.stages)  # by identity: before any tensor is moved or allocated
    pieces = [lowering.piece_of[s] for s in lowering.stages_on(rank)]
    device = device_for(layout, device, [staged.stages[k] for k in pieces])
    if len(set(pieces)) != len(pieces):
        raise PipelineError(f"rank {rank} holds two replicas of one model piece; put replicas on different ranks")
    replaced = place_pieces({k: staged.stages[k] for k in pieces}, device, model=model, names=names,
                            state_dict=state_dict, init_weights=init_weights)
    shared = dataclasses.replace(shared, params=tuple(replaced.get(id(p), p) for p in shared.params))
    if _sharded(data_parallel, layout, lowering, shared):
        shard_pieces({k: staged.stages[k] for k in pieces}, layout.dp.mesh)
    trace = trace if trace is not None else os.environ.get(TRACE_ENV) or None
    return PipelineEngine(staged=staged, lowering=lowering, loss_fn=loss_fn, layout=layout, device=device,
                          trace=trace, timeout=float(timeout), shared=shared,
                          seed=shared_seed(layout.everyone, layout.everyone_size, seed), names=names,
                          sharded=data_parallel == "fsdp")


def _sharded(data_parallel: str, layout: Layout, lowering: Lowering, shared: SharedParameters) -> bool:
    """Whether the pieces are sharded with FSDP2 (checking that they can be)."""
    if data_parallel not in ("replicate", "fsdp"):
        raise PipelineError(f"data_parallel must be 'replicate' or 'fsdp', got {data_parallel!r}")
    if data_parallel == "replicate":
        return False
    if layout.dp.mesh is None:
        raise PipelineError("data_parallel='fsdp' shards over the mesh's \"dp\" dimension: pass mesh= with "
                            "mesh_dim_names=('dp', 'pp') and a dp size above 1")
    if lowering.replicas > 1:
        raise PipelineError(f"schedule {lowering.schedule.name!r} holds two replicas of each piece; with "
                            "data_parallel='fsdp' choose a one-replica schedule (1f1b, zbv, interleaved-1f1b, ...)")
    if shared.params:
        raise PipelineError(f"parameter {shared.names[0]!r} is used by several pieces, which FSDP cannot shard "
                            "once; use data_parallel='replicate', or split so that all its uses fall in one piece")
    return True


def _rank_pieces(lowering: Lowering, rank: int, device: torch.device, modules: dict[int, nn.Module],
                 staged: StagedModel, loss_fn: Callable, seed: int, shared: SharedParameters, layout: Layout,
                 sharded: bool) -> RankPieces:
    """What every step of ``rank`` reads (see :class:`~pipeloom.runtime.pieces.RankPieces`)."""
    program = lowering.programs[rank]
    last_gradient: dict[int, int] = {}  # stage -> the program index of its last weight-gradient action
    for t, step in enumerate(program):
        if step.action.kind in ("B", "W"):
            last_gradient[step.action.stage] = t
    return RankPieces(
        lowering=lowering, rank=rank, device=device, modules=modules, program=program,
        eval_program=tuple(step for step in program if step.action.kind == "F"),
        num_outputs=tuple(spec.num_outputs for spec in staged.graph.stages), output=staged.graph.output,
        loss_fn=loss_fn, seed=seed, shared=shared, dp=layout.dp, sharded=sharded,
        gradients_done={t: s for s, t in last_gradient.items()},  # where "dp" buckets are posted
    )


class PipelineEngine:
    """Runs one lowered schedule on this rank; see :func:`pipeline`."""

    def __init__(self, *, staged: StagedModel, lowering: Lowering, loss_fn: Callable, layout: Layout,
                 device: torch.device, trace: str | Path | bool | None, timeout: float,
                 shared: SharedParameters | None = None, seed: int = 0, names: ModelNames | None = None,
                 sharded: bool = False) -> None:
        """Built by :func:`pipeline`, which has put this rank's pieces on ``device``."""
        self.staged = staged
        self.lowering = lowering
        self.schedule = lowering.schedule
        self.loss_fn = loss_fn
        self.layout = layout
        self.rank = rank = layout.rank
        self.world_size = world_size = layout.world
        self.group = group = layout.group
        self.dp = layout.dp
        self.sharded = sharded  # pieces sharded over "dp" with FSDP2
        self.timeout = timeout
        self.device = torch.device(device)
        self.local_stages = lowering.stages_on(rank)
        self.modules = {s: staged.stages[lowering.piece_of[s]] for s in self.local_stages}
        self.shared = shared if shared is not None else shared_parameters(())
        self.seed = seed
        self.pieces = _rank_pieces(lowering, rank, self.device, self.modules, staged, loss_fn, seed, self.shared,
                                   layout, sharded)
        self.params = self.pieces.trainable()
        self.tracing = trace is not None and trace is not False
        self.trace_dir = Path(trace) if isinstance(trace, (str, Path)) else None
        self.trace_steps: list[dict] = []
        self.clock = ActionClock(self.device)  # action times of traced steps (CUDA events on a GPU)
        self.broken: str | None = None
        self._meta_cache: dict[tuple, tuple[dict, dict]] = {}
        store, run_id = None, "local"
        if world_size > 1:
            store = default_store()
            run_id = shared_run_id(group, rank)
        self.messenger = Messenger(
            rank=rank, group=group, to_global=(lambda r: dist.get_global_rank(group, r)) if group is not None
            else (lambda r: r), device=self.device, timeout=timeout, units=lowering.units,
            pair_order=lowering.pair_order, unit_of=lowering.unit_of, store=store, run_id=run_id,
        )
        last = lowering.num_pieces - 1
        self._loss_ranks = len({lowering.rank_of[lowering.stage_for[j][last]] for j in range(lowering.replicas)})
        self._step_count = 0
        _LIVE.add(self)  # closed at interpreter exit if the script does not close it
        self.training_steps = 0  # training steps run: part of every forward's random seed
        self.training = True
        # the original model's names of the pieces' tensors (manual mode: stages.{k}.{name})
        self.names = names if names is not None else model_names(None, staged.stages)

    # ------------------------------------------------------------------------------ public API

    @property
    def num_microbatches(self) -> int:
        """Real micro-batches per step of this pipeline (of one data-parallel replica)."""
        return self.lowering.num_microbatches

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of the global batch: ``num_microbatches`` × the data-parallel replicas."""
        return self.lowering.num_microbatches * self.dp.size

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters: the original model's Parameter objects of its stages."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules.values():
            for param in module.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def step(self, inputs: object, *, target: object = None) -> torch.Tensor:
        """Train on one batch: forward and backward of every micro-batch; returns the loss on every rank.

        ``inputs`` is a tensor or a tuple of tensors (the model's positional inputs), cut into
        micro-batches along dim 0; ``target`` likewise for ``loss_fn``. Gradients accumulate into
        the local parameters' ``.grad`` as the single-device reference would.
        """
        return self._run(inputs, target, training=True)[0]

    def eval_step(self, inputs: object, *, target: object = None) -> object:
        """Forward only, without autograd. With ``target``: the loss, on every rank. Without: the model
        outputs (concatenated over micro-batches when a tensor) on the rank(s) holding the last
        piece, None elsewhere."""
        modes = {s: module.training for s, module in self.modules.items()}
        for module in self.modules.values():
            module.eval()
        try:
            loss, outputs = self._run(inputs, target, training=False)
        finally:
            for s, module in self.modules.items():
                module.train(modes[s])
        return loss if target is not None else outputs

    def train(self, mode: bool = True) -> PipelineEngine:
        """Put this rank's stages in training (or, ``mode=False``, evaluation) mode, as ``nn.Module.train``
        does; dropout follows it even where the traced code fixed ``training=True``."""
        self.training = bool(mode)
        for module in self.modules.values():
            module.train(self.training)
        return self

    def eval(self) -> PipelineEngine:
        """``train(False)``: dropout off in ``step`` too."""
        return self.train(False)

    def close(self) -> None:
        """Stop this rank's helper threads (sends, failure watch); call it before
        ``dist.destroy_process_group()``. Idempotent; an engine never closed is closed at interpreter
        exit. A closed engine takes no more steps."""
        self.messenger.close()
        # drop this engine's references to the process group and the store, so that a group the script
        # destroys is really destroyed then, not during interpreter finalization (where gloo's worker
        # threads can abort the process)
        self.messenger.release()
        self.group = None

    # ------------------------------------------------------------------------------ the step

    def _chunks(self, value: object, what: str) -> list[list]:
        """value -> per model input, its M micro-batches (a list of tensors)."""
        values = value if isinstance(value, (tuple, list)) else (value,)
        m, total = self.num_microbatches, self.total_microbatches
        first = self.dp.rank * m  # this replica's share of the global batch's micro-batches
        out = []
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                raise PipelineError(f"{what}[{i}] is {type(v).__name__}; step() takes tensors (or a tuple of tensors)")
            if v.dim() == 0:
                raise PipelineError(f"{what}[{i}] is a 0-d tensor; micro-batches are cut along dim 0, so give one "
                                    "row per sample")
            parts = list(torch.chunk(v, total, dim=0))
            if len(parts) != total:
                per = f" ({m} per replica × {self.dp.size} replicas)" if self.dp.size > 1 else ""
                raise PipelineError(f"{what} has {v.shape[0]} rows along dim 0, which torch.chunk cuts into "
                                    f"{len(parts)} pieces, not the {total} micro-batches{per}; use a multiple of "
                                    f"{total} rows")
            out.append([part.to(self.device) for part in parts[first:first + m]])
        return out

    def _signature(self, chunks: list[list], targets: list[list], training: bool) -> tuple:
        return (training, tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in chunks),
                tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in targets))

    def _run(self, inputs: object, target: object, *, training: bool) -> tuple[torch.Tensor | None, object]:
        if self.broken:
            raise PipelineError(f"this engine failed earlier ({self.broken}); build a new one (and process group)")
        if self.messenger.closed:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        try:  # every rank was given the same step, before any tensor moves (a mismatch leaves it usable)
            agree_on_step(inputs, target, training=training, microbatches=self.num_microbatches,
                          group=self.layout.everyone, world=self.layout.everyone_size, rank=self.rank,
                          device=self.device, wait=self.messenger.wait_work)
        except StepMismatchError:
            raise
        except PipelineError as error:
            self.broken = str(error)
            self.messenger.report(self.broken)
            raise
        self.params = self.pieces.trainable()  # requires_grad may have changed since the last step
        chunks = self._chunks(inputs, "inputs")
        num_inputs = len(self.staged.graph.input_names)
        if len(chunks) != num_inputs:
            raise PipelineError(f"the model takes {num_inputs} input(s) ({', '.join(self.staged.graph.input_names)}), "
                                f"step() got {len(chunks)}; pass a tuple with one tensor per input")
        if training and target is None:
            raise PipelineError("step() needs target= (passed to loss_fn with each micro-batch's output)")
        targets = self._chunks(target, "target") if target is not None else []
        signature = self._signature(chunks, targets, training)
        cached = self._meta_cache.get(signature)
        metas, specs = (cached if cached is not None else ({}, {}))
        events: list | None = [] if self.tracing else None
        if events is not None:
            self.clock.begin()
        step_start = time.time_ns()
        buckets = None
        if training and self.sharded:
            buckets = ShardedGradients(self.modules)
            buckets.begin()
        elif training and self.dp.size > 1:
            buckets = GradientBuckets(dp=self.dp, stage_params=self.params, late=self._late_params(),
                                      wait=self.messenger.wait_work)
            buckets.begin()
        try:  # posts the replica-gradient receives: a failure there breaks the engine like any other
            run = StepRun(self.pieces, self.messenger, chunks, targets, training=training, params=self.params,
                          step_index=self.training_steps, metas=metas, specs=specs, discover=cached is None,
                          events=events, clock=self.clock, buckets=buckets)
        except Exception as error:
            self.broken = f"rank {self.rank}: starting the step failed: {type(error).__name__}: {error}"
            self.messenger.report(self.broken)
            raise PipelineError(self.broken) from error
        try:
            with torch.enable_grad() if training else torch.no_grad():
                run.execute()
            start = time.time_ns()
            run.messages.finish()
            if run.shared is not None:
                run.shared.exchange(self.messenger, self.device)
            if events is not None:
                events.append(("sends complete", "sync", start, time.time_ns()))
            loss = self._reduce_loss(run.losses, targets, events)
            if training and self.lowering.replicas > 1:
                start = time.time_ns()
                run.replicas.merge()
                if events is not None:
                    events.append(("replica gradients merged", "sync", start, time.time_ns()))
            if buckets is not None:
                start = time.time_ns()
                buckets.finish()
                if events is not None:
                    events.append(("data-parallel gradients summed", "sync", start, time.time_ns()))
        except PipelineError as error:
            self.broken = str(error)
            self.messenger.report(str(error))
            raise
        except Exception as error:
            message = run.describe_failure(error)
            self.broken = message
            self.messenger.report(message)
            raise PipelineError(message) from error
        if cached is None:
            self._meta_cache[signature] = (metas, specs)
        if events is not None:
            self.clock.resolve(events)
            self._write_trace(step_start, time.time_ns(), events)
        self._step_count += 1
        self.training_steps += training
        return loss, run.outputs()

    def _reduce_loss(self, losses: dict[int, torch.Tensor], targets: list, events: list | None) -> torch.Tensor | None:
        """Sum of the micro-batch losses of the global batch in micro-batch order, the same on every rank."""
        if not targets:
            return None
        m = self.num_microbatches
        sample = next(iter(losses.values()), None)
        dtype = sample.dtype if sample is not None else torch.float32
        vector = torch.zeros(m, dtype=dtype, device=self.device)
        for mb, value in losses.items():
            vector[mb] = value
        if self.world_size > 1 or self.dp.size > 1:
            # float64 holds every float loss exactly; the last slot carries the loss dtype's code from
            # each rank holding a last piece, so ranks without one return the same dtype
            start = time.time_ns()
            vector = torch.cat([vector.to(torch.float64), torch.zeros(1, dtype=torch.float64, device=self.device)])
            if sample is not None:
                vector[m] = _LOSS_DTYPES.index(dtype) + 1 if dtype in _LOSS_DTYPES else 0
            if self.world_size > 1:
                self.messenger.wait_work(dist.all_reduce(vector, group=self.group, async_op=True),
                                         "summing the loss across ranks")
            code = round(float(vector[m]) / self._loss_ranks) - 1
            if self.dp.size > 1:  # the replicas' micro-batches, in global order
                gathered = [torch.empty_like(vector) for _ in range(self.dp.size)]
                self.messenger.wait_work(dist.all_gather(gathered, vector, group=self.dp.group, async_op=True),
                                         "gathering the loss of every data-parallel replica")
                vector = torch.cat([part[:m] for part in gathered] + [vector[m:]])
            if events is not None:
                events.append(("loss all-reduce", "sync", start, time.time_ns()))
            vector = vector[:-1].to(_LOSS_DTYPES[code] if code >= 0 else dtype)
        return add_in_order(list(vector))

    def _late_params(self) -> set[int]:
        """Parameters whose gradient is settled only at the end of the step (reduced over "dp" then):
        shared ones, and all of them on two-replica schedules."""
        if self.lowering.replicas > 1:
            return {id(p) for ps in self.params.values() for p in ps}
        return {id(p) for p in self.shared.params}

    # ------------------------------------------------------------------------------ trace

    def _write_trace(self, start: int, end: int, events: list) -> None:
        self.trace_steps.append({
            "step": self._step_count, "start_ns": start, "end_ns": end,
            "events": [{"name": n, "kind": k, "start_ns": a, "end_ns": b} for n, k, a, b in events],
        })
        if self.trace_dir is not None:
            self.write_trace(self.trace_dir / f"rank{self.rank}.json")

    def trace_document(self) -> dict:
        """This rank's recorded steps as a ``pipeloom.runtime-trace/1`` document (docs/trace.md)."""
        return {
            "format": "pipeloom.runtime-trace/1", "rank": self.rank, "world_size": self.world_size,
            "clock": "unix_ns", "schedule": json.loads(schedule_to_json(self.schedule)),
            "steps": self.trace_steps,
        }

    def write_trace(self, path: str | Path) -> None:
        """Write this rank's recorded steps (format ``pipeloom.runtime-trace/1``, see docs/trace.md)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.trace_document()))

    # ------------------------------------------------------------------------------ training-loop helpers
    # (runtime/state.py, clip.py, checkpoint.py; every rank calls the collective ones: clip_grad_norm_, full_state_dict, checkpoints)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's ``named_parameters()`` names (a tied one under the
        name the model gives it; manual mode: ``stages.{k}.{name}``), each once, in the model's order."""
        return iter(state.named_parameters(self.names, self._pieces()))

    def clip_grad_norm_(self, max_norm: float, *, norm_type: float | str = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` over every rank, bitwise: scales this
        rank's gradients and returns the total norm, the same on every rank."""
        return clip_grad_norm_(self.named_parameters(), self.names.parameters, max_norm,
                                     norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach,
                                     group=self._group_for("clip_grad_norm_"), device=self.device,
                                     wait=self.messenger.wait_work)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's ``state_dict()`` keys (tied ones under
        each of theirs), detached and sharing storage, as ``nn.Module.state_dict`` gives them."""
        return state.state_dict(self.names, self._pieces())

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> LoadResult:
        """Copy ``state_dict`` into this rank's tensors; keys of other ranks' tensors are skipped, so a
        single-device checkpoint loads on every rank. ``strict``: this rank's keys all present and no
        key the model lacks, else PipelineError before anything is copied."""
        return state.load_state_dict(self.names, self._pieces(), state_dict, strict=strict)

    def full_state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """A copy of the whole model's state dict, on the CPU, on group rank ``rank`` (``{}`` elsewhere):
        what ``model.state_dict()`` gives on one device, loadable with ``model.load_state_dict``."""
        return state.full_state_dict(self.names, self._pieces(), dst=rank, rank=self.rank,
                                     group=self._group_for("full_state_dict"), device=self.device,
                                     wait=self.messenger.wait_work)

    def save_checkpoint(self, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save the model (and ``optimizer``'s state, by parameter name) with ``torch.distributed.checkpoint``
        into the folder ``path``; every rank calls it. Any pipeline of the model, or one device, loads it."""
        save_checkpoint(path, self.names, self._pieces(), optimizer=optimizer, group=self._dcp_group(),
                              counters={"training_steps": self.training_steps})

    def load_checkpoint(self, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load what :meth:`save_checkpoint` saved into this rank's tensors and ``optimizer``."""
        found = load_checkpoint(path, self.names, self._pieces(), optimizer=optimizer,
                                      group=self._dcp_group(), counters={"training_steps": self.training_steps})
        self.training_steps = found["training_steps"]  # the next step draws the random numbers it would have

    def _pieces(self) -> dict[int, nn.Module]:
        return {self.lowering.piece_of[s]: module for s, module in self.modules.items()}

    def _group_for(self, what: str) -> object:
        """The group for a collective helper (None with one rank); refused once the engine failed."""
        if self.broken:
            raise PipelineError(f"{what}: this engine failed earlier ({self.broken}); build a new one")
        if self.messenger.closed and self.world_size > 1:
            raise PipelineError(f"{what}: this engine was closed (close()); call it before close()")
        return self.group if self.world_size > 1 else None

    def _dcp_group(self) -> object:
        if self.messenger.closed and self.world_size > 1:
            raise PipelineError("checkpoints: this engine was closed (close()); save or load before close()")
        if self.dp.size > 1:  # every replica saves the same keys; DCP keeps one copy of each
            return self.layout.everyone
        return self.group if dist.is_available() and dist.is_initialized() else None
