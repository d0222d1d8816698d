"""Split backward (I then W) against a full backward, pipeloom's and torch's, in one process.

Run ``python benchmarks/split_backward.py`` (``--help`` for sizes). The model is ``--blocks`` residual MLP
blocks ``x + fc2(gelu(fc1(x)))`` (the stages of ``benchmarks/runtime_vs_torch.py``); one round runs
``--microbatches`` forwards, then each micro-batch's backward, in four ways:

- ``full``: one full backward per micro-batch (``pipeloom.runtime.step.backward.backward_full``);
- ``pipeloom``: pipeloom's I (``backward_input``) then W (``PendingWeights.weight``);
- ``torch``: torch.distributed.pipelining's ``stage_backward_input`` then ``stage_backward_weight``;

each either with W right after its I (``now``) or with every W after all the I's (``deferred``, as a
zero-bubble schedule defers them). Rounds rotate the order of the ways; the script prints the median
round time and the median over rounds of each way's time divided by ``full now`` in the same round.
One CPU thread. The gradients of every way are checked bitwise against ``full`` first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from pipeloom.runtime.step.backward import backward_full, backward_input
from runtime_vs_torch import Block  # the same residual MLP block as the runtime benchmark's stages


def ways(model: nn.Module, xs: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    """Name -> one round (forwards, then backwards) of that way."""
    params = list(model.parameters())

    def forwards() -> list[tuple[torch.Tensor, torch.Tensor]]:
        outs = []
        for x in xs:
            leaf = x.detach().requires_grad_()
            outs.append((leaf, model(leaf)))
        return outs

    def full() -> None:
        for (leaf, out), grad in zip(forwards(), grads):
            backward_full([out], [grad], [leaf])

    def pipeloom(deferred: bool) -> Callable[[], None]:
        def run() -> None:
            pending = []
            for (leaf, out), grad in zip(forwards(), grads):
                _, weights = backward_input([out], [grad], [leaf], params)
                pending.append(weights) if deferred else weights.weight()
            for weights in pending:
                weights.weight()
        return run

    def torch_split(deferred: bool) -> Callable[[], None]:
        def run() -> None:
            pending = []
            for (leaf, out), grad in zip(forwards(), grads):
                _, groups = stage_backward_input([out], [grad], [leaf], iter(params))
                pending.append(groups) if deferred else stage_backward_weight(iter(params), groups)
            for groups in pending:
                stage_backward_weight(iter(params), groups)
        return run

    return {"full now": full, "pipeloom now": pipeloom(False), "pipeloom deferred": pipeloom(True),
            "torch now": torch_split(False), "torch deferred": torch_split(True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.width, args.hidden) for _ in range(args.blocks)])
    xs = [torch.randn(args.rows, args.width) for _ in range(args.microbatches)]
    grads = [torch.randn(args.rows, args.width) for _ in range(args.microbatches)]
    runs = ways(model, xs, grads)
    reference = None
    for name, run in runs.items():  # every way gives the full backward's gradients, bit for bit
        model.zero_grad(set_to_none=True)
        run()
        found = [p.grad.clone() for p in model.parameters()]
        reference = reference or found
        if not all(torch.equal(a, b) for a, b in zip(found, reference)):
            raise SystemExit(f"{name}: gradients differ from the full backward's")
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(args.warmup + args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            runs[name]()
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    print(f"{args.blocks} blocks width {args.width} hidden {args.hidden}, {args.microbatches} micro-batches of "
          f"{args.rows} rows, 1 thread; medians of {args.rounds} rounds after {args.warmup} warm-up")
    print(f"{'way':20} {'ms':>8} {'/ full now':>11}")
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["full now"]))
        print(f"{name:20} {statistics.median(times[name]) * 1e3:8.2f} {ratio:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
