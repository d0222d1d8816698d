"""Mesh dimensions besides the pipeline: data parallel (dp), FSDP (fsdp), tensor parallel (tp, tp_auto, tp_rules) and
the tp scatter of boundary tensors (scatter)."""
