"""What each spawned rank runs in the expert-parallel tests (importable by the child processes): tiny MoE models
of ``transformers`` and a user's own MoE layer on a (pp 2, ep 2) mesh next to the same model on (pp 2, dp 2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from ranks import traces_before_fork
from torch import nn

from pipeloom.runtime import Failures, Parallelism, Tracing

VOCAB = 96


def build_moe(name: str, *, seed: int = 0, implementation: str | None = None, **extra: object) -> nn.Module:
    """Tiny random-init Qwen3-MoE (4 sparse layers), Qwen2-MoE (4 sparse layers, each with a shared expert),
    DeepSeek-V3 (1 dense + 3 MoE layers with a shared expert and group-limited routing) or gpt-oss (4 sparse
    layers, biased experts, sinks): 4 experts, 2 per token, eager attention; ``extra``: more config fields
    (Qwen's)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  num_hidden_layers=4, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, attn_implementation="eager")
    if name == "qwen3_moe":
        config = T.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **common, **extra)
        model = T.Qwen3MoeForCausalLM(config)
    elif name == "qwen2_moe":  # a shared expert (a dense MLP) beside the routed ones, no q/k norms
        config = T.Qwen2MoeConfig(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, **common, **extra)
        model = T.Qwen2MoeForCausalLM(config)
    elif name == "deepseek_v3":
        config = T.DeepseekV3Config(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                    n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                    v_head_dim=8, **{**common, "num_key_value_heads": 4})  # MLA: kv heads = heads
        model = T.DeepseekV3ForCausalLM(config)
    elif name == "gpt_oss":  # biased experts and router, attention sinks, every second layer a 4-token window
        config = T.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                                **{**common, "intermediate_size": 16}, **extra)
        model = T.GptOssForCausalLM(config)
    else:
        raise ValueError(name)
    with torch.no_grad():  # transformers leaves the experts' stacked weights and some routers at zero/empty
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model


def lm_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def tokens(rows: int = 8, seq: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(1, VOCAB, (rows, seq), generator=generator),
            torch.randint(0, VOCAB, (rows, seq), generator=generator))


