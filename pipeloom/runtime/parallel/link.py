"""A simulated slower link for benchmarks and tests (off unless ``Parallelism(simulated_link=...)`` names one): each
expert all-to-all completes no earlier than ``latency + bytes / bandwidth`` after it was issued.

On gloo CPU ranks over loopback an all-to-all is a memory copy that keeps the same cores busy, so there is no idle
time for an overlapped pair to fill. With a simulated link a collective still moves its tensors through the real
backend (the results are the backend's, bitwise), and then its completion is held back until the link's time has
passed since it was issued: the waiting part sleeps (``time.sleep`` releases the GIL and takes no CPU), so the other
part of an overlapped pair computes meanwhile — a link of that latency and bandwidth whose transfer runs on no core.
``bytes`` is what this rank moves over its link, the larger of what it sends to and receives from other ranks (a
full-duplex link per rank; rows a rank keeps are not on the link). Stage-to-stage messages are not slowed (their
delay would count from the sender's post, which the receiver does not see). It is meant for CPU ranks: on CUDA it
holds the host thread, not the streams.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipeloom.runtime.errors import PipelineError

__all__ = ["SimulatedLink", "link_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulatedLink:
    """The link every expert all-to-all is held to (module doc); a benchmark and test facility, never a default."""

    latency: float = 0.0
    """Seconds from issuing a collective to its first byte arriving."""
    bandwidth: float = math.inf
    """Bytes per second this rank's link moves each way (``inf``: latency only)."""

    def __post_init__(self) -> None:
        for name in ("latency", "bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise PipelineError(f"SimulatedLink({name}={value!r}): a number of seconds (latency) or bytes per "
                                    "second (bandwidth), at least 0")
            object.__setattr__(self, name, float(value))
        if self.bandwidth == 0 or math.isinf(self.latency):
            raise PipelineError(f"SimulatedLink(latency={self.latency!r}, bandwidth={self.bandwidth!r}) never "
                                "completes a collective; give a finite latency and a positive bandwidth")

    def duration(self, nbytes: int) -> float:
        """Seconds a collective moving ``nbytes`` over this rank's link takes: ``latency + nbytes / bandwidth``."""
        return self.latency + nbytes / self.bandwidth

    def hold(self, issued: float, nbytes: int) -> float:
        """Sleep until ``duration(nbytes)`` seconds after ``issued`` (a ``time.perf_counter()`` reading taken when
        the collective was issued); returns the seconds slept (0 when the real collective took longer)."""
        remaining = issued + self.duration(nbytes) - time.perf_counter()
        if remaining <= 0:
            return 0.0
        time.sleep(remaining)
        return remaining


def link_bytes(send: Sequence[int], recv: Sequence[int], rank: int, row_bytes: int) -> int:
    """Bytes rank ``rank`` moves over its link in an all-to-all sending ``send[r]`` rows of ``row_bytes`` to each
    rank r and receiving ``recv[r]`` from it: the larger direction, its own rows excluded."""
    out = sum(n for r, n in enumerate(send) if r != rank)
    into = sum(n for r, n in enumerate(recv) if r != rank)
    return max(out, into) * row_bytes
