"""One exception hierarchy: every bad argument of the public API raises a PipeloomError; wrong types
are also TypeErrors, bad values also ValueErrors (oracle: isinstance on what the calls raise)."""

from __future__ import annotations

import pytest

import pipeloom
from pipeloom.errors import ArgumentError, ArgumentTypeError, PipeloomError


@pytest.mark.parametrize(("args", "kwargs", "words"), [
    (("1f1b", 4, 8), {"costs": "fast"}, "costs must be a pipeloom.Costs"),
    (("1f1b", 4, 8), {"memory_limit": "3"}, "memory_limit must be a number"),
    (("1f1b", 4.0, 8), {}, "num_ranks must be an integer"),
    ((3, 4, 8), {}, "name must be a schedule name"),
])
def test_wrong_types_are_type_errors_and_pipeloom_errors(args, kwargs, words):
    with pytest.raises(ArgumentTypeError, match=words) as caught:
        pipeloom.build_schedule(*args, **kwargs)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, PipeloomError)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv", "interleaved-1f1b"])
def test_bad_counts_are_pipeloom_errors(name):
    for ranks, microbatches in ((0, 8), (4, 0), (-1, 8)):
        with pytest.raises(ArgumentError) as caught:
            pipeloom.build_schedule(name, ranks, microbatches)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, PipeloomError)
