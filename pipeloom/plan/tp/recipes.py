"""Tensor-parallel plans as JSON: a built-in recipe name and the module names it shards, as a saved plan
carries them, turned into torch's ``{module name: ParallelStyle}`` dict only where torch runs
(:func:`pipeloom.runtime.parallel.tp.recipe_styles`, where torch runs).

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

``head_norm`` (optional, either recipe): per-head norms applied after the heads are split, e.g. Qwen3's
``self_attn.q_norm``/``k_norm`` over ``head_dim`` of ``q_proj(x).view(B, T, heads, head_dim)``; each becomes
``SequenceParallel(sequence_dim=-2, use_local_output=True)`` (transformers' ``replicated_with_grad_allreduce``):
its weight stays whole on every rank and its gradient, which each rank computes over its own heads only, is
summed over ``"tp"``. A plan without the key loads as before (an empty list).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeloom.plan.errors import RecipeError

__all__ = ["RECIPES", "check_recipe"]

RECIPES = ("megatron", "megatron-sp")
_LISTS = ("column", "row", "sequence", "gather", "vocab_embedding", "vocab_head", "loss_head", "head_norm")
_UNSHARDED = ("sequence", "gather", "head_norm")  # lists whose modules keep their parameters whole


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
    if not seen.difference(*(found[key] for key in _UNSHARDED)):
        raise RecipeError("tp_plan shards no module; name at least one column, row or vocab module")
    return found

