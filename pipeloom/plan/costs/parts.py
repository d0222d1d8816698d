"""The parts of a cost table: a piece's times and bytes, a parameter several pieces share, the link
between ranks, and the runtime corrections fitted by running the engine (no torch here)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pipeloom.errors import shown
from pipeloom.plan.errors import CostTableError

__all__ = [
    "Link",
    "Piece",
    "RUNTIME_FIELDS",
    "RuntimeCorrections",
    "SharedParam",
    "check_number",
    "parse_bytes",
]

def check_number(what: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostTableError(f"{what} must be a finite number, got {shown(value)}")
    if value < minimum:
        raise CostTableError(f"{what} must be >= {minimum:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """Communication between two ranks: ``time(bytes) = latency + bytes / bandwidth``."""

    latency: float = 0.0
    """Seconds per message."""
    bandwidth: float | None = None
    """Bytes per second; None means unlimited (only the latency counts)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency", check_number("link latency", self.latency))
        if self.bandwidth is not None:
            bandwidth = check_number("link bandwidth", self.bandwidth)
            if bandwidth <= 0:
                raise CostTableError("link bandwidth must be > 0 bytes/s (or None for unlimited)")
            object.__setattr__(self, "bandwidth", bandwidth)

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` (0 when there is nothing to send)."""
        if nbytes <= 0:
            return 0.0
        return self.latency + (0.0 if self.bandwidth is None else nbytes / self.bandwidth)


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One cuttable part of the model; times are per micro-batch of the table's ``microbatch_size``."""

    name: str
    """A module name the runtime accepts as a split point, e.g. ``blocks.3``."""
    f: float
    """Forward seconds."""
    i: float
    """Input-gradient backward seconds (zero-bubble I: ``pipeloom.runtime.step.backward.backward_input``)."""
    w: float
    """Weight-gradient backward seconds (zero-bubble W: the ``weight()`` that I leaves pending). Where a
    stage's inputs are only model inputs (which carry no gradient), the engine's I computes nothing and W
    does the whole backward: the planner then counts the stage's ``i`` as W (:func:`pipeloom.plan.recost`)."""
    measured_full_backward: float | None = None
    """Full backward seconds (input and weight gradients in one ``autograd.backward``, as the engine runs a
    ``B``: ``pipeloom.runtime.step.backward.backward_full``); None means not measured, priced ``i + w``
    (:attr:`full_backward`). One backward pass is usually cheaper than the split's two. (Called ``b``
    in ``pipeloom.costs/1`` files, which still load; in :class:`pipeloom.stages.Costs` and ``Stage``, ``b``
    is the input-gradient time, this table's ``i``.)"""
    activation_bytes: float = 0.0
    """Bytes the forward keeps for the backward (saved tensors), released by the backward."""
    w_activation_bytes: float = 0.0
    """Part of ``activation_bytes`` still needed by W after I (e.g. the inputs of linear layers)."""
    param_bytes: float = 0.0
    """Bytes of the piece's parameters. A parameter several pieces use (a tied embedding and LM head) is
    counted once, in the first of them; :attr:`CostTable.shared` lists it with all its users."""
    output_bytes: float = 0.0
    """Bytes of the values the piece passes on (sent when a stage boundary follows it)."""
    inputs: tuple[str, ...] | None = None
    """Pieces whose outputs it reads; None means the piece before it (a chain), () the model inputs only."""
    running_stats: bool = False
    """The piece updates buffers in a training step (BatchNorm's running statistics): the two replicas of a
    two-replica schedule (DualPipe, Chimera) would update them apart, which the runtime refuses, so the planner
    plans it on one-replica schedules only."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CostTableError(f"a piece name must be a non-empty string, got {shown(self.name)}")
        if not isinstance(self.running_stats, bool):
            raise CostTableError(f"piece {self.name!r} running_stats must be true or false, got "
                                 f"{shown(self.running_stats)}")
        for key in ("f", "i", "w", "activation_bytes", "w_activation_bytes", "param_bytes", "output_bytes"):
            object.__setattr__(self, key, check_number(f"piece {self.name!r} {key}", getattr(self, key)))
        if self.measured_full_backward is not None:
            object.__setattr__(self, "measured_full_backward", check_number(
                f"piece {self.name!r} measured_full_backward", self.measured_full_backward))
        if self.w_activation_bytes > self.activation_bytes:
            raise CostTableError(
                f"piece {self.name!r}: w_activation_bytes {self.w_activation_bytes:g} exceeds activation_bytes "
                f"{self.activation_bytes:g}; W can only keep part of what the forward saved"
            )
        if self.inputs is not None:
            if isinstance(self.inputs, str) or not all(isinstance(n, str) for n in self.inputs):
                raise CostTableError(f"piece {self.name!r}: inputs must be a list of piece names")
            object.__setattr__(self, "inputs", tuple(dict.fromkeys(self.inputs)))

    @property
    def time(self) -> float:
        """``f + i + w``: the piece's compute per micro-batch."""
        return self.f + self.i + self.w

    @property
    def full_backward(self) -> float:
        """Seconds of a full backward B: :attr:`measured_full_backward` where measured, else ``i + w``."""
        return self.i + self.w if self.measured_full_backward is None else self.measured_full_backward


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedParam:
    """A parameter several pieces use (a tied embedding and LM head): every rank holding one of those
    pieces keeps it, and their gradients are combined after the step (:mod:`pipeloom.plan.costs.shared`)."""

    name: str
    """The parameter's name in the model, for messages (e.g. ``transformer.wte.weight``)."""
    bytes: float
    """Its bytes (counted once in the ``param_bytes`` of its first user, ``pieces[0]``)."""
    pieces: tuple[str, ...]
    """The pieces using it, in call order (two or more)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise CostTableError(f"a shared parameter's name must be a string, got {shown(self.name)}")
        object.__setattr__(self, "bytes", check_number(f"shared parameter {self.name!r} bytes", self.bytes))
        if isinstance(self.pieces, str) or not all(isinstance(n, str) for n in self.pieces):
            raise CostTableError(f"shared parameter {self.name!r}: pieces must be a list of piece names")
        object.__setattr__(self, "pieces", tuple(dict.fromkeys(self.pieces)))
        if len(self.pieces) < 2:
            raise CostTableError(f"shared parameter {self.name!r} names {len(self.pieces)} piece(s); a shared "
                                 "parameter is used by two or more pieces (leave one-piece parameters out)")


RUNTIME_FIELDS = ("action_overhead", "message_cost", "step_overhead", "time_spread", "start_skew",
                   "replica_link")
"""The fields of :class:`RuntimeCorrections`: top-level keys and keywords of a ``pipeloom.costs/1`` table."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeCorrections:
    """What a runtime costs beyond the pieces' own times: per action, per message, per step, how much
    times vary, and the replica-gradient exchange. All are fitted by running the engine
    (:func:`pipeloom.profile.in_engine.profile_in_engine`); every default means "none measured", so a cost source
    that times the pieces alone (:func:`pipeloom.profile.model.profile_model`,
    :func:`pipeloom.plan.analytical_gpt_costs`, a hand-written table) owes nothing here. None of them
    scales with the micro-batch size."""

    action_overhead: float = 0.0
    """Seconds the runtime spends per action beyond the piece times (dispatch, bookkeeping; its
    messages are :attr:`message_cost`); the simulator adds it to every task (F, B, I and W alike).
    Not scaled with the micro-batch size."""
    message_cost: float = 0.0
    """Seconds an action spends per message to or from another rank: posting the send, or the
    receive ahead of the action that needs it (the runtime's own work, and on a busy machine the
    transport's stalls). :func:`~pipeloom.plan.recost` adds it to a stage's F and its B or I once
    per edge of the stage that crosses ranks: the piece times themselves hold no messages. Not
    scaled with the micro-batch size. Measured by :func:`pipeloom.profile.in_engine.profile_in_engine`."""
    step_overhead: float = 0.0
    """Seconds the runtime spends once per step outside the actions (the step's preamble, the loss
    all-reduce, waiting for the last sends); added to every predicted step time. Not scaled with the
    micro-batch size."""
    time_spread: float = 0.0
    """How much one action's time varies around its piece's between micro-batches and steps: the
    coefficient of variation (0: not at all). The plan search predicts the mean step time over
    replays whose action times vary this much (:func:`pipeloom.plan.noise.expected_makespan`): where a
    rank waits for the later of two paths, variation costs time on average. Measured by
    :func:`pipeloom.profile.in_engine.profile_in_engine`."""
    start_skew: float = 0.0
    """Seconds: how far apart ranks that start a step at once (the first stage of each replica in a
    two-replica schedule) begin their first actions, on average. Each draws an exponential delay of
    this mean in :func:`pipeloom.plan.noise.expected_makespan`; the later one holds up what depends on it.
    Measured by :func:`pipeloom.profile.in_engine.profile_in_engine` on its two-replica profiling pipeline (on
    gloo with every core busy, a rank posting its first messages can stall for a scheduler slice)."""
    replica_link: Link | None = None
    """The two-replica schedules' gradient exchange as the engine runs it, per packed message (see
    :func:`pipeloom.plan.replica_sync_time`): packing, adding and sending back, under the load of the
    step's last messages. Fitted by :func:`pipeloom.profile.in_engine.profile_in_engine` from a two-replica
    profiling pipeline; None prices the exchange with :attr:`CostTable.link`."""

    def __post_init__(self) -> None:
        for key in RUNTIME_FIELDS[:-1]:
            object.__setattr__(self, key, check_number(key, getattr(self, key)))
        if self.replica_link is not None and not isinstance(self.replica_link, Link):
            raise CostTableError(
                f"replica_link is {type(self.replica_link).__name__}, expected a Link or None")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | float) -> float:
    """``"80GiB" -> 85899345920.0``: a number with an optional unit B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), any case; a bare number is bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return check_number("a byte count", text)
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is not None and unit in ("k", "m", "g", "t"):  # 80G: binary or decimal, said rather than guessed
        number, letter = match.group(1), match.group(2).upper()
        raise CostTableError(f"bad size {shown(text)}: write {number}{letter}iB (powers of 1024, as GPU memory is "
                             f"counted) or {number}{letter}B (powers of 1000)")
    if match is None or unit not in _UNITS:
        raise CostTableError(
            f"bad size {shown(text)}: write a number and a unit such as 80GiB, 512MiB, 16GB or 1e9 (bytes)"
        )
    return check_number("a byte count", float(match.group(1)) * _UNITS[unit])
