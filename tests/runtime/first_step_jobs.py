"""What each spawned rank runs in the split-at-the-first-step tests (importable by the child processes)."""

from __future__ import annotations

import copy

from pipeloom.runtime import Failures


def hf_first_step(rank: int, world: int, cases: list[tuple[str, str, int]], steps: int = 2) -> dict:
    """For every (model, schedule, pieces): ``pipeline()`` with split points and no example_inputs (the model
    is traced on the first batch), the optimizer built on ``engine.parameters()`` before that step; ``steps``
    SGD steps (the second with a shorter sequence) next to the unsplit model's for-loop reference: whether
    the engine was unsplit until its first step, mismatching parameters and whether the losses agree."""
    from hf_models import build_hf, hf_splits, lm_loss, tokens
    from models import train_beside_reference

    from pipeloom.runtime import pipeline

    results = {}
    for name, schedule, pieces in cases:
        model = build_hf(name)
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=hf_splits(name, pieces),
            loss_fn=lm_loss,
            microbatches=4,
            failures=Failures(timeout=60),
        )
        unsplit = not engine.split
        # the optimizer holds every parameter of the model, before the split; this rank's are known after a step
        problems, losses_equal, owned = train_beside_reference(
            engine, model, reference, lm_loss, lambda step: tokens(seq=12 if step == 0 else 7, seed=step), steps)
        problems += [f"{n} has a gradient on another rank" for n, p in model.named_parameters()
                     if id(p) not in owned and p.grad is not None and p.grad.count_nonzero()]
        results[f"{name}/{schedule}"] = {"mismatches": problems, "losses_equal": bool(losses_equal),
                                         "owned": len(owned), "total": len(list(model.parameters())),
                                         "unsplit_before": unsplit}
    return results


def planned_first_step(rank: int, world: int, name: str, path: str) -> dict:
    """``name``'s tiny model from the saved cluster plan at ``path`` without example_inputs: what
    ``engine.parameters()`` says before the first step (the parameters' count, or the refusal), and whether every
    parameter it gives after that step changes in an SGD step."""
    import torch
    from hf_models import build_hf, lm_loss, tokens

    from pipeloom.runtime import PipelineError, pipeline

    engine = pipeline(build_hf(name), plan=path, loss_fn=lm_loss, failures=Failures(timeout=60))
    try:
        before: object = len(engine.parameters())
    except PipelineError as error:
        before = str(error)
    x, y = tokens()
    engine.step(x, target=y)
    params = engine.parameters()
    start = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    return {"before": before, "unchanged": sum(bool(torch.equal(a, b)) for a, b in zip(start, params)),
            "after": len(params), "split": engine.split}


def optimizer_before_split_checkpoint(rank: int, world: int, folder: str) -> dict:
    """GPT-2 without example_inputs under 1f1b, AdamW built before the first step on engine.named_parameters() in
    the usual two weight-decay groups (docs/runtime.md allows it: it then holds every parameter of the model, the
    other ranks' never stepped): two steps, save_checkpoint (it had been refused: "the optimizer holds 18
    parameter(s) that this rank's stages do not"), then an engine split at pipeline() loads it into an optimizer
    built the same way and takes the third step: whether its loss is the uninterrupted run's."""
    import torch
    from hf_models import build_hf, hf_splits, lm_loss, tokens

    from pipeloom.runtime import Tracing, pipeline

    def grouped(engine) -> torch.optim.Optimizer:
        named = list(engine.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)

    def run(engine, optimizer, steps) -> list[float | None]:
        losses = []
        for step in steps:
            x, y = tokens(seed=step)
            loss = engine.step(x, target=y)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(None if loss is None else float(loss))
        return losses

    options = dict(schedule="1f1b", split_points=hf_splits("gpt2", world), loss_fn=lm_loss, microbatches=4,
                   failures=Failures(timeout=60))
    engine = pipeline(build_hf("gpt2"), **options)
    optimizer = grouped(engine)
    first = run(engine, optimizer, range(2))
    engine.save_checkpoint(folder, optimizer=optimizer)
    third = run(engine, optimizer, [2])
    x, _ = tokens(seed=2)
    resumed = pipeline(build_hf("gpt2", seed=5), **options, tracing=Tracing(example_inputs=(x,)))
    again = grouped(resumed)
    resumed.load_checkpoint(folder, optimizer=again)
    return {"first": first, "third": third, "resumed": run(resumed, again, [2])}
