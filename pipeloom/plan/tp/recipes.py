"""Tensor-parallel plans as JSON: a built-in recipe name and the module names it shards, as a saved plan
carries them, turned into torch's ``{module name: ParallelStyle}`` dict only where torch runs
(:func:`recipe_styles`; torch is imported there, not at import time).

``{"recipe": "megatron", "column": [...], "row": [...], "sequence": [...], "vocab_embedding": [...],
"vocab_head": [...]}``: ``column`` modules become ``ColwiseParallel()``, ``row`` ones ``RowwiseParallel()``,
``vocab_embedding`` (an ``nn.Embedding``) ``RowwiseParallel(input_layouts=Replicate())`` (vocabulary-parallel:
each rank looks up its rows, the output is all-reduced), ``vocab_head`` ``ColwiseParallel(output_layouts=
Replicate())`` (vocabulary-parallel logits, all-gathered), ``loss_head`` ``ColwiseParallel(output_layouts=
Shard(-1), use_local_output=False)`` (vocabulary-sharded DTensor logits for a loss under ``loss_parallel()``).
Recipe ``"megatron-sp"`` adds sequence parallelism, laid out as torch's tensor-parallel tutorial does:
``sequence`` modules (norms) become ``SequenceParallel()``, ``gather`` modules (a region's own module, e.g. the
attention block) get ``PrepareModuleInput`` from the sequence-sharded stream (``Shard(1)``) to a whole one (one
all-gather), column modules inside them read that whole input and the others read the sharded stream
(``input_layouts=Shard(1)``: an all-gather each), row modules write a sharded one (``output_layouts=Shard(1)``:
a reduce-scatter), the embedding writes it and the head reads it.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeloom.plan.errors import RecipeError

__all__ = ["RECIPES", "check_recipe", "recipe_styles"]

RECIPES = ("megatron", "megatron-sp")
_LISTS = ("column", "row", "sequence", "gather", "vocab_embedding", "vocab_head", "loss_head")


def check_recipe(recipe: object) -> dict:
    """``recipe`` normalised (every list present, names as lists of strings); RecipeError naming the problem."""
    if not isinstance(recipe, Mapping):
        raise RecipeError(f"tp_plan must be an object {{'recipe': 'megatron', 'column': [...], 'row': [...]}}, "
                          f"got {recipe!r}")
    unknown = sorted(set(recipe) - {"recipe", *_LISTS})
    if unknown:
        raise RecipeError(f"tp_plan: unknown key(s) {unknown}; known: recipe, {', '.join(_LISTS)}")
    if recipe.get("recipe") not in RECIPES:
        raise RecipeError(f"tp_plan recipe must be one of {', '.join(RECIPES)}, got {recipe.get('recipe')!r}")
    found = {"recipe": recipe["recipe"]}
    seen: set[str] = set()
    for key in _LISTS:
        names = recipe.get(key, [])
        if isinstance(names, str) or not isinstance(names, (list, tuple)) \
                or not all(isinstance(n, str) and n for n in names):
            raise RecipeError(f"tp_plan.{key} must be a list of module names, got {names!r}")
        twice = seen & set(names)
        if twice:
            raise RecipeError(f"tp_plan names {sorted(twice)} twice; give each module one style")
        seen |= set(names)
        found[key] = list(names)
    for key in ("sequence", "gather"):
        if recipe["recipe"] == "megatron" and found[key]:
            raise RecipeError(f"tp_plan.{key} needs recipe 'megatron-sp' (sequence parallelism)")
    if not seen - set(found["sequence"]) - set(found["gather"]):
        raise RecipeError("tp_plan shards no module; name at least one column, row or vocab module")
    return found


def recipe_styles(recipe: Mapping) -> dict:
    """torch's ``parallelize_module`` plan for ``recipe`` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    recipe = check_recipe(recipe)
    sp = recipe["recipe"] == "megatron-sp"
    styles: dict = {}
    for name in recipe["sequence"]:
        styles[name] = SequenceParallel(use_local_output=True)  # the residual stream stays a local shard
    for name in recipe["gather"]:  # (B, T/tp, h) shard -> (B, T, h): one all-gather for the whole region
        styles[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for name in recipe["column"]:
        inside = any(name.startswith(region + ".") for region in recipe["gather"])
        styles[name] = ColwiseParallel(input_layouts=Shard(1)) if sp and not inside else ColwiseParallel()
    for name in recipe["row"]:
        styles[name] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    for name in recipe["vocab_embedding"]:
        styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    for name in recipe["vocab_head"]:
        styles[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    for name in recipe["loss_head"]:
        styles[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                       use_local_output=False)
    return styles
