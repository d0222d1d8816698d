"""Cutting a model's pieces into pipeline stages: the rules (rules), the exact chain DP (chain) and its big-table form
(caps), the per-schedule partitioner (partitioner) and shapes (shape), and the CP-SAT DAG partitioner (dag,
dag_graph, dag_model)."""
