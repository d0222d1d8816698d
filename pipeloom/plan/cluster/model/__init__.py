"""A decoder model from its transformers config, for the cluster planner: where the config comes from
(:mod:`~pipeloom.plan.cluster.model.source`), the family readers (:mod:`~pipeloom.plan.cluster.model.reader`) and
the shape they give (:mod:`~pipeloom.plan.cluster.model.spec`). Torch-free and transformers-free."""
