"""What each spawned rank runs in the symbolic-size tests (importable by the child processes): a tiny random-init
``transformers`` Mamba2, whose scan pads the sequence to a multiple of its chunk size with a size computed from
the input's (``Mod(8 - Mod(seq, 8), 8)``) that every layer uses."""

from __future__ import annotations

import copy

from pipeloom.runtime import Failures

LAYERS = 4


def build_mamba2(seed: int = 0):
    import torch
    import transformers as T

    torch.manual_seed(seed)
    config = T.Mamba2Config(vocab_size=96, hidden_size=32, num_hidden_layers=LAYERS, state_size=8, expand=2,
                            head_dim=8, num_heads=8, n_groups=1, chunk_size=8, conv_kernel=4, use_cache=False)
    return T.Mamba2ForCausalLM(config)


def mamba_splits(pieces: int) -> list[str]:
    step = LAYERS // pieces
    return [f"backbone.layers.{k}" for k in range(step, LAYERS, step)]


def mamba2_exactness(rank: int, world: int, cases: list[tuple[str, int]], steps: int = 2) -> dict:
    """For every (schedule, pieces): ``steps`` SGD steps of Mamba2 split without example_inputs, next to the
    unsplit model's for-loop reference (the second step with a sequence length that pads differently)."""
    from hf_models import lm_loss, tokens
    from models import train_beside_reference

    from pipeloom.runtime import pipeline

    results = {}
    for schedule, pieces in cases:
        model = build_mamba2()
        reference = copy.deepcopy(model)
        engine = pipeline(
            model,
            schedule=schedule,
            split_points=mamba_splits(pieces),
            loss_fn=lm_loss,
            microbatches=4,
            failures=Failures(timeout=60),
        )
        problems, losses_equal, owned = train_beside_reference(
            engine, model, reference, lm_loss, lambda step: tokens(seq=12 if step == 0 else 7, seed=step), steps)
        results[f"mamba2/{schedule}"] = {"mismatches": problems, "losses_equal": bool(losses_equal),
                                         "owned": len(owned)}
    return results