class TopTwo(nn.Module):
    """A user's own MoE layer with the experts interface: ``num_experts`` and [E, ...] stacked weights."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, width, 2 * width) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, 2 * width, width) * 0.3)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = hidden_states.new_zeros(hidden_states.shape[0], top_k_index.shape[1], hidden_states.shape[1])
        for j in range(top_k_index.shape[1]):  # per choice: each row's expert
            up, down = self.up[top_k_index[:, j]], self.down[top_k_index[:, j]]
            y = torch.bmm(torch.relu(torch.bmm(hidden_states[:, None], up)), down)[:, 0]
            out[:, j] = y * top_k_weights[:, j, None]
        return out.sum(dim=1)


class Block(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = TopTwo(width, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        return x + self.experts(flat, index, weights).view_as(x)


def build_own(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), Block(16, 4), Block(16, 4), nn.Linear(16, 8))


V_SHAPED = ("zbv", "dualpipev")  # two pieces per rank


def _engine(model: nn.Module, schedule: str, dim: str, name: str, timeout: float = 60, link=None):
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dim))
    cuts = ["1", "2", "3"] if schedule in V_SHAPED else ["2"]
    if name == "own":
        return pipeline(
            model,
            schedule=schedule,
            split_points=cuts,
            loss_fn=F.mse_loss,
            microbatches=4,
            tracing=Tracing(leaf_modules=["1.experts", "2.experts"]),
            parallel=Parallelism(mesh=mesh, experts=["*.experts"] if dim == "ep" else None, simulated_link=link),
            failures=Failures(timeout=timeout),
        )  # the reference's tracer keeps them whole too
    x, _ = tokens()
    return pipeline(
        model,
        schedule=schedule,
        split_points=[f"model.layers.{c}" for c in cuts],
        loss_fn=lm_loss,
        microbatches=4,
        tracing=Tracing(tracer="export", example_inputs=(x[:2],)),
        parallel=Parallelism(mesh=mesh, simulated_link=link),
        failures=Failures(timeout=timeout),
    )


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "own":
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    return tokens(seed=step)


def _build(name: str) -> nn.Module:
    return build_own() if name == "own" else build_moe(name)


def _trace_meshes(name: str, example: torch.Tensor) -> None:
    """The traces ``pipeline()`` takes of ``build_moe(name)`` with ``example`` on an "ep" mesh (each experts
    module's layer kept whole) and on one without "ep", taken without a mesh."""
    from pipeloom.runtime.model.tracing import trace_model
    from pipeloom.runtime.parallel.ep import find_experts, moe_layers

    ours, theirs = build_moe(name), build_moe(name)
    experts = find_experts(ours, None)
    trace_model(ours, tracer="export", leaf_modules=experts, example_inputs=(example,),
                export_leaves=moe_layers(experts))
    trace_model(theirs, tracer="export", example_inputs=(example,))


def _trace_engines(cases: list[tuple[str, str]], steps: int = 3) -> None:
    """The traces :func:`_engine` takes of the transformers models of ``cases``."""
    for name in dict.fromkeys(name for name, _ in cases if name != "own"):
        _trace_meshes(name, tokens()[0][:2])


@traces_before_fork(_trace_engines)
def ep_exactness(rank: int, world: int, cases: list[tuple[str, str]], steps: int = 3) -> dict:
    """For each (model, schedule): ``steps`` SGD steps on (pp 2, ep 2) and on (pp 2, dp 2) from the same state
    (each step starts both from the (pp, dp) run's parameters): whether the losses are bitwise equal, the
    largest gradient difference relative to the largest gradient of its tensor, the parameters without a
    gradient, and how many experts modules this rank sharded."""
    from pipeloom.runtime.parallel.ep import is_expert

    results = {}
    for name, schedule in cases:
        ours, theirs = _build(name), _build(name)
        ep = _engine(ours, schedule, "ep", name)
        dp = _engine(theirs, schedule, "dp", name)
        mine, reference = dict(ep.named_parameters()), dict(dp.named_parameters())
        equal, worst, missing, gap = True, 0.0, set(), 0.0
        for step in range(steps):
            x, y = _batch(name, step)
            sharded_loss, replicated_loss = ep.step(x, target=y), dp.step(x, target=y)
            equal &= bool(torch.equal(sharded_loss, replicated_loss))
            apart = float((sharded_loss - replicated_loss).abs() / replicated_loss.abs())
            gap = gap if apart <= gap else apart  # a NaN sticks (max() would drop it)
            for key, p in mine.items():
                q = reference[key]
                if p.grad is None:
                    missing.add(key)
                    continue
                grad, expected = p.grad, q.grad
                if is_expert(p):
                    per = expected.shape[0] // ep.layout.ep.size
                    grad = p.grad.to_local()
                    expected = expected[ep.layout.ep.rank * per:(ep.layout.ep.rank + 1) * per]
                scale = float(expected.abs().max()) or 1.0
                apart = float((grad - expected).abs().max()) / scale
                worst = worst if apart <= worst else apart  # a NaN sticks
            with torch.no_grad():  # the same SGD update on both, from the reference's gradients
                for key, q in reference.items():
                    p = mine[key]
                    q -= 0.1 * q.grad
                    source = q.detach()
                    if is_expert(p):
                        per = source.shape[0] // ep.layout.ep.size
                        p.to_local().copy_(source[ep.layout.ep.rank * per:(ep.layout.ep.rank + 1) * per])
                    else:
                        p.copy_(source)
                    p.grad, q.grad = None, None
        sharded = sum(1 for p in mine.values() if is_expert(p))
        results[f"{name}/{schedule}"] = {"losses_equal": equal, "loss_gap": gap, "worst": worst,
                                         "missing": sorted(missing), "expert_params": sharded, "params": len(mine)}
        ep.close()
        dp.close()
    return results


def ep_state(rank: int, world: int, folder: str) -> dict:
    """The user's MoE model on (pp 2, ep 2) next to (pp 2, dp 2), after one step from the same state: the
    global gradient norm clip_grad_norm_ returns on each; the full state dict of the ep run against the dp
    run's (whole experts, the model's names and shapes); a checkpoint saved at ep 2 loaded by the dp run
    (ep 1) after the dp run has moved on (its parameters back to the ep run's, bitwise); then eval_step's
    losses of the two (the same weights)."""
    from pipeloom.runtime.parallel.ep import is_expert

    ep, dp = _engine(build_own(), "1f1b", "ep", "own"), _engine(build_own(), "1f1b", "dp", "own")
    x, y = _batch("own", 0)
    ep.step(x, target=y)
    dp.step(x, target=y)
    norms = (float(ep.clip_grad_norm_(1e-3)), float(dp.clip_grad_norm_(1e-3)))
    full, expected = ep.full_state_dict(), dp.full_state_dict()
    full_equal = full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full)
    shapes = {k: list(v.shape) for k, v in full.items()}
    for engine in (ep, dp):
        with torch.no_grad():
            for p in engine.parameters():
                p -= p.grad
    saved = {k: v.clone() for k, v in ep.full_state_dict().items()}
    ep.save_checkpoint(folder)
    dp.step(x, target=y)  # the dp run moves away from the saved state
    with torch.no_grad():
        for p in dp.parameters():
            p -= p.grad
    dp.load_checkpoint(folder)
    loaded = dp.full_state_dict()
    restored = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    evaluated = bool(torch.equal(ep.eval_step(x, target=y), dp.eval_step(x, target=y)))  # now the same weights
    local = [list(p.to_local().shape) for p in ep.parameters() if is_expert(p)]
    ep.close()
    dp.close()
    return {"norms": norms, "full_equal": full_equal, "restored": restored, "evaluated": evaluated,
            "shapes": shapes if rank == 0 else {},
            "local_expert_shapes": local}


