"""Parameters used by several model pieces (tied embedding and LM head, a module reused across stages).

Every rank whose pieces use such a parameter holds it. On one device, autograd adds the uses' gradients
of one micro-batch first (the parameter's accumulator gets them in the order the backward reaches the
uses: the last use first) and then adds that sum into ``.grad``. The runtime does the same: each using
piece's gradient action leaves its contribution per micro-batch aside; once a micro-batch has every
contribution, they are added left to right (pieces in descending order; within a piece, its uses in the
order its backward reached them) and the sum into ``.grad``, micro-batches in order. The last using piece
gives the sum of its uses (autograd's own, the same first additions); every other piece using the
parameter more than once gives each use's gradient apart (:class:`UseGradients`), so that the additions
are grouped as one device's. Uses on other ranks are exchanged at the end of the step, so every holder
ends the step with the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.autograd.graph import Node

from pipeloom.runtime.comm.messenger import Messenger
from pipeloom.runtime.comm.packed import receive_packed, send_packed
from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.program import Lowering
from pipeloom.runtime.step.backward import accumulate_grad, add_in_order, grad_node

__all__ = ["SHARED_TAG", "SharedGradients", "SharedParameters", "UseGradients", "shared_parameters"]

SHARED_TAG = 1 << 25  # tags of the exchange, clear of the step's own messages and of the replicas'
_WHAT = "shared-parameter gradients"


@dataclass(frozen=True, slots=True)
class SharedParameters:
    """The parameters several pieces use, in one order every rank agrees on."""

    params: tuple[nn.Parameter, ...]  # every shared parameter of the model (meta or real), model order
    pieces: tuple[tuple[int, ...], ...]  # per parameter: the pieces using it, ascending
    names: tuple[str, ...]  # per parameter: a name for messages
    # per parameter and using piece (as in ``pieces``): how many gradients the piece gives per micro-batch,
    # its uses apart (> 1) or their sum (1); empty: 1 each
    uses: tuple[tuple[int, ...], ...] = ()

    def of_piece(self, piece: int) -> list[int]:
        """Indices of the shared parameters ``piece`` uses."""
        return [i for i, pieces in enumerate(self.pieces) if piece in pieces]

    def slots(self, index: int, piece: int) -> int:
        """How many gradients ``piece`` gives shared parameter ``index`` per micro-batch."""
        return self.uses[index][self.pieces[index].index(piece)] if self.uses else 1


def shared_parameters(stages: Sequence[nn.Module]) -> SharedParameters:
    """Parameters that more than one stage module uses (frozen ones too: a frozen parameter gets no
    gradient, and one unfrozen later is combined like the others), and how many uses each piece but the
    last using one keeps apart (:func:`_direct_uses`)."""
    users: dict[int, list[int]] = {}
    found: dict[int, tuple[nn.Parameter, str]] = {}
    for k, module in enumerate(stages):
        for name, param in module.named_parameters():
            if k not in users.setdefault(id(param), []):
                users[id(param)].append(k)
                found.setdefault(id(param), (param, name))
    keys = [key for key, pieces in users.items() if len(pieces) > 1]
    uses = tuple(tuple(1 if k == users[key][-1] else _direct_uses(stages[k], found[key][0]) for k in users[key])
                 for key in keys)
    return SharedParameters(params=tuple(found[k][0] for k in keys), pieces=tuple(tuple(users[k]) for k in keys),
                            names=tuple(found[k][1] for k in keys), uses=uses)


def _direct_uses(module: nn.Module, param: nn.Parameter) -> int:
    """How many times ``module``'s graph passes ``param`` to an operation (each such use gives the
    parameter's accumulator one gradient of its own); 1 when it is not a traced graph or when a module
    kept whole holds the parameter (its uses inside are summed by autograd there)."""
    if not isinstance(module, fx.GraphModule):
        return 1
    count = 0
    for node in module.graph.nodes:
        if node.op == "call_module" and any(p is param for p in module.get_submodule(str(node.target)).parameters()):
            return 1
        if node.op == "get_attr" and _attribute(module, str(node.target)) is param:
            count += sum(_occurrences(user, node) for user in node.users)
    return max(count, 1)


def _attribute(module: nn.Module, target: str) -> object:
    value: object = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _occurrences(user: fx.Node, node: fx.Node) -> int:
    """How many times ``node`` is among ``user``'s arguments."""
    count = 0

    def seen(argument: fx.Node) -> fx.Node:
        nonlocal count
        count += argument is node
        return argument

    fx.node.map_arg((user.args, user.kwargs), seen)
    return count


