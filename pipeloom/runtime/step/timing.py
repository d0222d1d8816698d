"""Times of a traced step's compute actions: host clocks on the CPU; CUDA events on a GPU, where the host
clock would only measure kernel launches.

On CUDA the step starts with a synchronisation and a reference event recorded at a known host time
(``time.time_ns()``); each action records an event before and after it, and at the end of the step
(:meth:`ActionClock.resolve`, after another synchronisation) every event becomes nanoseconds since the
epoch: the reference's host time plus its GPU distance from the reference. Traces therefore keep one
clock (``unix_ns``) whatever the device; only a traced step pays the two synchronisations.
"""

from __future__ import annotations

import time

import torch

__all__ = ["ActionClock", "Mark"]

Mark = int | torch.cuda.Event  # when an action started or ended: host nanoseconds, or a CUDA event


class ActionClock:
    """Start and end times of a step's actions on ``device`` (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._anchor_ns = 0
        self._anchor: torch.cuda.Event | None = None
        self._pending: list[tuple[int, str, str, Mark, Mark]] = []

    def begin(self) -> None:
        """Start of a traced step (on CUDA: synchronise and record the reference event)."""
        self._pending = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._anchor_ns = time.time_ns()
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()

    def now(self) -> Mark:
        """A start mark: host nanoseconds, or a recorded CUDA event."""
        if not self.cuda:
            return time.time_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def record(self, events: list, name: str, kind: str, start: Mark) -> None:
        """Append ``(name, kind, start, end)`` for an action that began at ``start`` and ends now; on CUDA
        a placeholder that :meth:`resolve` fills."""
        end = self.now()
        if not self.cuda:
            events.append((name, kind, start, end))
            return
        self._pending.append((len(events), name, kind, start, end))
        events.append(None)

    def resolve(self, events: list) -> None:
        """Turn the recorded CUDA events into nanoseconds since the epoch (synchronises once)."""
        if not self._pending:
            return
        torch.cuda.synchronize(self.device)
        for index, name, kind, start, end in self._pending:
            events[index] = (name, kind, self._ns(start), self._ns(end))
        self._pending = []

    def _ns(self, event: Mark) -> int:
        assert self._anchor is not None and isinstance(event, torch.cuda.Event)  # on CUDA, after begin()
        return self._anchor_ns + round(self._anchor.elapsed_time(event) * 1e6)
