"""Cluster planning from a model's config and a GPU name: exact per-layer counts, a step-time and memory
estimate for one layout (dp x tp x pp x cp x ep, schedule, recomputation) and a search over layouts
(:func:`plan_cluster`, the Python side of ``pipeloom plan --model``). Torch-free: reads transformers configs
without importing transformers."""

from pipeloom.plan.cluster.api import ClusterPlan, plan_cluster
from pipeloom.plan.cluster.counts import layer_counts, model_params
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.model.spec import ModelSpec
from pipeloom.plan.errors import LayoutError, ModelConfigError, NoLayoutFits

__all__ = ["ClusterPlan", "Layout", "LayoutError", "ModelConfigError", "ModelSpec", "NoLayoutFits", "layer_counts",
           "model_params", "model_spec", "plan_cluster"]