def ep_disagree(rank: int, world: int) -> str:
    """Ranks 1 and 3 build their MoE layers with 2 experts, ranks 0 and 2 with 4: what pipeline() raises."""
    from pipeloom.runtime import PipelineError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Block(16, 2 if rank % 2 else 4), Block(16, 4), nn.Linear(16, 8))
    try:
        _engine(model, "1f1b", "ep", "own")
    except PipelineError as error:
        return str(error)
    return "no error"


class Failing(TopTwo):
    """Raises in its forward on the rank and step it is told (an expert's compute failing mid all-to-all)."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__(width, experts)
        self.switch = {"fail": False}  # shared with the copy that computes this rank's experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.switch["fail"]:
            raise RuntimeError("an expert failed on purpose")
        return super().forward(hidden_states, top_k_index, top_k_weights)


def ep_fault(rank: int, world: int, timeout: float) -> dict:
    """Global rank 1 (pp 0, ep 1) raises inside its experts' compute on the second step, between the dispatch
    and the combine all-to-all, and stays alive for timeout + 10 s: what every rank raises, and after how long."""
    import time

    from pipeloom.runtime import PipelineError

    model = build_own()
    for block in (model[1], model[2]):
        failing = Failing(16, 4)
        failing.load_state_dict(block.experts.state_dict())
        block.experts = failing
    engine = _engine(model, "1f1b", "ep", "own", timeout=timeout)
    x, y = _batch("own", 0)
    engine.step(x, target=y)
    if rank == 1:
        model[1].experts.switch["fail"] = True
    start = time.monotonic()
    try:
        engine.step(x, target=y)
        outcome = "no error"
    except PipelineError as error:
        outcome = str(error)
    elapsed = time.monotonic() - start
    if rank == 1:
        time.sleep(timeout + 10)  # alive: the others must not wait for its process to go
    return {"error": outcome[:400], "seconds": elapsed}


def ep_overlap(rank: int, world: int, name: str, steps: int = 2, link=None) -> dict:
    """``name`` under dualpipev on (pp 2, ep 2), overlapped pairs run one part after the other and interleaved at
    their all-to-alls (``overlap_pairs=True``; its all-to-alls held to ``link``, a simulated link, when given),
    from the same parameters: whether losses and gradients are bitwise equal, and how many times the interleaved
    run handed the baton over."""
    from pipeloom.runtime.parallel import overlap
    from pipeloom.runtime.parallel.ep import is_expert

    handed = [0]
    original = overlap.Baton.pass_on

    def counting(self, part: int) -> None:
        handed[0] += 1
        original(self, part)

    overlap.Baton.pass_on = counting  # type: ignore[method-assign]
    plain = _engine(_build(name), "dualpipev", "ep", name)
    interleaved = _engine(_build(name), "dualpipev", "ep", name, link=link)
    interleaved.overlap_pairs = True
    equal = True
    for step in range(steps):
        x, y = _batch(name, step)
        equal &= bool(torch.equal(plain.step(x, target=y), interleaved.step(x, target=y)))
        for (_, p), (_, q) in zip(plain.named_parameters(), interleaved.named_parameters()):
            a, b = (p.grad.to_local(), q.grad.to_local()) if is_expert(p) else (p.grad, q.grad)
            equal &= bool(torch.equal(a, b))
            p.grad, q.grad = None, None
    overlap.Baton.pass_on = original  # type: ignore[method-assign]
    plain.close()
    interleaved.close()
    return {"equal": equal, "handed": handed[0]}


def _capped(model: nn.Module, capacity: int) -> nn.Module:
    """``model`` with every experts module keeping at most ``capacity`` (token, choice) pairs per expert, the first
    in (token, choice) order, before its own forward (the reference: the drops worked out on one device, each
    replica's micro-batch alone; a pair's place among its expert's pairs counted by comparing every pair with
    every earlier one, not as the dispatch counts it). ``capacity`` is a number, not a formula of the traced
    sizes, so that torch.export sees no size arithmetic."""
    from pipeloom.runtime.parallel.ep import find_experts

    for name in find_experts(model, None):
        module = model.get_submodule(name)
        own = module.forward

        def forward(hidden_states, top_k_index, top_k_weights, own=own, count=module.num_experts):
            flat = top_k_index.reshape(-1)
            earlier = ((flat[None, :] == flat[:, None]).tril(-1)).sum(1)  # pairs before this one, same expert
            dropped = torch.where(earlier >= capacity, count, flat).view_as(top_k_index)
            return own(hidden_states, dropped, top_k_weights)

        module.forward = forward
    return model


def _moe_engine(model: nn.Module, dim: str, capacity_factor: float | None):
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import pipeline

    x, _ = tokens()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", dim))
    return pipeline(model, schedule="1f1b", split_points=["model.layers.2"], loss_fn=lm_loss, microbatches=4,
                    tracing=Tracing(tracer="export", example_inputs=(x[:2],)),
                    parallel=Parallelism(mesh=mesh, capacity_factor=capacity_factor), failures=Failures(timeout=120))


def _grads(engine) -> dict[str, torch.Tensor]:
    from pipeloom.runtime.parallel.ep import is_expert

    found = {}
    for key, p in engine.named_parameters():
        found[key] = p.grad.to_local().clone() if is_expert(p) else p.grad.clone()
        p.grad = None
    return found


def ep_capacity(rank: int, world: int, factor: float, steps: int = 2) -> dict:
    """Qwen3-MoE on (pp 2, ep 2), 1f1b, ``steps`` steps without an SGD update, in four runs: no capacity, a
    capacity large enough to drop nothing (4.0), ``factor`` with ep, and ``factor`` on (pp 2, dp 2) with the
    drops made by hand before each experts module's own forward. Returns whether the first two are bitwise
    equal (losses and gradients), whether the third's losses equal the fourth's bitwise, its worst gradient
    difference (relative to each tensor's largest reference gradient), and whether ``factor`` changed the loss."""
    plain, roomy = _moe_engine(build_moe("qwen3_moe"), "ep", None), _moe_engine(build_moe("qwen3_moe"), "ep", 4.0)
    capped = _moe_engine(build_moe("qwen3_moe"), "ep", factor)
    # each replica's micro-batch: 8 rows / (2 replicas x 4 micro-batches) x 6 tokens = 6 tokens, top-2 of 4
    capacity = math.ceil(factor * 6 * 2 / 4)
    reference = _moe_engine(_capped(build_moe("qwen3_moe"), capacity), "dp", None)
    same, equal, changed, worst = True, True, False, 0.0
    for step in range(steps):
        x, y = tokens(seed=step)
        losses = [engine.step(x, target=y) for engine in (plain, roomy, capped, reference)]
        same &= bool(torch.equal(losses[0], losses[1]))
        equal &= bool(torch.equal(losses[2], losses[3]))
        changed |= not torch.equal(losses[0], losses[2])
        grads = [_grads(engine) for engine in (plain, roomy, capped, reference)]
        same &= all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
        for key, grad in grads[2].items():
            expected = grads[3][key]
            if grad.shape != expected.shape:  # an expert shard: this ep rank's experts of the whole
                per = grad.shape[0]
                expected = expected[capped.layout.ep.rank * per:(capped.layout.ep.rank + 1) * per]
            worst = max(worst, float((grad - expected).abs().max()) / (float(expected.abs().max()) or 1.0))
    for engine in (plain, roomy, capped, reference):
        engine.close()
    return {"none_equals_roomy": same, "losses_equal": equal, "worst": worst, "changed": changed}


def ep_capacity_disagree(rank: int, world: int, field: str = "capacity_factor") -> str:
    """Rank 3 passes capacity_factor 2.0, the others 1.0 (``field="overlap_pairs"``: rank 3 True, the others False,
    which had aborted a process in gloo's all-to-all): what pipeline() raises on each. It is asked to trace with
    torch.fx, which cannot trace Qwen3-MoE: the refusal comes before the model is traced, or the trace's error
    would."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime import PipelineError, pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    try:
        pipeline(build_moe("qwen3_moe"), schedule="1f1b", split_points=["model.layers.2"], loss_fn=lm_loss,
                 microbatches=4, tracing=Tracing(tracer="fx"),
                 parallel=Parallelism(mesh=mesh, **{field: (2.0 if rank == 3 else 1.0) if field == "capacity_factor"
                                                    else rank == 3})).close()
    except PipelineError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


QWEN3_MOE_CONFIG = {"model_type": "qwen3_moe", "vocab_size": VOCAB, "num_hidden_layers": 4, "hidden_size": 32,
                    "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
"""build_moe("qwen3_moe")'s sizes as the config the cluster planner reads."""


def ep_plan(rank: int, world: int, path: str, steps: int = 2) -> dict:
    """Qwen3-MoE run from a saved cluster plan with ep 2 (``pipeline(model, plan=path)``, which builds the mesh)
    next to the same model on a (pp 2, dp 2) mesh with the plan's split points, schedule and micro-batches:
    the mesh it built, whether the losses are bitwise equal, the worst relative gradient difference."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.plan.plan import load_plan
    from pipeloom.runtime import pipeline
    from pipeloom.runtime.parallel.ep import is_expert

    plan = load_plan(path)
    x, _ = tokens()
    tracing = Tracing(tracer="export", example_inputs=(x[:2],))
    planned = pipeline(build_moe("qwen3_moe"), plan=path, loss_fn=lm_loss, tracing=tracing)
    reference = pipeline(build_moe("qwen3_moe"), schedule=plan.schedule, split_points=list(plan.split_points),
                         microbatches=plan.microbatches, loss_fn=lm_loss, tracing=tracing,
                         parallel=Parallelism(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))))
    equal, worst, experts = True, 0.0, 0
    for step in range(steps):
        x, y = tokens(seed=step)
        equal &= bool(torch.equal(planned.step(x, target=y), reference.step(x, target=y)))
        theirs = dict(reference.named_parameters())
        for key, p in planned.named_parameters():
            grad, expected = p.grad, theirs[key].grad
            if is_expert(p):
                experts += 1
                grad = grad.to_local()
                per = grad.shape[0]
                expected = expected[planned.layout.ep.rank * per:(planned.layout.ep.rank + 1) * per]
            worst = max(worst, float((grad - expected).abs().max()) / (float(expected.abs().max()) or 1.0))
            p.grad, theirs[key].grad = None, None
    layout = planned.layout
    found = {"where": layout.where(), "ep": layout.ep.size, "replicas": layout.dp.size, "equal": equal,
             "worst": worst, "experts": experts, "microbatches": planned.lowering.schedule.num_microbatches}
    planned.close()
    reference.close()
    return found


def _step_and_compare(ours, theirs, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, float, set]:
    """One step of both engines from the same parameters: whether the losses are bitwise equal, the worst
    gradient difference relative to each tensor's largest reference gradient (an expert shard against its slice
    of the whole), the parameters without a gradient; then the same SGD update on both, from ``theirs``'s
    gradients."""
    from pipeloom.runtime.parallel.ep import is_expert

    equal = bool(torch.equal(ours.step(x, target=y), theirs.step(x, target=y)))
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    worst, missing = 0.0, set()
    ep = ours.layout.ep
    for key, p in mine.items():
        q = reference[key]
        if p.grad is None:
            missing.add(key)
            continue
        grad, expected = p.grad, q.grad
        if is_expert(p):
            per = expected.shape[0] // ep.size
            grad, expected = p.grad.to_local(), expected[ep.rank * per:(ep.rank + 1) * per]
        worst = max(worst, float((grad - expected).abs().max()) / (float(expected.abs().max()) or 1.0))
    with torch.no_grad():
        for key, q in reference.items():
            p = mine[key]
            q -= 0.1 * q.grad
            if is_expert(p):
                per = q.shape[0] // ep.size
                p.to_local().copy_(q.detach()[ep.rank * per:(ep.rank + 1) * per])
            else:
                p.copy_(q.detach())
            p.grad, q.grad = None, None
    return equal, worst, missing


@traces_before_fork(lambda steps=2: _trace_meshes("qwen3_moe", tokens(rows=16)[0][:1]))
def ep_with_dp(rank: int, world: int, steps: int = 2) -> dict:
    """8 ranks: Qwen3-MoE, 1f1b, on ("dp" 2, "pp" 2, "ep" 2) — 4 replicas per stage (dp index × 2 + ep index),
    experts shared over "ep" and their gradients summed over "dp" — against ("dp" 4, "pp" 2) with each rank's
    replica index and pipeline rank the same as in the ep run (the reference mesh lists the ranks so), from the
    same parameters each step: losses bitwise, the worst relative gradient difference, parameters without a
    gradient, the sizes of the groups."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from pipeloom.runtime import pipeline
    from pipeloom.runtime.parallel.ep import is_expert

    grid = torch.arange(world).reshape(2, 2, 2)  # (dp, pp, ep): global rank = dp·4 + pp·2 + ep
    meshes = {"ep": init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "ep")),
              "dp": DeviceMesh("cpu", grid.permute(0, 2, 1).reshape(4, 2), mesh_dim_names=("dp", "pp"))}
    x, _ = tokens(rows=16)
    engines = {name: pipeline(build_moe("qwen3_moe"), schedule="1f1b", split_points=["model.layers.2"],
                              loss_fn=lm_loss, microbatches=4, failures=Failures(timeout=300),
                              tracing=Tracing(tracer="export", example_inputs=(x[:1],)),
                              parallel=Parallelism(mesh=mesh)) for name, mesh in meshes.items()}
    ours, theirs = engines["ep"], engines["dp"]
    equal, worst, missing = True, 0.0, set()
    for step in range(steps):
        x, y = tokens(rows=16, seed=step)
        same, far, absent = _step_and_compare(ours, theirs, x, y)
        equal, worst, missing = equal and same, max(worst, far), missing | absent
    found = {"equal": equal, "worst": worst, "missing": sorted(missing), "replicas": ours.layout.dp.size,
             "ep": ours.layout.ep.size, "expert_dp": ours.layout.ep.dp_size, "where": ours.layout.where(),
             "experts": sum(1 for p in ours.parameters() if is_expert(p)),
             "same_rank": ours.layout.rank == theirs.layout.rank and ours.layout.dp.rank == theirs.layout.dp.rank}
    ours.close()
    theirs.close()
    return found


