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
