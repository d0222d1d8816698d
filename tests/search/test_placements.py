"""The placement catalog against docs/design.md §6 and against the built-in schedules' own problems.

Oracles: the shapes written out by hand from docs/design.md §6 (task lists with deps), per-rank memory of
one micro-batch summing to 0, ``build_schedule(...).problem`` equality for the classic placements
(what lets the search warm-start from the library), hand-computed critical paths of one
micro-batch, and the validator on a serial schedule made with ``schedule_from_starts``.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.ir import Schedule
from pipeloom.problem import Problem
from pipeloom.schedules import REGISTRY, build_schedule
from pipeloom.search.common import lower_bound, schedule_from_starts
from pipeloom.search.paths import head_tail
from pipeloom.search.placements import PLACEMENTS, placement, placement_names
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate

TESSEL = ("vshape", "xshape", "mshape", "nnshape", "mllm", "kshape", "finetune", "alphafold")
CLASSIC = ("linear", "v", "interleaved")
OPTIONS = [{}, {"split_backward": True}, {"inference": True}]


def _valid_counts(name: str) -> list[int]:
    return [n for n in (1, 2, 3, 4, 5, 8) if PLACEMENTS[name].accepts(n)]


def _shape(problem: Problem) -> list[tuple]:
    """Each task as (name, ranks, span, memory, sorted dep names): easy to write out by hand."""
    return [
        (t.name, t.ranks, t.duration, t.memory, sorted(f"{s}{k}" for s, k in t.deps)) for t in problem.tasks
    ]


def test_catalog_lists_the_design_placements_with_their_rules():
    assert placement_names() == TESSEL + CLASSIC
    assert {name for name in PLACEMENTS if PLACEMENTS[name].even_ranks} == {"nnshape", "kshape"}
    assert PLACEMENTS["kshape"].rule == "an even number of ranks >= 2"
    assert PLACEMENTS["vshape"].rule == "any number of ranks >= 1"
    for info in PLACEMENTS.values():
        assert info.summary and info.accepts(2) and info.accepts(4) and info.accepts(8)


@pytest.mark.parametrize("name", TESSEL + CLASSIC)
@pytest.mark.parametrize("options", OPTIONS, ids=["full", "split", "inference"])
def test_every_placement_builds_and_one_microbatch_frees_what_it_takes(name, options):
    for n in _valid_counts(name):
        problem = placement(name, n, **options)
        assert problem.num_ranks == n
        assert sorted({r for t in problem.tasks for r in t.ranks}) == list(range(n))  # every rank works
        for rank in range(n):
            assert sum(t.memory for t in problem.tasks_on(rank)) == pytest.approx(0.0, abs=1e-12)
        kinds = {t.kind for t in problem.tasks}
        if options.get("inference"):
            assert kinds == {"F"} and all(t.memory == 0 for t in problem.tasks)
        elif options.get("split_backward"):
            assert kinds == {"F", "I", "W"}
            for task in problem.tasks:
                if task.kind == "W":
                    assert task.deps == ((task.stage, "I"),)
        else:
            assert kinds == {"F", "B"}


@pytest.mark.parametrize("name", TESSEL)
def test_tessel_blocks_have_the_design_spans_and_memory(name):
    """F span 1; a single-rank F holds +1 except the first two alphafold passes; B frees its F."""
    n = 4
    problem = placement(name, n)
    for task in problem.tasks:
        assert task.duration in (1.0, 2.0, 3.0)
        everywhere = len(task.ranks) == n
        if task.kind == "F":
            assert task.duration == 1.0
            if everywhere:
                assert task.memory == (1.0 if name == "kshape" else 0.0)
        else:
            forward = problem.task((task.stage, "F"))
            assert task.ranks == forward.ranks and task.memory == -forward.memory
            if everywhere or name == "alphafold":
                assert task.duration == 1.0
            else:
                assert task.duration == (2.0 if name == "finetune" else 3.0)


def test_vshape_by_hand():
    assert _shape(placement("vshape", 3)) == [
        ("0F", (0,), 1.0, 1.0, []),
        ("1F", (1,), 1.0, 1.0, ["0F"]),
        ("2F", (2,), 1.0, 1.0, ["1F"]),
        ("2B", (2,), 3.0, -1.0, ["2F"]),
        ("1B", (1,), 3.0, -1.0, ["2B"]),
        ("0B", (0,), 3.0, -1.0, ["1B"]),
    ]


def test_xshape_by_hand():
    """Two chains with no edge between them: the V (stages 0, 1) and its mirror (stages 2, 3)."""
    assert _shape(placement("xshape", 2)) == [
        ("0F", (0,), 1.0, 1.0, []),
        ("1F", (1,), 1.0, 1.0, ["0F"]),
        ("2F", (1,), 1.0, 1.0, []),
        ("3F", (0,), 1.0, 1.0, ["2F"]),
        ("1B", (1,), 3.0, -1.0, ["1F"]),
        ("0B", (0,), 3.0, -1.0, ["1B"]),
        ("3B", (0,), 3.0, -1.0, ["3F"]),
        ("2B", (1,), 3.0, -1.0, ["3B"]),
    ]


def test_mshape_by_hand():
    assert _shape(placement("mshape", 2)) == [
        ("0F", (0, 1), 1.0, 0.0, []),
        ("1F", (0,), 1.0, 1.0, ["0F"]),
        ("2F", (1,), 1.0, 1.0, ["1F"]),
        ("2B", (1,), 3.0, -1.0, ["2F"]),
        ("1B", (0,), 3.0, -1.0, ["2B"]),
        ("0B", (0, 1), 1.0, 0.0, ["1B"]),
    ]


def test_nnshape_by_hand():
    assert _shape(placement("nnshape", 4)) == [
        ("0F", (0, 1, 2, 3), 1.0, 0.0, []),
        ("1F", (0,), 1.0, 1.0, ["0F"]),
        ("2F", (1,), 1.0, 1.0, ["1F"]),
        ("3F", (0, 1, 2, 3), 1.0, 0.0, ["2F"]),
        ("4F", (2,), 1.0, 1.0, ["3F"]),
        ("5F", (3,), 1.0, 1.0, ["4F"]),
        ("5B", (3,), 3.0, -1.0, ["5F"]),
        ("4B", (2,), 3.0, -1.0, ["5B"]),
        ("3B", (0, 1, 2, 3), 1.0, 0.0, ["4B"]),
        ("2B", (1,), 3.0, -1.0, ["3B"]),
        ("1B", (0,), 3.0, -1.0, ["2B"]),
        ("0B", (0, 1, 2, 3), 1.0, 0.0, ["1B"]),
    ]


def test_mllm_by_hand():
    assert _shape(placement("mllm", 2)) == [
        ("0F", (0, 1), 1.0, 0.0, []),
        ("1F", (0,), 1.0, 1.0, ["0F"]),
        ("2F", (1,), 1.0, 1.0, ["1F"]),
        ("3F", (0, 1), 1.0, 0.0, ["2F"]),
        ("3B", (0, 1), 1.0, 0.0, ["3F"]),
        ("2B", (1,), 3.0, -1.0, ["3B"]),
        ("1B", (0,), 3.0, -1.0, ["2B"]),
        ("0B", (0, 1), 1.0, 0.0, ["1B"]),
    ]


def test_kshape_by_hand():
    """Branches 0,1 and 2,3 join at the loss on all ranks (+1/-1, span 1), then split again."""
    assert _shape(placement("kshape", 4)) == [
        ("0F", (0,), 1.0, 1.0, []),
        ("1F", (1,), 1.0, 1.0, ["0F"]),
        ("2F", (2,), 1.0, 1.0, []),
        ("3F", (3,), 1.0, 1.0, ["2F"]),
        ("4F", (0, 1, 2, 3), 1.0, 1.0, ["1F", "3F"]),
        ("4B", (0, 1, 2, 3), 1.0, -1.0, ["4F"]),
        ("1B", (1,), 3.0, -1.0, ["4B"]),
        ("0B", (0,), 3.0, -1.0, ["1B"]),
        ("3B", (3,), 3.0, -1.0, ["4B"]),
        ("2B", (2,), 3.0, -1.0, ["3B"]),
    ]


def test_finetune_and_alphafold_by_hand():
    assert _shape(placement("finetune", 2)) == [
        ("0F", (0, 1), 1.0, 0.0, []),  # frozen: no backward
        ("1F", (0,), 1.0, 1.0, ["0F"]),
        ("2F", (1,), 1.0, 1.0, ["1F"]),
        ("2B", (1,), 2.0, -1.0, ["2F"]),
        ("1B", (0,), 2.0, -1.0, ["2B"]),
    ]
    assert _shape(placement("alphafold", 2)) == [
        ("0F", (0,), 1.0, 0.0, []),
        ("1F", (1,), 1.0, 0.0, ["0F"]),
        ("2F", (0,), 1.0, 0.0, ["1F"]),
        ("3F", (1,), 1.0, 0.0, ["2F"]),
        ("4F", (0,), 1.0, 1.0, ["3F"]),
        ("5F", (1,), 1.0, 1.0, ["4F"]),
        ("5B", (1,), 1.0, -1.0, ["5F"]),
        ("4B", (0,), 1.0, -1.0, ["5B"]),
    ]


def test_split_backward_of_a_tessel_shape():
    """B span 3 -> I 2 (frees the memory) + W 1; B span 1 -> I 1 + W 0; the chain runs through I."""
    assert _shape(placement("mshape", 2, split_backward=True))[3:] == [
        ("2I", (1,), 2.0, -1.0, ["2F"]),
        ("2W", (1,), 1.0, 0.0, ["2I"]),
        ("1I", (0,), 2.0, -1.0, ["2I"]),
        ("1W", (0,), 1.0, 0.0, ["1I"]),
        ("0I", (0, 1), 1.0, 0.0, ["1I"]),
        ("0W", (0, 1), 0.0, 0.0, ["0I"]),
    ]


def test_inference_keeps_the_forward_chain():
    assert _shape(placement("kshape", 2, inference=True)) == [
        ("0F", (0,), 1.0, 0.0, []),
        ("1F", (1,), 1.0, 0.0, []),
        ("2F", (0, 1), 1.0, 0.0, ["0F", "1F"]),
    ]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", CLASSIC)
def test_classic_placements_are_exactly_the_builtin_problems(name, split, n):
    """Equal to build_schedule(b, n, m).problem (memory limit aside) iff b is listed for it."""
    info = PLACEMENTS[name]
    listed = info.builtin_names(split_backward=split)
    ours = placement(name, n, split_backward=split)
    for builtin in REGISTRY:
        try:
            theirs = build_schedule(builtin, n, 2 * n).problem
        except ValueError:
            assert builtin not in listed
            continue
        same = ours == dataclasses.replace(theirs, memory_limit=None)
        assert same == (builtin in listed), (name, split, builtin)


@pytest.mark.parametrize("name", CLASSIC)
def test_classic_placements_carry_latency_and_limit_like_the_builtins(name):
    info = PLACEMENTS[name]
    for split in (False, True):
        for builtin in info.builtin_names(split_backward=split):
            built = build_schedule(builtin, 4, 8, costs=Costs(comm=0.25), memory_limit=7.0).problem
            assert placement(name, 4, split_backward=split, memory_limit=7.0, comm_latency=0.25) == built
    for n in (1, 5):  # one rank: v and interleaved coincide; the listed built-ins still match
        for builtin in info.builtin_names(split_backward=True):
            built = build_schedule(builtin, n, 2 * n).problem
            assert placement(name, n, split_backward=True) == dataclasses.replace(built, memory_limit=None)


def test_memory_limit_and_latency_reach_the_problem():
    problem = placement("nnshape", 4, memory_limit=6, comm_latency=0.5)
    assert problem.memory_limit == 6.0 and problem.comm_latency == 0.5


@pytest.mark.parametrize("name", ["nnshape", "kshape"])
def test_halving_shapes_refuse_odd_rank_counts_naming_the_rule(name):
    for n in (1, 3, 5):
        with pytest.raises(PipeloomError, match=rf"{name}' needs an even number of ranks >= 2, got {n}"):
            placement(name, n)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "4", None])
def test_bad_rank_counts_are_refused(bad):
    with pytest.raises(ValueError, match="needs any number of ranks >= 1"):
        placement("vshape", bad)


def test_unknown_names_and_conflicting_options_are_refused():
    with pytest.raises(PipeloomError, match="unknown placement 'wshape'; choose one of: vshape, xshape"):
        placement("wshape", 4)
    with pytest.raises(PipeloomError, match="unknown placement"):
        placement(["vshape"], 4)
    with pytest.raises(PipeloomError, match="exclude each other"):
        placement("vshape", 4, split_backward=True, inference=True)
    with pytest.raises(PipeloomError, match="memory_limit"):
        placement("vshape", 4, memory_limit=-1)
    with pytest.raises(PipeloomError, match="comm"):
        placement("linear", 4, comm_latency=-1)


# One micro-batch's critical path with F = 1, B = 3 (n = 4), worked out from docs/design.md §6 by hand.
CRITICAL_PATH = {
    "vshape": 4 + 12, "xshape": 4 + 12, "mshape": 1 + 4 + 12 + 1, "nnshape": 1 + 2 + 1 + 2 + 6 + 1 + 6 + 1,
    "mllm": 1 + 4 + 1 + 1 + 12 + 1, "kshape": 2 + 1 + 1 + 6, "finetune": 1 + 4 + 8, "alphafold": 12 + 4,
    "linear": 4 + 8, "v": 8 * 0.5 + 8 * 1.0, "interleaved": 8 * 0.5 + 8 * 1.0,
}


def _serial(problem: Problem, head: list[float], m: int, length: float) -> Schedule:
    """Micro-batch mb's task t starts at ``mb * length + head[t]``, ordered by schedule_from_starts."""
    starts = {(t, mb): mb * length + head[t] for t in range(len(problem.tasks)) for mb in range(m)}
    return schedule_from_starts(problem, name="serial", num_microbatches=m, starts=starts)


