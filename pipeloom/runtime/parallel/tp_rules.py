"""DTensor's own sharding rules as the sharding search's candidates: which options of the hand table
(:data:`pipeloom.plan.tp.sharding.OPTIONS`) torch's per-operator single-dimension strategies offer, read from its
registry (private: ``DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs``)."""

from __future__ import annotations

import torch

__all__ = ["dtensor_options"]


# The layouts ([output, inputs...], on one mesh dimension) each option asks of DTensor's per-operator rules:
# a linear is aten.mm of x (tokens, in) and the weight's transpose (in, out); an embedding is aten.embedding.
_NEEDS = {
    "column": ("mm", ("S1", "R", "S1")),  # input whole, weight columns sharded -> output features sharded
    "row": ("mm", ("P", "S1", "S0")),  # input features sharded, weight rows sharded -> partial sums
    "vocab rows": ("embedding", ("P", "S0", "P")),  # weight rows sharded -> masked partial output
}
_OPTION_NEEDS = {"megatron": ("column", "row"), "megatron-sp": ("column", "row"), "vocab": ("column",),
                 "vocab-loss": ("column",)}


def _placement(p: object) -> str:
    """``R``, ``S<dim>`` (a Shard or a placeholder for one) or ``P`` (a sum Partial, masked or not)."""
    name = type(p).__name__
    if name == "Replicate":
        return "R"
    dim = getattr(p, "dim", None)
    if isinstance(dim, int):
        return f"S{dim}"
    return "P" if "Partial" in name and getattr(p, "reduce_op", "") == "sum" else name


def dtensor_options() -> dict[str, tuple[str, ...]]:
    """Per region, the options of :data:`pipeloom.plan.tp.sharding.OPTIONS` whose layouts DTensor's own
    single-dimension sharding rules offer (``aten.mm`` for the linears: column- and row-parallel;
    ``aten.embedding``: vocabulary rows); ``replicate`` always. Reads torch's registry
    (``DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs``, private: TensorParallelError
    where this torch has none)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    from pipeloom.plan.errors import TensorParallelError
    from pipeloom.plan.tp.sharding import OPTIONS

    aten = torch.ops.aten
    try:
        rules = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
        mm, embedding = rules[aten.mm.default], rules[aten.embedding.default]
    except (AttributeError, KeyError) as error:
        raise TensorParallelError(f"this torch ({torch.__version__}) exposes no single-dimension sharding rules "
                                  f"for aten.mm and aten.embedding ({error!r}); the hand table cannot be checked"
                                  ) from error

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
        t = torch.empty(shape, dtype=dtype, device="meta")
        return TensorMeta(t.shape, t.stride(), t.dtype)

    offered = {"mm": {tuple(map(_placement, s)) for s in mm(aten.mm.default, (meta(4, 8), meta(8, 6)), {})},
               "embedding": {tuple(map(_placement, s)) for s in embedding(
                   aten.embedding.default, (meta(10, 8), meta(4, 5, dtype=torch.long)), {})}}
    found = {layout for layout, (op, placements) in _NEEDS.items() if placements in offered[op]}
    options = {}
    for region, names in OPTIONS.items():
        def needs(option: str, region: str = region) -> set[str]:
            return {"vocab rows"} if (region, option) == ("embedding", "vocab") else set(_OPTION_NEEDS.get(option, ()))

        options[region] = tuple(o for o in names if needs(o) <= found)
    return options
