"""Random numbers that do not depend on the number of ranks or the schedule (docs/design.md §5).

Each forward of model piece k on micro-batch m in training step t runs with the random generators of
its device seeded from ``forward_seed(seed, t, k, m)``, and the caller's generator states are restored
afterwards. Dropout masks are then the same whichever rank runs the piece and whenever it runs, and
:func:`reference_step` reproduces a step exactly in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from pipeloom.runtime.errors import PipelineError
from pipeloom.runtime.step.batch import row_count_fix

if TYPE_CHECKING:
    from pipeloom.runtime.model.split import StagedModel

__all__ = ["forward_seed", "reference_step", "seeded"]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def forward_seed(seed: int, step: int, piece: int, microbatch: int) -> int:
    """The generator seed of piece ``piece``'s forward of micro-batch ``microbatch`` in training step
    ``step`` (counted from 0 per engine): a 63-bit hash of the four numbers."""
    value = _mix(seed & _MASK)
    for part in (step, piece, microbatch):
        value = _mix(value ^ (part & _MASK))
    return value & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(seed: int, step: int, piece: int, microbatch: int, device: torch.device) -> Iterator[None]:
    """Run the block with the CPU generator (and ``device``'s, on CUDA) seeded by :func:`forward_seed`,
    restoring the previous states afterwards (what ``torch.random.fork_rng`` does, at a tenth of its
    cost: it runs around every forward)."""
    value = forward_seed(seed, step, piece, microbatch)
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index if device.index is not None
                                                        else torch.cuda.current_device()])
    states = [generator.get_state() for generator in generators]
    try:
        for generator in generators:
            generator.manual_seed(value)
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)


def reference_step(staged: StagedModel, inputs: object, target: object, *, loss_fn: Callable, microbatches: int,
                   seed: int, step: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The single-process reference of a training step with the runtime's random numbers:
    ``for m: (loss_fn(run(x_m), y_m) / M).backward()`` where ``run`` is ``staged.run`` (a
    :class:`~pipeloom.runtime.StagedModel`) with piece k's forward seeded by ``forward_seed(seed, step, k,
    m)``. Returns the summed loss; gradients accumulate in the model's ``.grad``. Without random
    operations in the model it is the plain loop of docs/design.md §5. Run it with the ranks' CPU thread count
    (``torch.set_num_threads``): CPU kernels split their sums by thread, so another count rounds otherwise."""
    from pipeloom.runtime.step.backward import add_in_order

    device = torch.device(device)
    values = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    targets = target if isinstance(target, (tuple, list)) else (target,)
    chunks = [torch.chunk(v, microbatches) for v in values]
    target_chunks = [torch.chunk(t, microbatches) for t in targets]
    short = next(((len(c), v.shape[0]) for c, v in zip((*chunks, *target_chunks), (*values, *targets))
                  if len(c) != microbatches), None)
    if short is not None:  # the engine refuses the same batch (it had been an IndexError here), with the same fix
        raise PipelineError(f"torch.chunk cuts this batch of {short[1]} rows into {short[0]} pieces, not the "
                            f"{microbatches} micro-batches; {row_count_fix(short[1], microbatches)}")
    losses = []
    for m in range(microbatches):
        def around(k: int, m: int = m) -> contextlib.AbstractContextManager[None]:
            return seeded(seed, step, k, m, device)

        out = staged.run(*(c[m] for c in chunks), around=around)
        y = target_chunks[0][m] if len(targets) == 1 else tuple(t[m] for t in target_chunks)
        loss = loss_fn(out, y) / microbatches
        loss.backward()
        losses.append(loss.detach())
    return add_in_order(losses)
