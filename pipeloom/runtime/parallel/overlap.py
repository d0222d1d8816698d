"""DualPipe's overlapped pair run for real: the forward and the backward of an ``(iF;jB)OVERLAP_F_B`` action run in
two threads that hand one baton back and forth at their communication points, so that while one part's expert
all-to-all is in flight (an asynchronous gloo/NCCL collective), the other part computes.

Only one part computes at a time (the baton), and a part gives the baton away exactly when it has posted a
collective and before it waits for it: the sequence of collectives each rank posts is then a function of the
program alone — F's first, B's first, F's second, ... (a part that has finished no longer takes turns) — and the
same on every rank of an ``"ep"`` group, which runs the same program. Each part computes what it computes alone,
so the pair's results are bitwise those of the parts run one after the other.

On CUDA (:func:`post_collective`) each part issues its collectives from a side stream of its own, which first waits
for the compute stream (the inputs are ready), and the compute stream waits for the side stream only when the part
needs the result; the tensors the side stream uses are marked with ``record_stream`` so the caching allocator keeps
their memory until it is done. The other part's kernels queued meanwhile run during the collective. Both parts run
their backward on their own thread (``set_multithreading_enabled(False)``: autograd's CUDA worker thread would not
see the baton) and the helper thread takes the caller's device and stream. On the CPU nothing of this applies:
a collective is posted asynchronously and waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Baton", "current_baton", "post_collective", "run_interleaved"]

_LOCAL = threading.local()  # the baton of the pair this thread runs a part of (None outside a pair)


@dataclass(slots=True)
class Baton:
    """Which of two parts (0: the forward, 1: the backward) may compute now."""

    holder: int = 0
    done: list[bool] = field(default_factory=lambda: [False, False])
    turns: int = 0  # hand-overs made (how often the parts overlapped a collective)
    condition: threading.Condition = field(default_factory=threading.Condition)
    streams: dict[int, Any] = field(default_factory=dict)  # part -> its CUDA side stream (created when first used)

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


def post_collective(issue: Callable[[], dist.Work | None], tensors: Sequence[torch.Tensor],
                    pair: tuple[Baton, int]) -> Callable[[], object]:
    """Post the asynchronous collective ``issue()`` (``async_op=True``) of part ``pair[1]`` over ``tensors`` (its
    input and output); returns what waits for it. On CUDA it runs on the part's side stream (module doc)."""
    if not tensors[0].is_cuda:
        work = issue()
        assert work is not None  # async_op=True returns its work
        return work.wait
    baton, part = pair
    compute = torch.cuda.current_stream(tensors[0].device)
    side = baton.streams.get(part)
    if side is None:
        side = baton.streams[part] = torch.cuda.Stream(tensors[0].device)
    side.wait_stream(compute)  # the inputs were computed (and the output allocated) on the compute stream
    with torch.cuda.stream(side):
        work = issue()
    for tensor in tensors:  # freed on the compute stream, their memory waits for the side stream's work
        tensor.record_stream(side)
    assert work is not None

    def wait() -> None:
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for the collective ...
        compute.wait_stream(side)  # ... and the compute stream for the side stream, where the result is used

    return wait


def run_interleaved(forward: Callable[[], None], backward: Callable[[], None]) -> int:
    """Run ``forward`` in a helper thread and ``backward`` here, interleaved at their collectives (see the module
    doc); re-raise the first error of either. Returns how many times the baton changed hands."""
    baton = Baton()
    errors: list[BaseException] = []
    threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the helper's must be the caller's,
    # or its reductions split (and round) differently
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stream = torch.cuda.current_stream() if cuda else None  # the caller's device and stream, for the helper

    def run(part: int, work: Callable[[], None]) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _LOCAL.baton = (baton, part)
        try:
            baton.take(part)
            with _on_this_thread(stream):
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


@contextmanager
def _on_this_thread(stream: Any) -> Iterator[None]:
    """On CUDA (``stream`` the caller's current stream): that stream and its device current on this thread, and
    the backward run here rather than on autograd's device thread (which would not see the baton)."""
    if stream is None:
        yield
        return
    torch.cuda.set_device(stream.device)
    with torch.cuda.stream(stream), torch.autograd.set_multithreading_enabled(False):
        yield
