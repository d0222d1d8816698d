"""The step descriptions ranks compare before a step (pipeloom.runtime.step.agree), without processes:
their texts, and that one rank compares nothing. The multi-rank mismatches are in test_faults.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.errors import PipelineError, StepMismatchError
from pipeloom.runtime.step.agree import FIELDS, agree_on_step, describe_step, describe_value


def test_values_are_described_by_dtype_and_shape():
    assert describe_value(torch.zeros(16, 8)) == "float32[16, 8]"
    assert describe_value(torch.zeros(4, dtype=torch.int64)) == "int64[4]"
    nested = (torch.zeros(2, 3), [torch.zeros(1, dtype=torch.float64)])
    assert describe_value(nested) == "(float32[2, 3], [float64[1]])"
    assert describe_value(None) == "none"
    assert describe_value("tokens") == "str"


def test_a_step_is_described_field_by_field():
    x, y = torch.zeros(16, 4), torch.zeros(16, dtype=torch.int64)
    assert describe_step(microbatches=8, training=True, inputs=x, target=y) == (
        "8", "step()", "float32[16, 4]", "int64[16]")
    assert describe_step(microbatches=8, training=False, inputs=x, target=None)[1:] == (
        "eval_step()", "float32[16, 4]", "none")
    assert len(FIELDS) == 4


def test_a_mismatch_is_a_pipeline_error():
    assert issubclass(StepMismatchError, PipelineError)


def test_one_rank_compares_nothing():
    def refuse(*args, **kwargs):
        raise AssertionError("a world of one rank must not communicate")

    agree_on_step(torch.zeros(8, 2), torch.zeros(8), training=True, microbatches=4, group=None, world=1, rank=0,
                  device=torch.device("cpu"), wait=refuse)
