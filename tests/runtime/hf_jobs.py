"""What each spawned rank runs in the transformers-model runtime tests (importable by the child processes)."""

from __future__ import annotations

import copy
from functools import partial

from ranks import traces_before_fork

from pipeloom.runtime import Failures


def _traced(name: str) -> tuple:
    """``name``'s model built and traced whole as :func:`hf_exactness` cuts it: (model, trace)."""
    from hf_models import build_hf, hf_batch

    from pipeloom.runtime.model.tracing import trace_model

    model = build_hf(name)
    example = hf_batch(name)[0]
    return model, trace_model(model, tracer="export",
                              example_inputs=example if isinstance(example, tuple) else (example,))


def _trace_models(cases: list[tuple[str, str, int]], steps: int = 2) -> None:
    for name in dict.fromkeys(name for name, _, _ in cases):
        _traced(name)


@traces_before_fork(_trace_models)
def hf_exactness(rank: int, world: int, cases: list[tuple[str, str, int]], steps: int = 2) -> dict:
    """For every (model, schedule, pieces): ``steps`` SGD steps with the engine and with the unsplit model's
    for-loop reference (the second step with a shorter sequence); mismatching parameters, whether the
    losses agree, and the shared (tied) parameters' values after training."""
    from hf_models import hf_splits, lm_loss
    from models import train_beside_reference

    from pipeloom.runtime import pipeline, split_model

    results = {}
    traced: dict = {}  # one torch.export trace per model, cut several ways
    for name, schedule, pieces in cases:
        if name not in traced:
            model, trace = _traced(name)
            traced[name] = (model, copy.deepcopy(model.state_dict()), trace)
        model, initial, trace = traced[name]
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=schedule,
            stages=split_model(trace, hf_splits(name, pieces)),
            loss_fn=lm_loss,
            microbatches=4,
            failures=Failures(timeout=60),
        )
        problems, losses_equal, owned = train_beside_reference(
            engine, model, reference, lm_loss, partial(_batch, name), steps)
        shared = {name: p.detach().flatten().tolist() for name, p in zip(engine.shared.names, engine.shared.params)
                  if id(p) in owned}
        results[f"{name}/{schedule}"] = {"mismatches": problems, "losses_equal": bool(losses_equal),
                                         "owned": len(owned), "shared": shared,
                                         "uses": dict(zip(engine.shared.names, engine.shared.uses))}
    return results


def _batch(name: str, step: int) -> tuple:
    """Step ``step``'s batch of ``name``: the second step with a shorter sequence."""
    from hf_models import hf_batch

    return hf_batch(name, seq=12 if step == 0 else 7, seed=step)


def hf_dropout(rank: int, world: int, schedules: list[str], steps: int = 2, name: str = "gpt2") -> dict:
    """GPT-2 with dropout 0.1 (or ``name``, a family of ``hf_models.RANDOM`` whose forward draws random numbers
    itself, without dropout) cut into 4 pieces: the engine's losses, gradients and SGD updates against the
    single-process reference with the runtime's random numbers (pipeloom.runtime.reference_step), run
    on the same model from the same state just before each engine step."""
    import torch
    from hf_models import build_hf, hf_splits, lm_loss, tokens

    from pipeloom.runtime import pipeline, reference_step, split_model

    x, y = tokens()
    model = build_hf(name, dropout=0.1 if name == "gpt2" else 0.0)
    initial = copy.deepcopy(model.state_dict())
    staged = split_model(model, hf_splits(name, 4), tracer="export", example_inputs=(x,))
    params = dict(model.named_parameters())
    results = {}
    for schedule in schedules:
        model.load_state_dict(initial)
        engine = pipeline(
            model,
            schedule=schedule,
            stages=staged,
            loss_fn=lm_loss,
            microbatches=4,
            seed=1234,
            failures=Failures(timeout=60),
        )
        owned = {id(p) for p in engine.parameters()}
        problems, losses = [], []
        for step in range(steps):
            before = {name: p.detach().clone() for name, p in params.items()}
            expected = reference_step(staged, x, y, loss_fn=lm_loss, microbatches=4, seed=1234, step=step)
            grads = {name: p.grad.clone() for name, p in params.items()}
            with torch.no_grad():
                for p in params.values():
                    p.grad = None
            loss = engine.step(x, target=y)
            losses.append((float(loss), float(expected)))
            problems += [f"step {step}: {name}.grad" for name, p in params.items()
                         if id(p) in owned and not torch.equal(p.grad, grads[name])]
            with torch.no_grad():
                for name, p in params.items():  # SGD on the reference gradients, the same on every rank
                    p.copy_(before[name] - 0.1 * grads[name])
                    p.grad = None
        with torch.no_grad():
            model.eval()
            plain = sum(float(lm_loss(model(xm), ym)) / 4 for xm, ym in zip(torch.chunk(x, 4), torch.chunk(y, 4)))
            model.train()
        results[schedule] = {"mismatches": problems, "losses": losses, "no_dropout_loss": plain}
    return results


def hf_plan(rank: int, world: int, path: str, steps: int = 2) -> dict:
    """The tiny LLaMA trained from a saved plan file (``pipeline(model, plan=path)``: its split points, schedule
    and micro-batches) next to the unsplit model's for-loop reference, as :func:`hf_exactness` reports it."""
    from hf_models import build_hf, hf_batch, lm_loss
    from models import train_beside_reference

    from pipeloom.plan.plan import load_plan
    from pipeloom.runtime import Tracing, pipeline

    plan = load_plan(path)
    model = build_hf("llama")
    reference = copy.deepcopy(model)
    engine = pipeline(model, plan=path, loss_fn=lm_loss, failures=Failures(timeout=60),
                      tracing=Tracing(tracer="export", example_inputs=(hf_batch("llama")[0],)))
    problems, losses_equal, _ = train_beside_reference(engine, model, reference, lm_loss, partial(_batch, "llama"),
                                                       steps, microbatches=plan.microbatches)
    return {plan.schedule: {"mismatches": problems, "losses_equal": bool(losses_equal),
                            "microbatches": engine.lowering.schedule.num_microbatches}}
