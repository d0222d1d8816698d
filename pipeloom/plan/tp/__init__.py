"""Tensor parallelism in the cost model: collectives priced on a mesh dimension (collectives), Megatron's formulas
(megatron), measured sizes (measured), the sharding search (sharding) and saved plans as recipes (recipes)."""