def ep_profile(rank: int, world: int) -> dict:
    """The user's MoE model profiled in the engine on a (pp 2, ep 2) mesh (EngineProfiler, pieces 0..3, 2
    micro-batches of 4 tokens): each piece's counted collectives per micro-batch, (kind, phase, bytes), and the
    table's pieces after two timed steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.profile.engine import EngineProfiler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    x, y = _batch("own", 0)
    profiler = EngineProfiler(build_own(), x, loss_fn=F.mse_loss, target=y, microbatches=2,
                              pieces=["0", "1", "2", "3"], exchange=False, leaf_modules=["1.experts", "2.experts"],
                              mesh=mesh)
    profiler.step()
    counted = profiler.count()
    profiler.step()
    profiler.step()
    table = profiler.table(skip=1)
    for engine in profiler.engines:
        engine.close()
    from pipeloom.profile.in_engine import profile_in_engine

    model = build_own()
    measured = profile_in_engine(model, x, loss_fn=F.mse_loss, target=y, microbatches=2, pieces=["0", "1", "2", "3"],
                                 leaf_modules=["1.experts", "2.experts"], mesh=mesh, warmup_steps=1, steps=2)
    whole = {name: sum(p.numel() * 4 for p in model.get_submodule(name).parameters()) for name in ("0", "1", "2", "3")}
    return {"counted": {name: sorted((c.kind, c.phase, c.bytes) for c in found) for name, found in counted.items()},
            "pieces": [(p.name, p.f, p.i) for p in table.pieces],
            "param_bytes": [(p.param_bytes, whole[p.name]) for p in measured.pieces],
            "times": [(p.f, p.i) for p in measured.pieces], "device": measured.device}
