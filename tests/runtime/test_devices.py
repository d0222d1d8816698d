"""The runtime on devices: every action shows in a user's ``torch.profiler`` trace (CPU), and, marked
``gpu`` (skipped without CUDA), pipelines of several stages on one GPU with bitwise-exact gradients, a
meta-device model allocated on the GPU, action times from CUDA events against the whole step, and a
one-rank NCCL mesh. The numbers these print are recorded in docs/runtime-gpu.md."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F
from hf_models import build_hf, hf_splits, lm_loss, tokens
from models import SPLITS, Residual, batch, build, reference_step

from pipeloom.runtime import Parallelism, Tracing, Weights, pipeline

CUDA = torch.cuda.is_available()


def test_every_action_shows_in_the_users_profiler_trace():
    engine = pipeline(build("residual"), schedule="zbv", split_points=SPLITS["residual"][2], microbatches=4,
                      loss_fn=F.cross_entropy)
    inputs, target = batch("residual")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step(inputs[0], target=target)
    names = {event.name for event in profile.events()}
    expected = {f"pipeloom {s}{kind}{m}" for s in range(2) for kind in "FIW" for m in range(4)}
    assert expected <= names, sorted(expected - names)


def _same_grads(model, reference) -> list[str]:
    return [name for (name, p), q in zip(model.named_parameters(), reference.parameters())
            if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad))]


def _loop(model, x, y, loss_fn, n: int) -> torch.Tensor:
    """docs/design.md §5's reference: ``for m: (loss_fn(model(x_m), y_m) / n).backward()``; the summed loss."""
    total = None
    for xm, ym in zip(torch.chunk(x, n), torch.chunk(y, n)):
        part = loss_fn(model(xm), ym) / n
        part.backward()
        total = part.detach() if total is None else total + part.detach()
    return total


ONE_GPU = [("gpipe", 1), ("interleaved-1f1b", 4), ("looped-bfs", 4), ("zbv", 2)]


@pytest.mark.parametrize(("schedule", "pieces"), ONE_GPU, ids=[s for s, _ in ONE_GPU])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_several_stages_on_one_gpu_are_exact(schedule, pieces):
    torch.manual_seed(0)
    model = Residual(hidden=512, classes=10).cuda()
    reference = copy.deepcopy(model)
    engine = pipeline(model, schedule=schedule, split_points=SPLITS["residual"][pieces], microbatches=8,
                      loss_fn=F.cross_entropy)
    assert engine.device.type == "cuda"
    x = torch.randn(256, 512, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    for _ in range(2):
        loss = engine.step(x, target=y)
        expected = reference_step(reference, (x,), y, 8)
        assert torch.equal(loss, expected)
        assert _same_grads(model, reference) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_an_exported_transformers_model_runs_on_the_gpu_exactly():
    model = build_hf("gpt2")  # tied head and embedding, two pieces on one rank
    x, y = tokens()
    reference = copy.deepcopy(model).cuda()
    engine = pipeline(
        model,
        schedule="zbv",
        split_points=hf_splits("gpt2", 2),
        microbatches=4,
        loss_fn=lm_loss,
        device="cuda",
        tracing=Tracing(example_inputs=(x,)),
    )
    loss = engine.step(x, target=y)
    assert torch.equal(loss, _loop(reference, x.cuda(), y.cuda(), lm_loss, 4))
    assert _same_grads(model, reference) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["residual", "llama"])
def test_a_meta_model_is_allocated_on_the_gpu(name):
    hf = name == "llama"
    reference = (build_hf(name) if hf else build(name)).cuda()
    with torch.device("meta"):
        model = build_hf(name) if hf else build(name)
    x, y = tokens() if hf else (batch(name)[0][0], batch(name)[1])
    engine = pipeline(
        model,
        schedule="interleaved-1f1b",
        split_points=(hf_splits if hf else lambda n, k: SPLITS[n][k])(name, 4),
        microbatches=4,
        loss_fn=lm_loss if hf else F.cross_entropy,
        device="cuda",
        tracing=Tracing(example_inputs=(x,)) if hf else None,
        weights=Weights(state_dict=copy.deepcopy(reference.state_dict()),
                        init_weights=model._init_weights if hf else None),
    )
    assert all(p.is_cuda for p in model.parameters())
    loss = engine.step(x, target=y)
    assert torch.equal(loss, _loop(reference, x.cuda(), y.cuda(), lm_loss if hf else F.cross_entropy, 4))
    assert _same_grads(model, reference) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_action_times_come_from_cuda_events():
    """A GPU-bound step: the traced actions' CUDA-event durations add up to the step's GPU time measured
    with torch.cuda.Event around it, and never overlap (one stream)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU())
                                  for _ in range(8)]).cuda()
    engine = pipeline(
        model,
        schedule="interleaved-1f1b",
        split_points=["2", "4", "6"],
        microbatches=8,
        loss_fn=lambda out, y: F.mse_loss(out, y),
        record=True,
    )
    x = torch.randn(8192, 2048, device="cuda")
    y = torch.randn(8192, 2048, device="cuda")
    for _ in range(3):  # warm-up: kernels chosen, allocator filled
        engine.step(x, target=y)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    engine.step(x, target=y)
    end.record()
    torch.cuda.synchronize()
    whole_ns = start.elapsed_time(end) * 1e6
    actions = [e for e in engine.trace_steps[-1]["events"] if e["kind"] == "compute"]
    assert len(actions) == 2 * 8 * 4  # F and B of 4 stages × 8 micro-batches
    durations = [e["end_ns"] - e["start_ns"] for e in actions]
    assert min(durations) > 0
    for a, b in zip(actions, actions[1:]):
        assert a["end_ns"] <= b["start_ns"] + 1_000, (a, b)  # CUDA events resolve to about a microsecond
    share = sum(durations) / whole_ns
    print(f"\nGPU-bound step: {whole_ns / 1e6:.2f} ms by torch.cuda.Event around step(); actions sum "
          f"{sum(durations) / 1e6:.2f} ms ({share:.3f} of it), span "
          f"{(actions[-1]['end_ns'] - actions[0]['start_ns']) / 1e6:.2f} ms")
    assert 0.8 <= share <= 1.0 + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_one_rank_nccl_mesh_runs(tmp_path):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_nccl_rank, args=(str(tmp_path / "store"), queue))
    process.start()
    process.join(timeout=180)
    assert process.exitcode == 0, process.exitcode
    status, value = queue.get(timeout=5)
    assert status == "ok", value


def _nccl_rank(store_path: str, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        store = dist.FileStore(store_path, 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "pp"))
        model = build("residual").cuda()
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule="gpipe",
            split_points=[],
            microbatches=4,
            loss_fn=F.cross_entropy,
            parallel=Parallelism(mesh=mesh),
        )
        inputs, target = batch("residual")
        loss = engine.step(inputs[0], target=target)
        expected = reference_step(reference, (inputs[0].cuda(),), target.cuda(), 4)
        ok = torch.equal(loss, expected) and _same_grads(model, reference) == []
        engine.close()
        dist.destroy_process_group()
        queue.put(("ok" if ok else "mismatch", engine.device.type))
    except BaseException as error:  # noqa: BLE001
        queue.put(("error", f"{type(error).__name__}: {error}"))
