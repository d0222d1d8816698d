"""Run a pipeloom schedule on ``torch.distributed``: :func:`~pipeloom.runtime.pipeline` builds a
:class:`PipelineEngine` whose ``step`` trains one batch and returns the loss on every rank, exactly as
one device would.

Every rank builds the same model and calls the same ``step``; the engine keeps the stages its rank
holds, lowers the compute schedule (receives posted early in each sender's order, sends after each
action), runs F, B, I and W with autograd, and hands values between stages of one rank in memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.threads import close_at_exit
from pipeloom.runtime.comm.watch import closed_by, mark_closed
from pipeloom.runtime.errors import PipelineError, ReplicaBufferError, StepMismatchError
from pipeloom.runtime.model.split import StagedModel
from pipeloom.runtime.parallel.dp import GradientBuckets, Layout
from pipeloom.runtime.parallel.ep import expert_groups
from pipeloom.runtime.parallel.fsdp import ShardedGradients
from pipeloom.runtime.parallel.scatter import Traffic
from pipeloom.runtime.parallel.tp import captured_parameters, changed_parameter
from pipeloom.runtime.setup import default_store, shared_run_id
from pipeloom.runtime.state import state_dict as state
from pipeloom.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from pipeloom.runtime.state.clip import clip_grad_norm_
from pipeloom.runtime.state.state_dict import LoadResult, ModelNames
from pipeloom.runtime.step.agree import agree_on_step
from pipeloom.runtime.step.batch import BatchCut, batch_rows, signature
from pipeloom.runtime.step.failure import broken_off, mesh_failure_scope, tp_shape_hint
from pipeloom.runtime.step.loss import LossSum
from pipeloom.runtime.step.pieces import RankPieces
from pipeloom.runtime.step.replicas import data_parallel_outputs, diverged_buffers, replica_outputs
from pipeloom.runtime.step.run import StepRun
from pipeloom.runtime.step.timing import ActionClock

if TYPE_CHECKING:
    from pipeloom.runtime.parallel.tp_auto import AutoSharding
    from pipeloom.runtime.plan_file import PlannedBatch

from pipeloom.trace.format import rank_file, step_record, trace_document, write_trace_file

__all__ = ["PipelineEngine"]

class PipelineEngine:
    """Runs one lowered schedule on this rank; see :func:`pipeline`."""

    def __init__(self, *, staged: StagedModel, pieces: RankPieces, layout: Layout, trace: str | Path | bool | None,
                 timeout: float, names: ModelNames, scatter_boundaries: bool = True,
                 tp_sharding: AutoSharding | None = None, overlap_pairs: bool = False,
                 planned_batch: PlannedBatch | None = None) -> None:
        """Built by :func:`~pipeloom.runtime.pipeline`, which has put this rank's pieces on their device."""
        self.staged = staged
        self.pieces = pieces
        self.lowering = lowering = pieces.lowering
        self.schedule = lowering.schedule
        self.loss_fn = pieces.loss_fn
        self.layout = layout
        self.rank = rank = layout.rank
        self.world_size = layout.world
        self.group = group = layout.group
        self.dp = layout.dp
        self.sharded = pieces.sharded  # pieces sharded over "dp" with FSDP2
        self.timeout = timeout
        self.device = pieces.device
        self.local_stages = lowering.stages_on(rank)
        self.modules = dict(pieces.modules)
        self.shared = pieces.shared
        self.seed = pieces.seed
        self.params = pieces.trainable()
        self._captured = captured_parameters(self.modules)  # identities: a model rewrapped later is refused
        self.tracing = trace is not None and trace is not False
        self.trace_dir = Path(trace) if isinstance(trace, (str, Path)) else None
        self.trace_steps: list[dict] = []
        self.clock = ActionClock(self.device)  # action times of traced steps (CUDA events on a GPU)
        self.broken: str | None = None
        self.overlap_pairs = overlap_pairs  # overlapped pairs run interleaved at their collectives
        self.tp_sharding = tp_sharding  # tp_plan="auto": the chosen plan and its prediction
        self.planned_batch = planned_batch  # pipeline(plan=): a training step on another batch size is told
        self._meta_cache: dict[tuple, tuple[dict, dict]] = {}  # per step signature(): what its first step learned
        self.batch = BatchCut(total=pieces.total_microbatches, replicas=layout.dp.size, replica=layout.dp.rank,
                              device=self.device)
        store, run_id = None, "local"
        if layout.everyone_size > 1:
            assert layout.everyone is not None  # several ranks have their group
            store = default_store()
            run_id = shared_run_id(layout.everyone, dist.get_rank(layout.everyone))
        self.messenger = Messenger(
            rank=rank, group=group, to_global=(lambda r: dist.get_global_rank(group, r)) if group is not None
            else (lambda r: r), device=self.device, timeout=timeout, units=lowering.units,
            pair_order=lowering.pair_order, unit_of=lowering.unit_of, store=store, run_id=run_id,
            scope=mesh_failure_scope(layout), tp=layout.tp, scatter=scatter_boundaries,
        )
        self.traffic = Traffic()  # bytes the last step moved between stages (pipeloom.runtime.parallel.scatter)
        last = lowering.num_pieces - 1
        self.loss_sum = LossSum(layout=layout, messenger=self.messenger, num_microbatches=pieces.num_microbatches,
                                device=self.device, loss_ranks=len(
                                    {lowering.rank_of[lowering.stage_for[j][last]] for j in range(lowering.replicas)}))
        self._step_count = 0
        close_at_exit(self)
        self.training_steps = 0  # training steps run: part of every forward's random seed
        self._checked = False  # replicas: the first training step's buffers checked (diverged_buffers)
        self.training = True
        self.names = names  # the original model's names of the pieces' tensors (manual mode: stages.{k}.{name})

    # ------------------------------------------------------------------------------ public API

    @property
    def split(self) -> bool:
        """Whether the model is cut into its stages: always, except for an engine split at its first step
        (:class:`~pipeloom.runtime.first_step.FirstStepEngine`) before that step."""
        return True

    @property
    def num_microbatches(self) -> int:
        """Real micro-batches per step of this pipeline (of one data-parallel replica)."""
        return self.pieces.num_microbatches

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of the global batch: ``num_microbatches`` × the data-parallel replicas."""
        return self.pieces.total_microbatches

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
        loss = self._run(inputs, target, training=True)[0]
        assert loss is not None  # a training step has a target (BatchCut.step_inputs refuses one without)
        return loss

    def eval_step(self, inputs: object, *, target: object = None) -> object:
        """Forward only, without autograd. With ``target``: the loss, on every rank. Without: the model
        outputs of the whole batch (concatenated over micro-batches when a tensor; with replicas, every replica's
        gathered) on the rank(s) holding the last piece, None elsewhere."""
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

    def _run(self, inputs: object, target: object, *, training: bool) -> tuple[torch.Tensor | None, object]:
        self._check_parameters()
        self.params = self.pieces.trainable()  # requires_grad may have changed since the last step
        trained = self._agree(inputs, target, training)  # every rank's digest of them: a piece frozen since the
        # last step sends values without gradients, learnt anew
        chunks, targets = self.batch.step_inputs(inputs, target, training, self.staged.graph.input_names)
        if training and self.planned_batch is not None and self.rank == 0 and self._first_pipeline:
            self.planned_batch.check(inputs)  # one rank says it, every step: replicas' shares may hide a new size
        shapes = (signature(chunks, targets, training), trained)
        cached = self._meta_cache.get(shapes)
        if cached is None:  # new sizes: refused here, before anything ran, when the trace does not hold for them
            self._check_sizes(inputs)
        metas, specs = (cached if cached is not None else ({}, {}))
        events: list | None = [] if self.tracing else None
        if events is not None:
            self.clock.begin()
        step_start = time.time_ns()
        buckets = self._gradient_reduction() if training else None
        try:  # posts the replica-gradient receives: a failure there breaks the engine like any other
            run = StepRun(self.pieces, self.messenger, chunks, targets, training=training, params=self.params,
                          step_index=self.training_steps, metas=metas, specs=specs, discover=cached is None,
                          events=events, clock=self.clock, buckets=buckets, overlap=self.overlap_pairs)
        except Exception as error:
            self._fail(f"rank {self.rank}: starting the step failed: {type(error).__name__}: {error}", error)
        try:
            with torch.enable_grad() if training else torch.no_grad():
                run.execute()
            loss = self._settle(run, buckets, events)
        except PipelineError as error:
            self._fail(str(error), error, alone=True)
        except Exception as error:
            cause = broken_off(error, self.messenger)
            self._fail(run.describe_failure(error, cause) + tp_shape_hint(error, self.layout.tp.size), error,
                       alone=True)
        if training and not self._checked:
            self._check_buffers()
        gathered = not training and target is None and self._gather_outputs(run)  # as one device returns them
        if cached is None:
            self._meta_cache[shapes] = (metas, specs)
        self.traffic = run.messages.traffic
        if events is not None:
            self.clock.resolve(events)
            self._write_trace(step_start, time.time_ns(), events)
        self._step_count += 1
        self.training_steps += training
        count = self.total_microbatches if gathered and self.dp.size > 1 else self.num_microbatches
        return loss, run.outputs(count, batch_rows(inputs, count) if gathered else None)

    def _check_buffers(self) -> None:
        """After the first training step (a model whose training forward changes its buffers does so then): refuse
        buffers that the replicas of a piece, a two-replica schedule's or the data-parallel ones, changed apart. A
        failure breaks the engine (on every rank)."""
        self._checked = True
        wait = self.messenger.wait_work
        try:
            if self.lowering.replicas > 1 and self.layout.group is not None:
                diverged = diverged_buffers(self.modules, self.lowering, self.layout.group, self.layout.world,
                                            self.rank, self.device, wait)
                if diverged:
                    raise ReplicaBufferError(diverged)
            if self.dp.size > 1:
                assert self.dp.group is not None  # replicas have their group
                diverged = diverged_buffers(self.modules, self.lowering, self.dp.group, self.dp.size, self.dp.rank,
                                            self.device, wait, data_parallel=self.dp.size)
                if diverged:
                    raise ReplicaBufferError(diverged)
        except PipelineError as error:
            self._fail(str(error), error)

    def _gather_outputs(self, run: StepRun) -> bool:
        """After an eval step without a target: the other replicas' model outputs (a two-replica schedule's, the
        data-parallel ones') joined with this rank's, where it holds some; whether there are other replicas."""
        wait = self.messenger.wait_work
        try:
            if self.lowering.replicas > 1 and self.layout.group is not None:
                run.model_outputs = replica_outputs(run.model_outputs, self.layout.group, self.layout.world,
                                                    self.rank, self.device, wait)
            if self.dp.size > 1:
                assert self.dp.group is not None  # replicas have their group
                run.model_outputs = data_parallel_outputs(run.model_outputs, self.dp.group, self.dp.size,
                                                          self.dp.rank, self.num_microbatches, self.device, wait)
        except PipelineError as error:
            self._fail(str(error), error)
        return self.dp.size > 1 or (self.lowering.replicas > 1 and self.layout.group is not None)

    def _agree(self, inputs: object, target: object, training: bool) -> tuple[int, ...]:
        """Refuse a step on a broken or closed engine; every rank was given the same step (checked before
        any tensor moves, so a mismatch leaves the engine usable). Returns each rank's digest of the parameters
        its stages train (``self.params``)."""
        if self.broken:
            raise PipelineError(f"this engine failed earlier ({self.broken}); build a new one (and process group)")
        if self.messenger.closed:
            raise PipelineError("this engine was closed (close()); build a new one to take more steps")
        closed = next((why for group in self.layout.groups() if (why := closed_by(group))), None)
        if closed is not None:  # another engine's failure on these groups closed their connections
            self._fail(f"this engine's process group was closed by an engine that failed on it ({closed}); build a "
                       "new engine on a new group (see pipeline()'s refusal)", ConnectionError(closed))
        trains = str(hash(tuple((s, *map(id, ps)) for s, ps in sorted(self.params.items()))))  # this step's
        try:
            return agree_on_step(inputs, target, training=training, microbatches=self.num_microbatches,
                                 group=self.layout.everyone, world=self.layout.everyone_size, rank=self.rank,
                                 device=self.device, wait=self.messenger.wait_work, local=trains)
        except StepMismatchError:
            raise
        except PipelineError as error:
            self._fail(str(error), error)

    def _check_parameters(self) -> None:
        """Refuse a step when a stage's parameters are no longer the objects the engine captured (the model
        was parallelized or rewrapped after pipeline()): their gradients would silently stay empty."""
        if self.sharded or self.broken:  # FSDP2 swaps its own parameters; a broken engine says so in _agree
            return
        changed = changed_parameter(self.modules, self._captured)
        if changed is not None:
            stage, name = changed
            error = PipelineError(
                f"rank {self.rank}: parameter {name!r} of stage {stage} is not the object pipeline() captured (the "
                "model was changed after pipeline(), e.g. by parallelize_module), so its gradient would stay "
                "empty; pass tp_plan= to pipeline() (or change the model first) and build the engine again")
            self._fail(str(error), error)

    def _check_sizes(self, inputs: object) -> None:
        """Raise TracedSizeError when a micro-batch of the whole batch (every rank checks the same ones) breaks a
        size the model's torch.export trace fixed; the engine stays usable."""
        values = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        parts = [torch.chunk(v, self.total_microbatches, dim=0) for v in values]
        for micro in zip(*parts):
            self.staged.check_sizes(micro)

    def _gradient_reduction(self) -> GradientBuckets | ShardedGradients | None:
        """This training step's gradient handling over "dp" (begun), if the pieces have replicas."""
        buckets: GradientBuckets | ShardedGradients
        if self.sharded:
            buckets = ShardedGradients(self.modules)
        elif self.dp.size > 1:
            buckets = GradientBuckets(dp=self.dp, stage_params=self.params, late=self._late_params(),
                                      wait=self.messenger.wait_work, over=expert_groups(self.params, self.layout.ep))
        else:
            return None
        buckets.begin()
        return buckets

    def _settle(self, run: StepRun, buckets: GradientBuckets | ShardedGradients | None,
                events: list | None) -> torch.Tensor | None:
        """After the actions: sends complete, shared and replica gradients combined, the loss summed over
        ranks and the gradients over "dp"; returns the loss."""
        start = time.time_ns()
        run.messages.finish()
        if run.shared is not None:
            run.shared.exchange(self.messenger, self.device)
        if events is not None:
            events.append(("sends complete", "sync", start, time.time_ns()))
        loss = self.loss_sum.total(run.losses, events) if run.targets else None
        for name, settle in (("replica gradients merged", run.replicas and run.replicas.merge),
                             ("data-parallel gradients summed", buckets and buckets.finish)):
            if settle:
                start = time.time_ns()
                settle()
                if events is not None:
                    events.append((name, "sync", start, time.time_ns()))
        return loss

    def _fail(self, message: str, cause: Exception, *, alone: bool = False) -> NoReturn:
        """The engine is broken: leave the message where the other ranks look, and raise it (``cause``
        itself when it is already a PipelineError). ``alone``: a failure inside the step, which peers waiting on
        this rank hear of and answer by closing their connections (a new engine then needs a new group)."""
        where = self.layout.where()
        placed = bool(where) and where not in message  # on a "tp" mesh: the global rank and its mesh coordinates
        message = f"{where}: {message}" if placed else message
        self.broken = message
        self.messenger.report(message)
        if alone and self.layout.everyone_size > 1:  # the peers waiting on this rank close their connections
            mark_closed(self.messenger.closed_on_failure(), message.splitlines()[0][:300])
        if isinstance(cause, PipelineError) and not placed:
            raise cause
        raise PipelineError(message) from cause

    def _late_params(self) -> set[int]:
        """Parameters whose gradient is settled only at the end of the step (reduced over "dp" then):
        shared ones, and all of them on two-replica schedules."""
        if self.lowering.replicas > 1:
            return {id(p) for ps in self.params.values() for p in ps}
        return {id(p) for p in self.shared.params}

    # ------------------------------------------------------------------------------ trace

    @property
    def _first_pipeline(self) -> bool:
        """Whether this rank is in the job's first pipeline (replica 0, tp rank 0): the one that speaks for all."""
        return not (self.dp.rank or self.layout.tp.rank)

    def _write_trace(self, start: int, end: int, events: list) -> None:
        self.trace_steps.append(step_record(self._step_count, start, end, events))
        # one pipeline's files (each replica's pipeline rank r would write the same rank{r}.json, the replicas
        # overwriting each other's steps)
        if self.trace_dir is not None and self._first_pipeline:
            self.write_trace(rank_file(self.trace_dir, self.rank))

    def trace_document(self) -> dict:
        """This rank's recorded steps as a ``pipeloom.runtime-trace/1`` document (docs/trace.md)."""
        return trace_document(rank=self.rank, world_size=self.world_size, schedule=self.schedule,
                              steps=self.trace_steps)

    def write_trace(self, path: str | Path) -> None:
        """Write this rank's recorded steps (format ``pipeloom.runtime-trace/1``, see docs/trace.md)."""
        write_trace_file(self.trace_document(), path)

    # ------------------------------------------------------------------------------ training-loop helpers
    # (runtime/state/state_dict.py, clip.py, checkpoint.py; every rank calls the collective ones: clip_grad_norm_,
    # full_state_dict, checkpoints)

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
                                     wait=self.messenger.wait_work, gather_over=self.dp.mesh if self.sharded else None)

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

    def save_checkpoint(self, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping[str, object] | None = None) -> None:
        """Save the model (and ``optimizer``'s state, by parameter name) with ``torch.distributed.checkpoint``
        into the folder ``path``; every rank calls it. Any pipeline of the model, or one device, loads it.
        ``extra``: other objects of the training loop with ``state_dict()``/``load_state_dict()``, by name
        (``extra={"scheduler": scheduler}``), whose state is the same on every rank. The engine's training-step
        count and random seed are saved too: a resumed run draws the dropout masks the uninterrupted run would."""
        save_checkpoint(path, self.names, self._pieces(), optimizer=optimizer, group=self._dcp_group(),
                        counters={"training_steps": self.training_steps, "seed": self.seed}, extra=extra)

    def load_checkpoint(self, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
                        extra: Mapping[str, object] | None = None) -> None:
        """Load what :meth:`save_checkpoint` saved into this rank's tensors, ``optimizer`` and ``extra``'s
        objects (the names given when saving), and restore the training-step count and the random seed
        (the checkpoint's seed replaces the one this engine was built with)."""
        found = load_checkpoint(path, self.names, self._pieces(), optimizer=optimizer, group=self._dcp_group(),
                                counters={"training_steps": self.training_steps, "seed": self.seed}, extra=extra)
        self.training_steps = found["training_steps"]  # the next step draws the random numbers it would have
        self.seed = found["seed"]
        self.pieces = dataclasses.replace(self.pieces, seed=self.seed)  # what every forward is seeded from

    def _pieces(self) -> dict[int, nn.Module]:
        return {self.lowering.piece_of[s]: module for s, module in self.modules.items()}

    def _group_for(self, what: str) -> dist.ProcessGroup | None:
        """The group for a collective helper (None with one rank); refused once the engine failed."""
        if self.broken:
            raise PipelineError(f"{what}: this engine failed earlier ({self.broken}); build a new one")
        if self.messenger.closed and self.world_size > 1:
            raise PipelineError(f"{what}: this engine was closed (close()); call it before close()")
        return self.group if self.world_size > 1 else None

    def _dcp_group(self) -> dist.ProcessGroup | None:
        if self.messenger.closed and self.world_size > 1:
            raise PipelineError("checkpoints: this engine was closed (close()); save or load before close()")
        if self.dp.size > 1 or self.layout.tp.size > 1:  # replicas save the same keys (DCP keeps one copy of
            return self.layout.everyone  # each); "tp" ranks save their DTensor shards, as DCP writes them
        return self.group if dist.is_available() and dist.is_initialized() else None