def check_placement(shared: SharedParameters, lowering: Lowering) -> None:
    """Two-replica schedules would need a parameter's uses combined across both replicas: refused."""
    if shared.params and lowering.replicas > 1:
        raise PipelineError(
            f"parameter {shared.names[0]!r} is used by model pieces {list(shared.pieces[0])}, and schedule "
            f"{lowering.schedule.name!r} runs two model replicas; shared parameters run with one-replica schedules "
            "(1f1b, zbv, interleaved-1f1b, ...): choose one, or move the split points so all uses fall in one piece"
        )


@dataclass(slots=True)
class SharedGradients:
    """One step's contributions of the shared parameters, combined in micro-batch order."""

    shared: SharedParameters
    lowering: Lowering
    rank: int
    num_microbatches: int
    # (parameter, micro-batch) -> piece -> its gradients (SharedParameters.slots of them, None where absent)
    parts: dict[tuple[int, int], dict[int, list[torch.Tensor | None]]] = field(default_factory=dict)
    next_mb: dict[int, int] = field(default_factory=dict)  # parameter -> first micro-batch not yet added
    ranks: tuple[list[int], ...] = field(init=False)  # per parameter: the ranks holding a piece using it

    def __post_init__(self) -> None:
        low = self.lowering
        self.ranks = tuple(sorted({low.rank_of[low.stage_for[0][k]] for k in pieces})
                           for pieces in self.shared.pieces)

    def holders(self, index: int) -> list[int]:
        """Ranks holding a piece that uses shared parameter ``index``."""
        return self.ranks[index]

    def local(self) -> list[int]:
        """Shared parameters this rank holds."""
        return [i for i in range(len(self.shared.params)) if self.rank in self.holders(i)]

    def collect(self, piece: int, mb: int, grads: dict[int, list[torch.Tensor | None]]) -> None:
        """Keep ``piece``'s contribution to each shared parameter (index -> its gradients, in the order they
        are added) for micro-batch ``mb``."""
        for index, grad in grads.items():
            self.parts.setdefault((index, mb), {})[piece] = grad
            if self.holders(index) == [self.rank]:
                self._add_ready(index)

    def watch(self, piece: int, roots: Sequence[torch.Tensor]) -> UseGradients | None:
        """Before a backward of ``piece`` from ``roots``: catch the uses of the shared parameters it gives
        apart (SharedParameters.slots > 1); None when it gives none apart (nothing is hooked)."""
        shared = self.shared
        wanted = {id(shared.params[i]): i for i in shared.of_piece(piece) if shared.slots(i, piece) > 1}
        if not wanted:
            return None
        uses = UseGradients(wanted)
        uses.watch([node for root in roots if (node := grad_node(root)) is not None])
        return uses

    def collect_piece(self, piece: int, mb: int, totals: Sequence[torch.Tensor | None],
                      uses: UseGradients | None) -> None:
        """Keep ``piece``'s contributions for ``mb`` after its gradient actions: ``totals`` (autograd's sum per
        shared parameter it uses, SharedParameters.of_piece order), or the uses ``watch`` caught apart."""
        contributions = {}
        for index, total in zip(self.shared.of_piece(piece), totals):
            slots = self.shared.slots(index, piece)
            contributions[index] = uses.finish(index, total, slots) if uses is not None and slots > 1 else [total]
        self.collect(piece, mb, contributions)

    def _add_ready(self, index: int) -> None:
        """Add every micro-batch whose contributions are all here, in micro-batch order."""
        mb = self.next_mb.get(index, 0)
        pieces = self.shared.pieces[index]
        while mb < self.num_microbatches and len(self.parts.get((index, mb), ())) == len(pieces):
            parts = self.parts.pop((index, mb))
            present = [part for k in sorted(pieces, reverse=True) for part in parts[k] if part is not None]
            if present:  # a lone part may be a view into a received buffer: keep a copy, not the buffer
                total = add_in_order(present) if len(present) > 1 else present[0].clone()
                accumulate_grad(self.shared.params[index], total)
            mb += 1
        self.next_mb[index] = mb

    def exchange(self, messenger: Messenger, device: torch.device) -> None:
        """Send this rank's contributions to every other holder, receive theirs, and add everything."""
        peers = sorted({r for i in self.local() for r in self.holders(i)} - {self.rank})
        sends: list = []
        for peer in peers:
            ours, templates = self._entries(self.rank, peer)
            theirs, their_templates = self._entries(peer, self.rank)
            tag = SHARED_TAG + 2 * min(self.rank, peer)
            if self.rank < peer:  # one order per pair, as NCCL matches in posting order
                sends += send_packed(messenger, peer, [self._part(*e) for e in ours], templates, tag, device)
                found = receive_packed(messenger, peer, their_templates, tag, device, what=_WHAT)
            else:
                found = receive_packed(messenger, peer, their_templates, tag, device, what=_WHAT)
                sends += send_packed(messenger, peer, [self._part(*e) for e in ours], templates, tag, device)
            for (index, mb, piece, use), grad in zip(theirs, found):
                slots = self.shared.slots(index, piece)
                self.parts.setdefault((index, mb), {}).setdefault(piece, [None] * slots)[use] = grad
        messenger.wait_posted(sends, "sending shared-parameter gradients")
        for index in self.local():
            self._add_ready(index)
            if self.next_mb.get(index, 0) != self.num_microbatches:
                raise PipelineError(f"rank {self.rank}: shared parameter {self.shared.names[index]!r} is missing "
                                    "gradients of some micro-batches (a pipeloom bug: please report it)")

    def _entries(self, src: int, dst: int) -> tuple[list[tuple[int, int, int, int]], list[torch.Tensor]]:
        """What ``src`` sends ``dst``: (parameter, micro-batch, piece, slot) of every gradient a piece on ``src``
        gives a parameter both hold, in that order; and a template per entry."""
        low = self.lowering
        entries: list[tuple[int, int, int, int]] = []
        templates: list[torch.Tensor] = []
        for index, pieces in enumerate(self.shared.pieces):
            holders = self.holders(index)
            if src not in holders or dst not in holders:
                continue
            mine = [k for k in pieces if low.rank_of[low.stage_for[0][k]] == src]
            for mb in range(self.num_microbatches):
                for piece in mine:
                    for use in range(self.shared.slots(index, piece)):
                        entries.append((index, mb, piece, use))
                        templates.append(self.shared.params[index])
        return entries, templates

    def _part(self, index: int, mb: int, piece: int, use: int) -> torch.Tensor | None:
        return self.parts[(index, mb)][piece][use]


