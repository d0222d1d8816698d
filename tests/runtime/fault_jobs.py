"""What each spawned rank runs in the fault tests (importable by the child processes): a failing rank
that lingers, ranks given different steps, and the engine's helper threads around close()."""

from __future__ import annotations

import os
import threading
import time

from pipeloom.runtime import Failures

HELPER_THREADS = ("pipeloom-sends", "pipeloom-watch")


def _engine(world: int, *, microbatches: int = 8, timeout: float = 60.0):
    import torch.nn.functional as F
    from models import SPLITS, build

    from pipeloom.runtime import pipeline

    return pipeline(
        build("residual"),
        schedule="1f1b",
        split_points=SPLITS["residual"][world],
        loss_fn=F.cross_entropy,
        microbatches=microbatches,
        failures=Failures(timeout=timeout),
    )


def _batch(rows: int = 16):
    import torch

    generator = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 16, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


def lingering_fault(rank: int, world: int, where: str, fail_rank: int, linger: float) -> dict:
    """After a good first step, rank ``fail_rank`` fails in the second: it raises in its third forward
    (``where="forward"``), raises after its sends at the end of the step (``"end"``: the others wait in
    the loss all-reduce), or exits (``"die"``). A rank that raised catches the error and keeps its
    process and group open for ``linger`` seconds. Every engine waits up to 60 s, so a prompt failure
    on the others comes from the failure watch, not the timeout."""
    import torch.distributed as dist

    from pipeloom.runtime import PipelineError

    engine = _engine(world)
    x, y = _batch()
    engine.step(x, target=y)  # shapes known: the second step posts its receives ahead
    if rank == fail_rank:
        if where == "end":
            from pipeloom.runtime.comm.step_messages import StepMessages

            finish = StepMessages.finish

            def failing_finish(messages) -> None:
                finish(messages)
                raise RuntimeError("injected fault after the sends")

            StepMessages.finish = failing_finish  # in this rank's process only
        else:
            calls = [0]

            def hook(module, args) -> None:
                calls[0] += 1
                if calls[0] == 3:
                    if where == "die":
                        os._exit(3)
                    raise ValueError("injected fault")

            engine.modules[engine.local_stages[0]].register_forward_pre_hook(hook)
    dist.barrier()  # every rank starts the failing step together
    start = time.monotonic()
    try:
        engine.step(x, target=y)
        message = None
    except PipelineError as error:
        message = str(error)
    seconds = time.monotonic() - start
    if rank == fail_rank:
        time.sleep(linger)  # the failed rank lingers: nobody may wait for its exit
    return {"seconds": seconds, "message": message}


def mismatch(rank: int, world: int, what: str) -> dict:
    """Rank 1 alone is given another step: ``"rows"`` (twice the batch), ``"dtype"`` (float64 inputs),
    ``"target"`` (int32 targets) or ``"microbatches"`` (its engine built for 4, the others for 8).
    Steps: a good one, the mismatched one, a good one again; each rank reports what each step raised."""
    import torch

    from pipeloom.runtime import PipelineError

    engine = _engine(world, microbatches=4 if what == "microbatches" and rank == 1 else 8)
    x, y = _batch()
    odd_x, odd_y = x, y
    if rank == 1:
        if what == "rows":
            odd_x, odd_y = _batch(32)
        elif what == "dtype":
            odd_x = x.double()
        elif what == "target":
            odd_y = y.to(torch.int32)
    outcomes = []
    start = time.monotonic()
    for inputs, target in ((x, y), (odd_x, odd_y), (x, y)):
        try:
            engine.step(inputs, target=target)
            outcomes.append(None)
        except PipelineError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    return {"outcomes": outcomes, "seconds": time.monotonic() - start}


def close_threads(rank: int, world: int) -> dict:
    """The helper threads alive after two steps, after close() (called twice) and whether a step after
    close() raises."""
    from pipeloom.runtime import PipelineError

    def alive() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name in HELPER_THREADS)

    engine = _engine(world)
    x, y = _batch()
    for _ in range(2):
        engine.step(x, target=y)
    before = alive()
    engine.close()
    engine.close()
    after = alive()
    try:
        engine.step(x, target=y)
        refused = None
    except PipelineError as error:
        refused = str(error)
    return {"before": before, "after": after, "refused": refused}
