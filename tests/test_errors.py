"""One exception hierarchy: every bad argument of the public API raises a PipeloomError; wrong types
are also TypeErrors, bad values also ValueErrors (oracle: isinstance on what the calls raise)."""

from __future__ import annotations

import dataclasses
import re

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


@pytest.mark.parametrize(("name", "ranks", "microbatches", "options", "words"), [
    ("dualpipe", 2, 3, {}, "dualpipe needs an even number of micro-batches"),
    ("chimera", 2, 3, {}, "chimera feeds half of the micro-batches to each pipeline"),
    ("interleaved-1f1b", 2, 4, {"stages_per_rank": 0}, "stages_per_rank"),
])
def test_every_schedules_own_refusals_are_pipeloom_errors(name, ranks, microbatches, options, words):
    """dualpipe's, chimera's and the looped schedules' own checks had raised bare ValueErrors, which
    `except PipeloomError` (examples/train_hf.py) did not catch."""
    with pytest.raises(ArgumentError, match=words):
        pipeloom.build_schedule(name, ranks, microbatches, **options)


def test_costs_whose_sums_overflow_are_refused_naming_the_fix():
    from pipeloom import Costs

    with pytest.raises(ArgumentError, match=r"^costs f=1, b=1e\+308, w=1, memory=1 over 4 micro-batches overflow the "
                                            "float range"):  # the fields, not the dataclass's repr
        pipeloom.build_schedule("zbv", 2, 4, costs=Costs(b=1e308))


def test_a_replay_whose_times_overflow_is_refused():
    from pipeloom import Costs, simulate
    from pipeloom.ir import Schedule

    schedule = pipeloom.build_schedule("1f1b", 2, 4, costs=Costs(f=1e300))
    problem = dataclasses.replace(schedule.problem, tasks=tuple(dataclasses.replace(t, duration=1.7e308)
                                                                 for t in schedule.problem.tasks))
    with pytest.raises(PipeloomError, match="overflow the float range"):
        simulate(Schedule(name="big", problem=problem, num_microbatches=4, ranks=schedule.ranks))


def test_the_entry_points_refuse_wrong_types_with_a_type_error_naming_the_fix():
    pytest.importorskip("ortools")
    from pipeloom.search import search

    for call, words in ((lambda: pipeloom.validate("x"), "schedule must be a pipeloom Schedule"),
                        (lambda: pipeloom.simulate(None), "schedule must be a pipeloom Schedule"),
                        (lambda: search("mshape", 8), "placement('mshape', 8)")):
        with pytest.raises(ArgumentTypeError, match=re.escape(words)) as caught:
            call()
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, PipeloomError)