@dataclass(slots=True)
class UseGradients:
    """The gradient each use of some shared parameters gets in one piece's backward, apart: a hook after
    every autograd node that passes one of them a gradient (found by walking the graph from the backward's
    roots), each gradient keyed by when the backward adds it into the parameter's accumulator (nodes run
    in descending sequence number; a node's edges in order)."""

    wanted: dict[int, int]  # id(parameter) -> shared parameter index
    found: dict[int, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    handles: list = field(default_factory=list)

    def watch(self, roots: Sequence[Node]) -> None:
        """Hook every node below ``roots`` that has an edge into a wanted parameter's accumulator."""
        seen = set(roots)
        stack = list(roots)
        while stack:
            node = stack.pop()
            edges = []
            for position, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                index = self.wanted.get(id(getattr(child, "variable", None)))
                if index is not None:
                    edges.append((position, index))
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
            if edges:
                self.handles.append(node.register_hook(self._keeper(node._sequence_nr(), edges)))

    def _keeper(self, sequence: int, edges: list[tuple[int, int]]):
        def keep(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            for position, index in edges:
                if grad_inputs[position] is not None:  # None: not computed in this pass (an I before its W)
                    self.found.setdefault(index, {})[(-sequence, position)] = grad_inputs[position]

        return keep

    def finish(self, index: int, total: torch.Tensor | None, slots: int) -> list[torch.Tensor | None]:
        """Parameter ``index``'s ``slots`` gradients in the order the accumulator adds them; when the uses
        found are not ``slots`` (a use hidden in a module kept whole), ``total`` (their sum) and Nones."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        found = self.found.get(index, {})
        if len(found) == slots:
            return [found[key] for key in sorted(found)]
        return [total] + [None] * (slots - 1)
