"""DualPipe's overlapped pair run for real: the forward and the backward of an ``(iF;jB)OVERLAP_F_B`` action run in
two threads that hand one baton back and forth at their communication points, so that while one part's expert
all-to-all is in flight (an asynchronous gloo/NCCL collective), the other part computes.

Only one part computes at a time (the baton), and a part gives the baton away exactly when it has posted a
collective and before it waits for it: the sequence of collectives each rank posts is then a function of the
program alone — F's first, B's first, F's second, ... (a part that has finished no longer takes turns) — and the
same on every rank of an ``"ep"`` group, which runs the same program. Each part computes what it computes alone,
so the pair's results are bitwise those of the parts run one after the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Baton", "current_baton", "run_interleaved"]

_LOCAL = threading.local()  # the baton of the pair this thread runs a part of (None outside a pair)


@dataclass(slots=True)
class Baton:
    """Which of two parts (0: the forward, 1: the backward) may compute now."""

    holder: int = 0
    done: list[bool] = field(default_factory=lambda: [False, False])
    turns: int = 0  # hand-overs made (how often the parts overlapped a collective)
    condition: threading.Condition = field(default_factory=threading.Condition)

    def pass_on(self, part: int) -> None:
        """Part ``part`` has posted a collective: let the other part compute until it posts one or finishes,
        then continue (at once when the other part has finished)."""
        with self.condition:
            other = 1 - part
            if self.done[other]:
                return
            self.holder = other
            self.turns += 1
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.holder == part)

    def take(self, part: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.holder == part)

    def finish(self, part: int) -> None:
        with self.condition:
            self.done[part] = True
            self.holder = 1 - part
            self.condition.notify_all()


def current_baton() -> tuple[Baton, int] | None:
    """(the baton, this thread's part) inside an overlapped pair; None elsewhere."""
    return getattr(_LOCAL, "baton", None)


def run_interleaved(forward: Callable[[], None], backward: Callable[[], None]) -> int:
    """Run ``forward`` in a helper thread and ``backward`` here, interleaved at their collectives (see the module
    doc); re-raise the first error of either. Returns how many times the baton changed hands."""
    baton = Baton()
    errors: list[BaseException] = []
    threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the helper's must be the caller's,
    # or its reductions split (and round) differently

    def run(part: int, work: Callable[[], None]) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _LOCAL.baton = (baton, part)
        try:
            baton.take(part)
            work()
        except BaseException as error:  # noqa: BLE001 (handed to the caller below)
            errors.append(error)
        finally:
            _LOCAL.baton = None
            baton.finish(part)

    helper = threading.Thread(target=run, args=(0, forward), name="pipeloom-overlap-forward", daemon=True)
    helper.start()
    run(1, backward)
    helper.join()
    if errors:
        raise errors[0]
    return baton.turns
