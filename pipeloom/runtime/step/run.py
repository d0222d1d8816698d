"""One step on one rank: the values, input leaves, gradients and pending weight work of every
(stage, micro-batch), and the F, B, I and W actions that move them."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch.profiler import record_function

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.step_messages import LeafMeta, StepMessages
from pipeloom.runtime.errors import PipelineError, StageValueError
from pipeloom.runtime.model.split import ValueRef, check_stage_value
from pipeloom.runtime.parallel.tp import is_dtensor
from pipeloom.runtime.program import MODEL_INPUT, Step, Unit, forward_unit
from pipeloom.runtime.step.backward import PendingWeights, add_in_order, backward_full, backward_input
from pipeloom.runtime.step.batch import joined_outputs, part_rows
from pipeloom.runtime.step.loss import checked_loss
from pipeloom.runtime.step.pieces import RankPieces
from pipeloom.runtime.step.replicas import ReplicaExchange
from pipeloom.runtime.step.rng import seeded
from pipeloom.runtime.step.shared import SharedGradients, UseGradients
from pipeloom.runtime.step.timing import ActionClock

if TYPE_CHECKING:
    from pipeloom.runtime.parallel.dp import GradientBuckets
    from pipeloom.runtime.parallel.fsdp import ShardedGradients

__all__ = ["StepRun"]

class StepRun:
    """The state of one step on one rank: values, leaves, gradients and pending weight work."""

    def __init__(self, pieces: RankPieces, messenger: Messenger, chunks: list, targets: list, *, training: bool,
                 params: Mapping[int, list], step_index: int, metas: dict, specs: dict, discover: bool,
                 events: list | None, clock: ActionClock,
                 buckets: GradientBuckets | ShardedGradients | None = None, overlap: bool = False) -> None:
        self.pieces = pieces
        self.overlap = overlap  # run an overlapped pair's parts interleaved (pipeloom.runtime.parallel.overlap)
        self.low = pieces.lowering
        self.params = params  # local stage -> its trainable parameters this step
        self.step_index = step_index  # training steps taken before: part of every forward's seed
        self.clock = clock
        self.buckets = buckets  # the gradient reduction over "dp", posted stage by stage
        self.chunks = chunks
        self.targets = targets
        self.training = training
        self.metas = metas
        self.specs = specs
        self.events = events
        self.values: dict[tuple[int, int], list] = {}  # (stage, mb) -> output values
        self.leaves: dict[tuple[int, int], list] = {}  # (stage, mb) -> [(leaf, producer, index, position)]
        self.grads: dict[tuple[int, int], dict] = {}  # (stage, mb) -> {index: {position: [gradients]}}
        self.pending: dict[tuple[int, int], PendingWeights | None] = {}
        self.uses: dict[tuple[int, int], UseGradients] = {}  # (stage, mb) -> shared parameters' uses, apart
        self.losses: dict[int, torch.Tensor] = {}
        self.model_outputs: dict[int, object] = {}
        self.received: dict[int, list] = {}
        self.replicas = (ReplicaExchange(pieces, params, messenger) if training and self.low.replicas > 1
                         else None)
        self.shared = (SharedGradients(pieces.shared, self.low, pieces.rank, self.low.num_microbatches)
                       if training and pieces.shared.params else None)
        self.dtensor_loss = False  # loss_fn returned a DTensor (torch's loss_parallel)
        self.current: Step | None = None
        self.outbox: list[tuple[Unit, list, list | None]] = []  # sends of the running action
        self.messages: StepMessages = messenger.begin(metas, specs, discover=discover, events=events,
                                                      unit_filter=self.wants)

    def wants(self, unit: Unit) -> bool:
        """Which incoming units this run receives (forward only when not training)."""
        return self.training or unit.kind == "F"

    def describe_failure(self, error: Exception, cause: str | None = None) -> str:
        """This rank's failure in the action it ran; ``cause``: another rank's failure that broke a collective off
        inside it, said in place of the backend's error."""
        said = f"{type(error).__name__}: {error}"
        if cause:  # the backend's words after another rank's failure, which is what the user needs
            said = f"a collective broke off because {cause} (here: {said.splitlines()[0][:200]})"
        step = self.current
        if step is None:
            return f"rank {self.pieces.rank}: {said}"
        action = step.action
        return (f"rank {self.pieces.rank}: stage {action.stage} (model piece {step.piece}) failed in action "
                f"{action} (micro-batch {step.microbatch}): {said}")

    def outputs(self, microbatches: int, rows: list[set[int]] | None = None) -> object:
        """The model outputs of every micro-batch (``microbatches`` of them: with replicas' gathered, the whole
        batch's, whose ``rows`` the caller gives), joined as :func:`~pipeloom.runtime.step.batch.joined_outputs`
        joins them."""
        if not self.model_outputs:
            return None
        values = [self.model_outputs[mb] for mb in sorted(self.model_outputs)]
        cut = self.chunks[0] if self.chunks else []
        if rows is None and len(cut) == len(values):
            rows = part_rows(cut)
        return joined_outputs(values, microbatches, rows)

    def execute(self) -> None:
        pieces, messages, clock = self.pieces, self.messages, self.clock
        program = pieces.program if self.training else pieces.eval_program
        self._post_ahead(program, 0)
        profiling = torch._C._autograd._profiler_enabled()  # record_function costs ~15 us an action
        for t, step in enumerate(program):
            self.current = step
            if not step.closes_pair:  # receive first, so an action's time holds no waiting
                self._receive_inputs(step)
                if step.opens_pair:  # an overlapped pair receives both parts' messages first
                    self._receive_inputs(program[t + 1])
                start = clock.now() if self.events is not None else 0
            if step.closes_pair and self.overlap:
                pass  # ran with its forward part, interleaved
            elif step.opens_pair and self.overlap and self.training:
                from pipeloom.runtime.parallel.overlap import run_interleaved

                run_interleaved(partial(self._act, t, step), partial(self._act, t + 1, program[t + 1]))
                self.outbox.sort(key=lambda item: item[0].kind != "F")  # the forward's sends first, as in turn
            elif profiling:  # the action shows by name in the user's torch.profiler trace
                with record_function(f"pipeloom {step.action}"):
                    self._act(t, step)
            else:
                self._act(t, step)
            if self.buckets is not None and self.low.replicas == 1 and t in pieces.gradients_done:
                self.buckets.stage_done(step.action.stage)
            if step.opens_pair:  # its backward runs next; both parts' sends go after it
                continue
            for unit, tensors, specs in self.outbox:
                messages.send(unit, tensors, specs)
            self.outbox.clear()
            self._post_ahead(program, t + 1)
            if self.events is not None:  # compute plus this action's own sends and bookkeeping
                clock.record(self.events, str(step.pair or step.action), "compute", start)
        self.current = None

    def _receive_inputs(self, step: Step) -> None:
        """Receive what compute ``step`` needs from other ranks: values for F, gradients for B or I."""
        kind = step.action.kind
        if kind == "F":
            for uid in step.recvs:
                if uid not in self.received:
                    self.received[uid] = self.messages.receive(uid)
        elif kind in ("B", "I"):
            self._collect_remote(step)

    def _act(self, t: int, step: Step) -> None:
        """Run compute action ``t`` of the program."""
        kind = step.action.kind
        if kind == "F":
            self.forward(step)
        elif kind in ("B", "I"):
            self.backward(step, full=kind == "B" or (t in self.pieces.joined and self.events is None))
        elif kind == "W":
            self.weight(step)

    def _post_ahead(self, program: tuple[Step, ...], first: int) -> None:
        """Post the receives of the next few actions (and, per sender, every earlier one)."""
        messages = self.messages
        if messages.discover:
            return
        wanted: Sequence[int]
        if self.low.explicit_posts and self.training:  # a lowered schedule says where
            wanted = program[first].posts if first < len(program) else ()
        else:  # NCCL: none ahead (they would block sends)
            wanted = [uid for ahead in program[first:first + messages.lookahead + 1] for uid in ahead.recvs]
        for uid in wanted:
            if self.wants(self.low.units[uid]):
                messages.post_through(uid)
        messages.flush()

    # --------------------------------------------------------------------------- value routing

    def _fetch(self, stage: int, producer: int, index: int, mb: int) -> tuple[list, pytree.TreeSpec, list[LeafMeta]]:
        """Leaves, structure and metas of output ``index`` of ``producer`` for ``mb`` (a local value's
        DTensors stay DTensors; a received one's are rebuilt from its local tensor and its meta)."""
        low = self.low
        if low.rank_of[producer] == self.pieces.rank:
            leaves, spec = _leaves(self.values[(producer, mb)][index], index, producer, stage)
            return leaves, spec, [LeafMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in leaves]
        uid = low.unit_of[("F", producer, stage, mb)]
        if uid not in self.received:
            self.received[uid] = self.messages.receive(uid)
        unit = low.units[uid]
        leaves, metas, specs = self.received[uid], self.metas[uid], self.specs[uid]
        offset = 0
        for i, spec in zip(unit.indices, specs):
            count = spec.num_leaves
            if i == index:
                return leaves[offset:offset + count], spec, metas[offset:offset + count]
            offset += count
        raise AssertionError((uid, index))

    def forward(self, step: Step) -> None:
        pieces, low = self.pieces, self.low
        s, mb = step.action.stage, step.microbatch
        leaves: list = []
        args = []
        for producer, index in low.sources[s]:
            if producer == MODEL_INPUT:
                args.append(self.chunks[index][mb])
                continue
            args.append(self._leaf_value(s, producer, index, mb, leaves))
        module = pieces.modules[s]
        piece = low.piece_of[s]
        # micro-batches are numbered over the global batch
        with seeded(pieces.seed, self.step_index, piece, pieces.first_microbatch + mb, pieces.device):
            result = module(*args)
        outs = [result] if pieces.num_outputs[piece] == 1 else list(result)
        self.values[(s, mb)] = outs
        for uid in step.sends:
            self._send_forward(low.units[uid], outs)
        if piece == pieces.last_piece:
            output = self._model_output(s, mb, outs, leaves)
            if self.targets:
                loss = checked_loss(pieces.loss_fn(output, _pick(self.targets, mb)),
                                    training=self.training) / pieces.total_microbatches
                if is_dtensor(loss):  # loss_parallel: its backward runs under loss_parallel() too
                    self.dtensor_loss = True
                    self.losses[mb] = loss.detach().full_tensor()  # type: ignore[attr-defined]  # a DTensor
                else:
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
        found, spec, metas = self._fetch(s, producer, index, mb)
        detached = []
        for position, (tensor, meta) in enumerate(zip(found, metas)):
            leaf = tensor.detach()
            if self.training and meta.requires_grad:
                leaf.requires_grad_()
                leaves.append((leaf, producer, index, position))
            detached.append(self._rebuilt(leaf, meta) if meta.placements else leaf)
        return pytree.tree_unflatten(detached, spec)

    def _rebuilt(self, local: torch.Tensor, meta: LeafMeta) -> torch.Tensor:
        """A DTensor that crossed a boundary as its local tensor, on this rank's "tp" sub-mesh; its
        backward hands ``local`` the gradient in the forward's placements (what travels back)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.pieces.tp_mesh, meta.placements, run_check=False,
                                  shape=torch.Size(meta.global_shape), stride=meta.global_stride)

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

        return pytree.tree_map(resolve, self.pieces.output)

    def _send_forward(self, unit: Unit, outs: list) -> None:
        leaves: list = []
        specs = []
        for i in unit.indices:
            found, spec = _leaves(outs[i], i, unit.producer, unit.consumer)
            leaves.extend(found)
            specs.append(spec)
        for t in leaves:
            if is_dtensor(t) and (self.pieces.tp_mesh is None or t.device_mesh != self.pieces.tp_mesh):
                raise PipelineError(
                    f"stage {unit.producer} (rank {unit.src}) sends a DTensor on {t.device_mesh} to stage "
                    f"{unit.consumer} (rank {unit.dst}); only DTensors on the mesh's \"tp\" sub-mesh cross a stage "
                    "boundary (rebuilt there on the receiver's): return a plain tensor (use_local_output=True)")
        metas = [LeafMeta.of(t) for t in leaves]
        known = self.metas.get(unit.id)
        if known is not None and not self.messages.discover:
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
        if piece == self.pieces.last_piece and self.targets:
            loss = outs.pop()
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        contributions = self.grads.pop((s, mb), {})
        for index, per_leaf in sorted(contributions.items()):
            leaves = pytree.tree_leaves(outs[index])
            for position, parts in sorted(per_leaf.items()):
                grad = add_in_order(parts)
                root = leaves[position]
                if is_dtensor(root) and not is_dtensor(grad):  # its gradient came back as a local tensor
                    root = root.to_local()
                roots.append(root)
                grads.append(grad)
        return roots, grads

    def _collect_remote(self, step: Step) -> None:
        """Receive the gradient units this backward needs into the contribution table."""
        s, mb = step.action.stage, step.microbatch
        for uid in step.recvs:
            unit = self.low.units[uid]
            buffers = self.messages.receive(uid)
            forward = forward_unit(self.low.unit_of, unit)
            metas, specs = self.metas[forward], self.specs[forward]
            k = 0
            offset = 0
            for index, spec in zip(unit.indices, specs):
                for position in range(spec.num_leaves):
                    if metas[offset + position].requires_grad:
                        _add(self.grads, (s, mb), index, position, buffers[k])
                        k += 1
                offset += spec.num_leaves

    def backward(self, step: Step, *, full: bool) -> None:
        """B, or I; ``full``: the whole backward (B, or an I whose W comes next: that W does nothing)."""
        s, mb = step.action.stage, step.microbatch
        roots, grads = self._roots(s, mb)
        entries = self.leaves.pop((s, mb))
        inputs = [leaf for leaf, *_ in entries]
        if self.shared is not None and self.low.replicas == 1:  # uses a shared parameter's sum would group
            if (uses := self.shared.watch(self.low.piece_of[s], roots)) is not None:
                self.uses[(s, mb)] = uses
        saved = self._swap_out(s) if full else None
        with self._loss_parallel(s):
            if full:
                found = backward_full(roots, grads, inputs)
                if step.action.kind == "I":
                    self.pending[(s, mb)] = None  # its W, next, has nothing left to do
            else:
                found, pending = backward_input(roots, grads, inputs, self.pieces.weight_parameters(s, self.params))
                self.pending[(s, mb)] = pending
        if saved is not None:
            self._swap_in(s, mb, saved)
        self._route_input_grads(step, entries, found)

    def weight(self, step: Step) -> None:
        s, mb = step.action.stage, step.microbatch
        pending = self.pending.pop((s, mb))
        if pending is None:  # its I ran the whole backward
            return
        saved = self._swap_out(s)
        with self._loss_parallel(s):
            pending.weight()
        if saved is not None:
            self._swap_in(s, mb, saved)

    def _loss_parallel(self, s: int) -> contextlib.AbstractContextManager:
        """torch's ``loss_parallel()`` around the backward of the stage that computed a DTensor loss (its
        cross-entropy over class-sharded logits has a backward only inside that context)."""
        if self.dtensor_loss and self.low.piece_of[s] == self.pieces.last_piece:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _kept(self, s: int) -> list:
        """Parameters of stage ``s`` whose gradient actions' results are kept per micro-batch instead of
        added into ``.grad``: all of them on two-replica schedules, else the shared ones."""
        if self.low.replicas > 1:
            return self.params[s]
        if self.shared is None:
            return []
        params = self.shared.shared.params
        return [params[i] for i in self.shared.shared.of_piece(self.low.piece_of[s])]

    def _swap_out(self, s: int) -> list | None:
        params = self._kept(s)
        if not params:
            return None
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        return saved

    def _swap_in(self, s: int, mb: int, saved: list) -> None:
        params = self._kept(s)
        found = [p.grad for p in params]
        for p, g in zip(params, saved):
            p.grad = g
        low = self.low
        if low.replicas == 1:
            assert self.shared is not None  # _kept found shared parameters
            self.shared.collect_piece(low.piece_of[s], mb, found, self.uses.pop((s, mb), None))
            return
        assert self.replicas is not None  # a training step of a two-replica schedule
        self.replicas.collect(s, mb, found)

    def _route_input_grads(self, step: Step, entries: list, found: list) -> None:
        low, rank, mb = self.low, self.pieces.rank, step.microbatch
        remote: dict[tuple[int, int, int], list] = defaultdict(list)
        for (_leaf, producer, index, position), grad in zip(entries, found):
            if grad is None:
                continue
            if low.rank_of[producer] == rank:
                _add(self.grads, (producer, mb), index, position, grad)
            else:
                remote[(producer, index, position)].append(grad)
        for uid in step.sends:
            unit = low.units[uid]
            forward = forward_unit(low.unit_of, unit)
            metas, specs = self.metas[forward], self.specs[forward]
            tensors = []
            offset = 0
            for index, spec in zip(unit.indices, specs):
                for position in range(spec.num_leaves):
                    meta = metas[offset + position]
                    if meta.requires_grad:
                        parts = remote.get((unit.producer, index, position))
                        tensors.append(add_in_order(parts) if parts else
                                       torch.zeros(meta.shape, dtype=meta.dtype, device=self.pieces.device))
                offset += spec.num_leaves
            self.outbox.append((unit, tensors, None))



def _leaves(value: object, index: int, producer: int, consumer: int) -> tuple[list, pytree.TreeSpec]:
    """The tensor leaves of output ``index`` of ``producer`` and their structure (``torch.utils._pytree``);
    StageValueError, naming both stages, when it is not a tensor or a tuple/list/dict of them."""
    leaves, spec = pytree.tree_flatten(value)
    if leaves and all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return leaves, spec
    where = f"from stage {producer} to stage {consumer}"
    check_stage_value(value, name=f"output {index}", where=where)
    raise StageValueError(f"output {index} passed {where} holds no tensor; only tensors and tuples/lists/dicts "
                          "of tensors may cross a stage boundary")


def _add(table: dict, key: tuple[int, int], index: int, position: int, grad: torch.Tensor) -> None:
    """Record one consumer's gradient for leaf ``position`` of output ``index`` of ``key``."""
    table.setdefault(key, {}).setdefault(index, {}).setdefault(position, []).append(grad)


def _pick(per_input: list[list], mb: int) -> object:
    """The ``mb``-th micro-batch of a target given as one tensor or several."""
    if len(per_input) == 1:
        return per_input[0][mb]
    return tuple(parts[mb] for parts in per_input)