@pytest.mark.parametrize("name", TESSEL + CLASSIC)
@pytest.mark.parametrize("options", OPTIONS, ids=["full", "split", "inference"])
def test_a_serial_schedule_from_head_times_validates(name, options):
    """Micro-batch mb's task t starts at mb * L + head[t], L the simulated length of one micro-batch.

    Head times ignore rank conflicts (a split backward's W can collide with the returning I
    chain), so one micro-batch may take longer than its critical path; without split it does not.
    """
    for n in (2, 4):
        problem = placement(name, n, comm_latency=0.5 if n == 2 else 0.0, **options)
        head, tail = head_tail(problem)
        path = max(h + t.duration + tl for h, t, tl in zip(head, problem.tasks, tail, strict=True))
        if n == 4 and not options:
            assert path == CRITICAL_PATH[name]
        single = validate(_serial(problem, head, 1, path), ordered=True)
        assert single.makespan >= path - 1e-9
        if not options.get("split_backward"):
            assert single.makespan == pytest.approx(path)
        timeline = validate(_serial(problem, head, 5, single.makespan), ordered=True)
        assert lower_bound(problem, 5) - 1e-9 <= timeline.makespan <= 5 * single.makespan + 1e-9
        # Every micro-batch frees what it took, so repeating it adds no memory.
        assert timeline.peak_memory == pytest.approx(single.peak_memory)
        assert simulate(timeline.schedule).makespan == timeline.makespan
