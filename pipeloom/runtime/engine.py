"""Run a pipeloom schedule on ``torch.distributed``: :func:`pipeline` builds a :class:`PipelineEngine`
whose ``step`` trains one batch and returns the loss on every rank, exactly as one device would.

Every rank builds the same model and calls the same ``step``; the engine keeps the stages its rank
holds, lowers the compute schedule (receives posted early in each sender's order, sends after each
action), runs F, B, I and W with autograd, and hands values between stages of one rank in memory.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.fx.node import map_aggregate

from pipeloom.ir import Schedule, load_schedule
from pipeloom.ir.json_io import schedule_to_json
from pipeloom.runtime.backward import PendingWeights, accumulate_grad, backward_full, backward_input
from pipeloom.runtime.comm import LeafMeta, Messenger, flatten, unflatten
from pipeloom.runtime.lower import MODEL_INPUT, Lowering, PipelineError, Step, Unit, lower
from pipeloom.runtime.split import StagedModel, ValueRef, check_stage_value, split_model, stages_from_modules
from pipeloom.schedules import build_schedule, schedule_info, schedule_names
from pipeloom.validate import validate

__all__ = ["PipelineEngine", "PipelineError", "pipeline"]

TRACE_ENV = "PIPELOOM_TRACE"
LOOKAHEAD = 2  # compute actions whose receives are posted ahead of time


def _world(process_group: object) -> tuple[int, int, object]:
    """(rank, world size, group) — a world of one when no process group exists."""
    if process_group is not None:
        return dist.get_rank(process_group), dist.get_world_size(process_group), process_group
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    return 0, 1, None


def _staged(model: nn.Module | None, split_points: Sequence[str] | None,
            stages: StagedModel | Sequence[nn.Module] | None) -> StagedModel:
    if stages is not None and split_points is not None:
        raise PipelineError("give split_points= or stages=, not both")
    if isinstance(stages, StagedModel):
        return stages
    if stages is not None:
        return stages_from_modules(list(stages))
    if split_points is None:
        raise PipelineError("say where to cut the model: split_points=['layers.4', ...] (module names where stages "
                            "1.. start) or stages=[module0, module1, ...]; split_points=[] runs it as one stage")
    if model is None:
        raise PipelineError("split_points needs the model; pass it as the first argument")
    return split_model(model, split_points)


def _resolve_schedule(schedule: object, *, num_ranks: int, num_pieces: int, microbatches: int | None,
                      options: dict) -> Schedule:
    """A Schedule from a built-in name, a Schedule, or a saved .json/.csv file."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, (str, Path)) and str(schedule) in schedule_names():
        name = str(schedule)
        if microbatches is None:
            raise PipelineError(f"schedule {name!r} is built here; say how many micro-batches: microbatches=8")
        info = schedule_info(name)
        options = dict(options)
        if "stages_per_rank" in info.options and "stages_per_rank" not in options:
            if num_pieces % num_ranks:
                raise PipelineError(f"{name} puts the same number of stages on every rank, but the model has "
                                    f"{num_pieces} pieces for {num_ranks} ranks; cut it into a multiple of {num_ranks}")
            options["stages_per_rank"] = num_pieces // num_ranks
        return build_schedule(name, num_ranks, microbatches, **options)  # two-replica ones pair them
    if isinstance(schedule, (str, Path)):
        path = Path(schedule)
        if path.suffix.lower() in (".json", ".csv") or path.exists():
            return load_schedule(path)
        names = ", ".join(schedule_names())
        raise PipelineError(f"schedule {str(schedule)!r} is neither a built-in ({names}) nor a .json/.csv file")
    raise PipelineError(f"schedule must be a built-in name, a pipeloom.Schedule or a file path, "
                        f"got {type(schedule).__name__}")


