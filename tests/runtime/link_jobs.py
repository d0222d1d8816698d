"""What each rank runs in the simulated-link and side-stream tests (importable by the child processes): an
all-to-all held to a :class:`~pipeloom.runtime.SimulatedLink` against the same one without it, two held all-to-alls
run one after the other and as the parts of an overlapped pair, and a user's MoE model over a one-rank ``"ep"``
group with a pair's forward and backward run in turn and interleaved."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeloom.runtime import SimulatedLink
from pipeloom.runtime.parallel.ep_dispatch import all_to_all
from pipeloom.runtime.parallel.link import link_bytes
from pipeloom.runtime.parallel.overlap import run_interleaved


def held_exchange(rank: int, world: int, latency: float, bandwidth: float) -> dict:
    """One differentiable all-to-all of 24 rows of 8 floats (rank r sends r + 1 + j rows to rank j), forward and
    backward, without and with the link: whether values and gradients are bitwise equal, the forward's wall and
    thread-CPU seconds with the link, and the link's stated duration for it."""
    link = SimulatedLink(latency=latency, bandwidth=bandwidth)
    group = dist.group.WORLD
    send = [rank + 1 + j for j in range(world)]
    recv = [r + 1 + rank for r in range(world)]
    rows = (torch.arange(sum(send) * 8, dtype=torch.float32).reshape(-1, 8) + 1000 * rank).requires_grad_()
    results = []
    for held in (None, link):
        dist.barrier()
        start, cpu = time.perf_counter(), time.thread_time()
        (out,) = all_to_all((rows,), send, recv, group, held)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        (grad,) = torch.autograd.grad((out * out).sum(), rows)
        results.append((out.detach(), grad, wall, cpu))
    (plain, plain_grad, _, _), (slow, slow_grad, wall, cpu) = results
    return {"equal": bool(torch.equal(plain, slow) and torch.equal(plain_grad, slow_grad)), "wall": wall, "cpu": cpu,
            "stated": link.duration(link_bytes(send, recv, rank, 8 * 4)),
            "bytes": link_bytes(send, recv, rank, 8 * 4)}


def held_pair(rank: int, world: int, latency: float) -> dict:
    """Two parts each running one all-to-all held to a link of ``latency`` seconds: wall seconds one after the
    other and interleaved as an overlapped pair (their holds then run at once), and the baton's hand-overs."""
    link = SimulatedLink(latency=latency)
    group = dist.group.WORLD
    rows = torch.ones(2 * world, 4)
    split = [2] * world

    def part() -> None:
        all_to_all((rows,), split, split, group, link)

    dist.barrier()
    start = time.perf_counter()
    part()
    part()
    one_after_the_other = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    turns = run_interleaved(part, part)
    interleaved = time.perf_counter() - start
    return {"sequential": one_after_the_other, "interleaved": interleaved, "turns": turns}


def pair_on_one_rank(rank: int, world: int, device: str) -> dict:
    """A user's MoE model (two MoE layers) with its experts behind the all-to-all dispatch over a one-rank "ep"
    group (gloo on the CPU, NCCL on CUDA): micro-batch 1's forward and micro-batch 0's backward run one after the
    other on one copy and interleaved as an overlapped pair on another; whether outputs and gradients are bitwise
    equal, and the hand-overs."""
    from ep_jobs import build_own
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime.parallel.ep import ExpertParallel, shard_experts

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS deterministic, before its first use
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)
    group = dist.new_group([0], backend="nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("ep",))
    ep = ExpertParallel(group=group, rank=0, size=1, mesh=mesh)
    models = []
    for _ in range(2):
        model = build_own().to(device)
        shard_experts({0: model}, ["1.experts", "2.experts"], ep)
        models.append(model)
    generator = torch.Generator().manual_seed(3)
    xs = [torch.randn(6, 8, generator=generator).to(device) for _ in range(2)]
    ys = [torch.randn(6, 8, generator=generator).to(device) for _ in range(2)]
    outputs, turns = [], 0
    for index, model in enumerate(models):
        loss = F.mse_loss(model(xs[0]), ys[0])  # micro-batch 0's forward, before the pair
        found: list[torch.Tensor] = []

        def forward(model=model, found=found) -> None:
            found.append(model(xs[1]).detach())

        def backward(loss=loss) -> None:
            loss.backward()

        if index == 0:
            forward()
            backward()
        else:
            turns = run_interleaved(forward, backward)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        outputs.append([found[0], *grads])
    if device == "cuda":
        torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(*outputs))
    return {"equal": bool(equal), "turns": turns, "cuda": outputs[0][0].is_cuda}
