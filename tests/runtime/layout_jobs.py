"""What each spawned rank runs in the boundary-layout tests (importable by the child processes): a tiny
random-init ``transformers`` ConvNeXt, whose stage-boundary activations are channels-last."""

from __future__ import annotations

import copy

from pipeloom.runtime import Failures

STAGES = 4


def build_convnext(seed: int = 0):
    import torch
    import transformers as T

    torch.manual_seed(seed)
    config = T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1], num_labels=5,
                              image_size=32, patch_size=2, drop_path_rate=0.0)
    return T.ConvNextForImageClassification(config)


def convnext_splits(pieces: int) -> list[str]:
    step = STAGES // pieces
    return [f"convnext.encoder.stages.{k}" for k in range(step, STAGES, step)]


def logits_loss(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output.logits, target)


def images(rows: int = 8, side: int = 32, seed: int = 1):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, side, side, generator=generator), torch.randint(0, 5, (rows,), generator=generator)


def convnext_exactness(rank: int, world: int, cases: list[tuple[str, int]], steps: int = 2) -> dict:
    """For every (schedule, pieces): ``steps`` SGD steps of ConvNeXt split without example_inputs, next to the
    unsplit model's for-loop reference (the second step with smaller images); mismatching parameters, whether
    the losses agree, and the boundary activations' strides as the receiving stages saw them."""
    from models import train_beside_reference

    from pipeloom.runtime import pipeline

    results = {}
    for schedule, pieces in cases:
        model = build_convnext()
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=convnext_splits(pieces),
            loss_fn=logits_loss,
            microbatches=4,
            failures=Failures(timeout=60),
        )
        problems, losses_equal, owned = train_beside_reference(
            engine, model, reference, logits_loss, lambda step: images(side=32 if step == 0 else 16, seed=step), steps)
        strides = sorted({m.stride for metas in engine._meta_cache.values() for ms in metas[0].values()
                          for m in ms if getattr(m, "stride", ())})
        results[f"convnext/{schedule}"] = {"mismatches": problems, "losses_equal": bool(losses_equal),
                                           "owned": len(owned), "strides": strides}
    return results