def _check_shared_parameters(staged: StagedModel) -> None:
    owner: dict[int, int] = {}
    for k, module in enumerate(staged.stages):
        for name, param in module.named_parameters():
            first = owner.setdefault(id(param), k)
            if first != k:
                raise PipelineError(
                    f"parameter {name!r} is used by model pieces {first} and {k}; the runtime needs every "
                    "parameter in one piece (tied weights): move the split points so both uses fall in one stage"
                )


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
    trace: str | Path | None = None,
    timeout: float = 60.0,
    plan: str | Path | None = None,
) -> PipelineEngine:
    """Build the engine that runs ``schedule`` over ``model`` cut into stages on this process group.

    ``schedule``: a built-in name (built for this world size, ``microbatches`` and the model's
    pieces), a :class:`~pipeloom.Schedule`, or a saved ``.json``/``.csv`` file. ``plan``: a plan file
    of ``pipeloom plan`` (split points, schedule and micro-batches; explicit arguments win).
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
    rank, world, group = _world(process_group)
    staged = _staged(model, split_points, stages)
    _check_shared_parameters(staged)
    sched = _resolve_schedule(schedule, num_ranks=world, num_pieces=staged.num_stages,
                              microbatches=microbatches, options=schedule_options or {})
    if sched.num_ranks != world:
        raise PipelineError(
            f"schedule {sched.name!r} is for {sched.num_ranks} ranks but this process group has {world}; launch "
            f"with `torchrun --nproc-per-node {sched.num_ranks}` or use a schedule for {world} ranks"
        )
    validate(sched, ordered=True, check_memory_limit=False)
    piece_inputs = [[(ref.stage, ref.index) for ref in spec.inputs] for spec in staged.graph.stages]
    outputs = [(ref.stage, ref.index) for ref in staged.graph.output_refs()]
    lowering = lower(sched, piece_inputs, outputs)
    if microbatches is not None and lowering.num_microbatches != microbatches:
        raise PipelineError(f"the schedule runs {lowering.num_microbatches} micro-batches per step, but "
                            f"microbatches={microbatches}; pass microbatches={lowering.num_microbatches} or rebuild it")
    trace = trace if trace is not None else os.environ.get(TRACE_ENV) or None
    return PipelineEngine(staged=staged, lowering=lowering, loss_fn=loss_fn, rank=rank, world_size=world,
                          group=group, device=device, trace=trace, timeout=float(timeout))


class PipelineEngine:
    """Runs one lowered schedule on this rank; see :func:`pipeline`."""

    def __init__(self, *, staged: StagedModel, lowering: Lowering, loss_fn: Callable, rank: int, world_size: int,
                 group: object, device: torch.device | str | None, trace: str | Path | None,
                 timeout: float) -> None:
        self.staged = staged
        self.lowering = lowering
        self.schedule = lowering.schedule
        self.loss_fn = loss_fn
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout = timeout
        backend = dist.get_backend(group) if group is not None else "gloo"
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self.local_stages = lowering.stages_on(rank)
        pieces = [lowering.piece_of[s] for s in self.local_stages]
        if len(set(pieces)) != len(pieces):
            raise PipelineError(f"rank {rank} holds two replicas of one model piece; put replicas on different ranks")
        self.modules = {s: staged.stages[lowering.piece_of[s]] for s in self.local_stages}
        for module in self.modules.values():
            module.to(self.device)
        self.params = {s: [p for p in module.parameters() if p.requires_grad] for s, module in self.modules.items()}
        self.program = lowering.programs[rank]
        self.eval_program = tuple(step for step in self.program if step.action.kind == "F")
        self.trace_dir = Path(trace) if trace is not None else None
        self.trace_steps: list[dict] = []
        self.broken: str | None = None
        self._meta_cache: dict[tuple, tuple[dict, dict]] = {}
        self._num_outputs = [spec.num_outputs for spec in staged.graph.stages]
        self._last_piece = lowering.num_pieces - 1
        store, run_id = None, "local"
        if world_size > 1:
            store = _default_store()
            run_id = _shared_run_id(group, rank)
        self.messenger = Messenger(
            rank=rank, group=group, to_global=(lambda r: dist.get_global_rank(group, r)) if group is not None
            else (lambda r: r), device=self.device, timeout=timeout, units=lowering.units,
            pair_order=lowering.pair_order, batch=backend == "nccl", store=store, run_id=run_id,
        )
        self.messenger.index_forward_units()
        self.unit_ids = {(u.kind, u.producer, u.consumer, u.microbatch): u.id for u in lowering.units}
        self._step_count = 0

    # ------------------------------------------------------------------------------ public API

    @property
    def num_microbatches(self) -> int:
        """Real micro-batches per step."""
        return self.lowering.num_microbatches

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
        loss, outputs = self._run(inputs, target, training=False)
        return loss if target is not None else outputs

    # ------------------------------------------------------------------------------ the step

    def _chunks(self, value: object, what: str) -> list[list]:
        """value -> per model input, its M micro-batches (a list of tensors)."""
        values = value if isinstance(value, (tuple, list)) else (value,)
        m = self.num_microbatches
        out = []
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                raise PipelineError(f"{what}[{i}] is {type(v).__name__}; step() takes tensors (or a tuple of tensors)")
            parts = list(torch.chunk(v.to(self.device), m, dim=0))
            if len(parts) != m:
                raise PipelineError(f"{what} has {v.shape[0] if v.dim() else 0} rows along dim 0, fewer than the "
                                    f"{m} micro-batches; use a batch of at least {m} (ideally a multiple)")
            out.append(parts)
        return out

    def _signature(self, chunks: list[list], targets: list[list], training: bool) -> tuple:
        return (training, tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in chunks),
                tuple(tuple((tuple(t.shape), t.dtype) for t in per) for per in targets))

    def _run(self, inputs: object, target: object, *, training: bool) -> tuple[torch.Tensor | None, object]:
        if self.broken:
            raise PipelineError(f"this engine failed earlier ({self.broken}); build a new one (and process group)")
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
        events: list | None = [] if self.trace_dir is not None else None
        step_start = time.time_ns()
        run = _StepRun(self, chunks, targets, training=training, metas=metas, specs=specs, events=events)
        self.messenger.begin(metas if cached is not None else None, specs, events=events,
                             unit_filter=run.wants)
        if self.messenger.discover:
            self.messenger.metas = metas  # filled while discovering; cached below
        try:
            with torch.enable_grad() if training else torch.no_grad():
                run.execute()
            self.messenger.finish()
            loss = self._reduce_loss(run.losses, targets, events)
            if training:
                self._merge_replicas(run)
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
            self._write_trace(step_start, time.time_ns(), events)
        self._step_count += 1
        return loss, run.outputs()

    def _reduce_loss(self, losses: dict[int, torch.Tensor], targets: list, events: list | None) -> torch.Tensor | None:
        """Sum of the micro-batch losses in micro-batch order, the same on every rank."""
        if not targets:
            return None
        m = self.num_microbatches
        sample = next(iter(losses.values()), None)
        dtype = sample.dtype if sample is not None else torch.float32
        vector = torch.zeros(m, dtype=dtype, device=self.device)
        for mb, value in losses.items():
            vector[mb] = value
        if self.world_size > 1:
            start = time.time_ns()
            if sample is None:  # agree on the dtype: ranks without a loss use float32; cast after
                vector = vector.to(torch.float64)
            else:
                vector = vector.to(torch.float64) if dtype != torch.float64 else vector
            work = dist.all_reduce(vector, group=self.group, async_op=True)
            try:
                work.wait(timeout=_timedelta(self.timeout))
            except Exception as error:
                raise PipelineError(f"rank {self.rank}: summing the loss across ranks failed: {error}; "
                                    f"{self.messenger.any_error() or 'another rank failed or hung'}") from error
            if events is not None:
                events.append(("loss all-reduce", "sync", start, time.time_ns()))
            vector = vector.to(dtype) if sample is not None else vector.to(torch.float32)
        total = vector[0]
        for mb in range(1, m):
            total = total + vector[mb]
        return total

    def _merge_replicas(self, run: _StepRun) -> None:
        """Two-replica schedules: add each piece's micro-batch gradients in micro-batch order on the
        first replica's rank, and give both replicas the same result.

        The second replica sends all its micro-batch gradients of a piece at once (a presence mask and
        one flat buffer per dtype); the first adds everything in micro-batch order and sends the sums
        back the same way. Pieces go in index order on every rank, so the exchanges pair up.
        """
        if self.lowering.replicas == 1:
            return
        low = self.lowering
        sends: list = []
        for piece in range(low.num_pieces):
            stages = [low.stage_for[j][piece] for j in range(low.replicas)]
            ranks = [low.rank_of[s] for s in stages]
            if self.rank not in ranks:
                continue
            owner = ranks[0]
            mine = [s for s in stages if low.rank_of[s] == self.rank]
            params = self.params[mine[0]]
            contributions: dict[int, list] = {}
            for s in mine:
                contributions.update(run.replica_grads.get(s, {}))
            tag = self._REPLICA_TAG + 4 * piece
            if self.rank == owner:
                for j, other in enumerate(ranks):
                    if other == self.rank:
                        continue
                    mbs = [low.replicas * m + j for m in range(low.schedule.num_microbatches)]
                    grads = self._receive_packed(other, params * len(mbs), tag)
                    for k, mb in enumerate(mbs):
                        contributions[mb] = grads[k * len(params):(k + 1) * len(params)]
                for mb in sorted(contributions):
                    for param, grad in zip(params, contributions[mb]):
                        if grad is not None:
                            accumulate_grad(param, grad)
                for other in sorted(set(ranks) - {self.rank}):
                    sends += self._send_packed(other, [p.grad for p in params], tag + 2)
            else:
                flat = [g for mb in sorted(contributions) for g in contributions[mb]]
                sends += self._send_packed(owner, flat, tag)
                for param, grad in zip(params, self._receive_packed(owner, params, tag + 2)):
                    param.grad = None if grad is None else grad.clone()
        for work, peer in sends:
            self._wait_replica(work, peer)

    _REPLICA_TAG = 1 << 24

    def _wait_replica(self, work, peer: int) -> None:
        try:
            work.wait(timeout=_timedelta(self.timeout))
        except Exception as error:
            raise PipelineError(f"rank {self.rank}: exchanging replica gradients with rank {peer} failed: {error}; "
                                f"{self.messenger.peer_error(peer) or 'it failed or hung'}") from error

    def _send_packed(self, peer: int, grads: list, tag: int) -> list:
        """Post the sends of ``grads`` (None where absent) as a mask and one flat buffer per dtype."""
        mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=self.device)
        by_dtype: dict[torch.dtype, list] = {}
        for grad in grads:
            if grad is not None:
                by_dtype.setdefault(grad.dtype, []).append(grad.reshape(-1))
        global_peer = dist.get_global_rank(self.group, peer)
        works = [(dist.isend(mask, global_peer, group=self.group, tag=tag), peer)]
        works += [(dist.isend(torch.cat(parts), global_peer, group=self.group, tag=tag + 1), peer)
                  for parts in by_dtype.values()]
        return works

    def _receive_packed(self, peer: int, templates: list, tag: int) -> list:
        """Receive what :meth:`_send_packed` sent for tensors shaped like ``templates``."""
        global_peer = dist.get_global_rank(self.group, peer)
        mask = torch.empty(len(templates), dtype=torch.uint8, device=self.device)
        self._wait_replica(dist.irecv(mask, global_peer, group=self.group, tag=tag), peer)
        present = mask.tolist()
        sizes: dict[torch.dtype, int] = {}
        for template, here in zip(templates, present):
            if here:
                sizes[template.dtype] = sizes.get(template.dtype, 0) + template.numel()
        buffers = {}
        for dtype, size in sizes.items():
            buffers[dtype] = torch.empty(size, dtype=dtype, device=self.device)
            self._wait_replica(dist.irecv(buffers[dtype], global_peer, group=self.group, tag=tag + 1), peer)
        offsets = dict.fromkeys(sizes, 0)
        grads = []
        for template, here in zip(templates, present):
            if not here:
                grads.append(None)
                continue
            start = offsets[template.dtype]
            offsets[template.dtype] = start + template.numel()
            grads.append(buffers[template.dtype][start:start + template.numel()].view(template.shape))
        return grads

    # ------------------------------------------------------------------------------ trace

    def _write_trace(self, start: int, end: int, events: list) -> None:
        self.trace_steps.append({
            "step": self._step_count, "start_ns": start, "end_ns": end,
            "events": [{"name": n, "kind": k, "start_ns": a, "end_ns": b} for n, k, a, b in events],
        })
        self.write_trace(self.trace_dir / f"rank{self.rank}.json")

    def write_trace(self, path: str | Path) -> None:
        """Write this rank's recorded steps (format ``pipeloom.runtime-trace/1``, see docs/trace.md)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "format": "pipeloom.runtime-trace/1", "rank": self.rank, "world_size": self.world_size,
            "clock": "unix_ns", "schedule": json.loads(schedule_to_json(self.schedule)),
            "steps": self.trace_steps,
        }
        path.write_text(json.dumps(document))


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _default_store() -> object:
    """The process group's key-value store, used only to pass failure messages (None if unreachable)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (private API: without it failures still surface through timeouts)
        return None


def _shared_run_id(group: object, rank: int) -> str:
    """One id for this engine on every rank (rank 0's, broadcast), so failure keys never collide."""
    mine = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    backend = dist.get_backend(group)
    tensor = mine.cuda() if backend == "nccl" else mine
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return bytes(tensor.cpu().tolist()).hex()


class _StepRun:
    """The state of one step on one rank: values, leaves, gradients and pending weight work."""

    def __init__(self, engine: PipelineEngine, chunks: list, targets: list, *, training: bool,
                 metas: dict, specs: dict, events: list | None) -> None:
        self.engine = engine
        self.low = engine.lowering
        self.chunks = chunks
        self.targets = targets
        self.training = training
        self.metas = metas
        self.specs = specs
        self.events = events
        self.values: dict[tuple[int, int], list] = {}  # (stage, mb) -> output values
        self.leaves: dict[tuple[int, int], list] = {}  # (stage, mb) -> [(leaf, producer, index, position)]
        self.grads: dict[tuple[int, int], dict] = {}  # (stage, mb) -> {index: {position: [gradients]}}
        self.pending: dict[tuple[int, int], PendingWeights] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.model_outputs: dict[int, object] = {}
        self.received: dict[int, list] = {}
        self.replica_grads: dict[int, dict[int, list]] = defaultdict(dict)
        self.current: Step | None = None
        self.outbox: list[tuple[Unit, list, list | None]] = []  # sends of the running action

    def wants(self, unit: Unit) -> bool:
        """Which incoming units this run receives (forward only when not training)."""
        return self.training or unit.kind == "F"

    def describe_failure(self, error: Exception) -> str:
        step = self.current
        if step is None:
            return f"rank {self.engine.rank}: {type(error).__name__}: {error}"
        action = step.action
        return (f"rank {self.engine.rank}: stage {action.stage} (model piece {step.piece}) failed in action "
                f"{action} (micro-batch {step.microbatch}): {type(error).__name__}: {error}")

    def outputs(self) -> object:
        if not self.model_outputs:
            return None
        values = [self.model_outputs[mb] for mb in sorted(self.model_outputs)]
        if len(values) == self.low.num_microbatches and all(isinstance(v, torch.Tensor) for v in values):
            return torch.cat(values, dim=0)
        return values

    def execute(self) -> None:
        engine = self.engine
        program = engine.program if self.training else engine.eval_program
        messenger = engine.messenger
        self._post_ahead(program, 0)
        for t, step in enumerate(program):
            self.current = step
            kind = step.action.kind
            if kind == "F":  # receive first, so an action's time holds no waiting
                for uid in step.recvs:
                    if uid not in self.received:
                        self.received[uid] = messenger.receive(uid)
            elif kind in ("B", "I"):
                self._collect_remote(step)
            start = time.time_ns() if self.events is not None else 0
            if kind == "F":
                self.forward(step)
            elif kind in ("B", "I"):
                self.backward(step)
            elif kind == "W":
                self.weight(step)
            for unit, tensors, specs in self.outbox:
                messenger.send(unit, tensors, specs)
            self.outbox.clear()
            self._post_ahead(program, t + 1)
            if self.events is not None:  # compute plus this action's own sends and bookkeeping
                self.events.append((str(step.action), "compute", start, time.time_ns()))
        self.current = None

    def _post_ahead(self, program: tuple[Step, ...], first: int) -> None:
        """Post the receives of the next few actions (and, per sender, every earlier one)."""
        messenger = self.engine.messenger
        if messenger.discover:
            return
        for ahead in program[first:first + LOOKAHEAD + 1]:
            for uid in ahead.recvs:
                if self.wants(self.low.units[uid]):
                    messenger.post_through(uid)

    # --------------------------------------------------------------------------- value routing

    def _fetch(self, stage: int, producer: int, index: int, mb: int) -> tuple[list, object, list[bool]]:
        """Leaves, structure and requires-grad flags of output ``index`` of ``producer`` for ``mb``."""
        low = self.low
        if low.rank_of[producer] == self.engine.rank:
            value = self.values[(producer, mb)][index]
            check_stage_value(value, name=f"output {index}", where=f"from stage {producer} to stage {stage}")
            leaves, spec = flatten(value)
            return leaves, spec, [t.requires_grad for t in leaves]
        uid = self.engine.unit_ids[("F", producer, stage, mb)]
        if uid not in self.received:
            self.received[uid] = self.engine.messenger.receive(uid)
        unit = low.units[uid]
        leaves, metas, specs = self.received[uid], self.metas[uid], self.specs[uid]
        offset = 0
        for i, spec in zip(unit.indices, specs):
            count = _count(spec)
            if i == index:
                flags = [m.requires_grad for m in metas[offset:offset + count]]
                return leaves[offset:offset + count], spec, flags
            offset += count
        raise AssertionError((uid, index))

    def forward(self, step: Step) -> None:
        engine, low = self.engine, self.low
        s, mb = step.action.stage, step.microbatch
        leaves: list = []
        args = []
        for producer, index, _ in low.sources[s]:
            if producer == MODEL_INPUT:
                args.append(self.chunks[index][mb])
                continue
            args.append(self._leaf_value(s, producer, index, mb, leaves))
        module = engine.modules[s]
        result = module(*args)
        piece = low.piece_of[s]
        outs = [result] if engine._num_outputs[piece] == 1 else list(result)
        self.values[(s, mb)] = outs
        for uid in step.sends:
            self._send_forward(low.units[uid], outs)
        if piece == engine._last_piece:
            output = self._model_output(s, mb, outs, leaves)
            if self.targets:
                loss = engine.loss_fn(output, _pick(self.targets, mb)) / low.num_microbatches
                self.losses[mb] = loss.detach()
                if self.training:
                    self.values[(s, mb)] = outs + [loss]
            if not self.training:
                self.model_outputs[mb] = output
        if self.training:
            self.leaves[(s, mb)] = leaves
        for uid in step.recvs:
            self.received.pop(uid, None)

    def _leaf_value(self, s: int, producer: int, index: int, mb: int, leaves: list) -> object:
        found, spec, flags = self._fetch(s, producer, index, mb)
        detached = []
        for position, (tensor, flag) in enumerate(zip(found, flags)):
            leaf = tensor.detach()
            if self.training and flag:
                leaf.requires_grad_()
                leaves.append((leaf, producer, index, position))
            detached.append(leaf)
        return unflatten(detached, spec)

    def _model_output(self, s: int, mb: int, outs: list, leaves: list) -> object:
        piece = self.low.piece_of[s]
        stage_for = self.low.stage_for[self.low.replica_of[s]]

        def resolve(ref: object) -> object:
            if not isinstance(ref, ValueRef):
                return ref
            if ref.stage == MODEL_INPUT:
                return self.chunks[ref.index][mb]
            if ref.stage == piece:
                return outs[ref.index]
            return self._leaf_value(s, stage_for[ref.stage], ref.index, mb, leaves)

        return map_aggregate(self.engine.staged.graph.output, resolve)

    def _send_forward(self, unit: Unit, outs: list) -> None:
        leaves: list = []
        specs = []
        for i in unit.indices:
            check_stage_value(outs[i], name=f"output {i}", where=f"from stage {unit.producer} to stage {unit.consumer}")
            found, spec = flatten(outs[i])
            leaves.extend(found)
            specs.append(spec)
        metas = [LeafMeta.of(t) for t in leaves]
        known = self.metas.get(unit.id)
        if known is not None and not self.engine.messenger.discover:
            if known != metas:
                theirs = ", ".join(m.describe() for m in known)
                ours = ", ".join(m.describe() for m in metas)
                raise PipelineError(
                    f"stage {unit.producer} (rank {unit.src}) produced [{ours}] for micro-batch {unit.microbatch}, "
                    f"but stage {unit.consumer} (rank {unit.dst}) expects [{theirs}] as in the first step with these "
                    "input shapes; a stage's output shapes must follow from the input shapes"
                )
        else:
            self.metas[unit.id] = metas
            self.specs[unit.id] = specs
        self.outbox.append((unit, leaves, specs))

    # ------------------------------------------------------------------------------- backward

    def _roots(self, s: int, mb: int) -> tuple[list, list]:
        """Outputs of (s, mb) with the summed gradients their consumers sent back."""
        outs = self.values.pop((s, mb))
        roots, grads = [], []
        piece = self.low.piece_of[s]
        if piece == self.engine._last_piece and self.targets:
            loss = outs.pop()
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        contributions = self.grads.pop((s, mb), {})
        for index, per_leaf in sorted(contributions.items()):
            leaves, _ = flatten(outs[index])
            for position, parts in sorted(per_leaf.items()):
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                roots.append(leaves[position])
                grads.append(total)
        return roots, grads

    def _collect_remote(self, step: Step) -> None:
        """Receive the gradient units this backward needs into the contribution table."""
        s, mb = step.action.stage, step.microbatch
        for uid in step.recvs:
            unit = self.low.units[uid]
            buffers = self.engine.messenger.receive(uid)
            forward = self.engine.messenger.forward_of(unit)
            metas, specs = self.metas[forward], self.specs[forward]
            k = 0
            offset = 0
            for index, spec in zip(unit.indices, specs):
                for position in range(_count(spec)):
                    if metas[offset + position].requires_grad:
                        _add(self.grads, (s, mb), index, position, buffers[k])
                        k += 1
                offset += _count(spec)

    def backward(self, step: Step) -> None:
        engine, low = self.engine, self.low
        s, mb = step.action.stage, step.microbatch
        roots, grads = self._roots(s, mb)
        entries = self.leaves.pop((s, mb))
        inputs = [leaf for leaf, *_ in entries]
        replicated = low.replicas > 1
        saved = self._swap_out(s) if replicated and step.action.kind == "B" else None
        if step.action.kind == "B":
            found = backward_full(roots, grads, inputs)
        else:
            found, pending = backward_input(roots, grads, inputs, engine.params[s])
            self.pending[(s, mb)] = pending
        if saved is not None:
            self._swap_in(s, mb, saved)
        self._route_input_grads(step, entries, found)

    def weight(self, step: Step) -> None:
        s, mb = step.action.stage, step.microbatch
        pending = self.pending.pop((s, mb))
        saved = self._swap_out(s) if self.low.replicas > 1 else None
        pending.weight()
        if saved is not None:
            self._swap_in(s, mb, saved)

    def _swap_out(self, s: int) -> list:
        params = self.engine.params[s]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        return saved

    def _swap_in(self, s: int, mb: int, saved: list) -> None:
        params = self.engine.params[s]
        self.replica_grads[s][mb] = [p.grad for p in params]
        for p, g in zip(params, saved):
            p.grad = g

    def _route_input_grads(self, step: Step, entries: list, found: list) -> None:
        low, rank, mb = self.low, self.engine.rank, step.microbatch
        remote: dict[tuple[int, int, int], list] = defaultdict(list)
        for (leaf, producer, index, position), grad in zip(entries, found):
            if grad is None:
                continue
            if low.rank_of[producer] == rank:
                _add(self.grads, (producer, mb), index, position, grad)
            else:
                remote[(producer, index, position)].append(grad)
        for uid in step.sends:
            unit = low.units[uid]
            forward = self.engine.unit_ids[("F", unit.producer, unit.consumer, mb)]
            metas, specs = self.metas[forward], self.specs[forward]
            tensors = []
            offset = 0
            for index, spec in zip(unit.indices, specs):
                for position in range(_count(spec)):
                    meta = metas[offset + position]
                    if meta.requires_grad:
                        parts = remote.get((unit.producer, index, position))
                        if parts:
                            total = parts[0]
                            for part in parts[1:]:
                                total = total + part
                        else:
                            total = torch.zeros(meta.shape, dtype=meta.dtype, device=self.engine.device)
                        tensors.append(total)
                offset += _count(spec)
            self.outbox.append((unit, tensors, None))



def _add(table: dict, key: tuple[int, int], index: int, position: int, grad: torch.Tensor) -> None:
    """Record one consumer's gradient for leaf ``position`` of output ``index`` of ``key``."""
    table.setdefault(key, {}).setdefault(index, {}).setdefault(position, []).append(grad)


def _count(spec: object) -> int:
    if spec is None:
        return 1
    if spec[0] == "dict":
        return sum(_count(x) for x in spec[2])
    return sum(_count(x) for x in spec[1])


def _pick(per_input: list[list], mb: int) -> object:
    """The ``mb``-th micro-batch of a target given as one tensor or several."""
    if len(per_input) == 1:
        return per_input[0][mb]
    return tuple(parts[mb] for parts in per_input)
