"""Cluster planning from a model's config and a GPU name: exact per-layer counts, a step-time and memory
estimate for one layout (dp x tp x pp x cp x ep, schedule, recomputation) and a search over layouts.
Torch-free: reads transformers configs without importing transformers."""

from pipeloom.plan.cluster.config import ModelConfigError, ModelSpec, model_spec
from pipeloom.plan.cluster.counts import layer_counts, model_params

__all__ = ["ModelConfigError", "ModelSpec", "layer_counts", "model_params", "model_spec"]
