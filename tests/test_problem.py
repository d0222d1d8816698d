"""Tests of pipeloom.problem: input validation errors and the stage-graph builder (docs/design.md §1).

Oracles: the dependency rules of docs/design.md §1 written out by hand for a small DAG with a branch and
a join, and the error messages' promise to name the bad value and the fix.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipeloom.problem as problem_module
import pipeloom.stages as stages_module
from pipeloom.errors import ProblemError
from pipeloom.problem import Problem, Task, parse_task_name, task_name
from pipeloom.stages import Costs, Stage, stage_graph


def _task(stage: int, kind: str = "F", ranks=(0,), deps=(), duration: float = 1.0) -> Task:
    return Task(stage=stage, kind=kind, ranks=ranks, duration=duration, deps=deps)


# ------------------------------------------------------------------------------- validation errors


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: Problem(num_ranks=2, tasks=(_task(0, ranks=(2,)),)),
         ["0F", "rank 2", "only 2 ranks", "raise num_ranks"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0, deps=((1, "F"),)), _task(1, deps=((0, "F"),)))),
         ["cycle", "0F", "1F", "remove one of those edges"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0), _task(1, deps=((0, "F"),)),
                                             _task(2, deps=((2, "F"),)))),
         ["cycle: 2F -> 2F;"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0, deps=((2, "F"),)), _task(1, deps=((0, "F"),)),
                                             _task(2, deps=((1, "F"),)), _task(3, deps=((2, "F"),)))),
         ["cycle: 0F -> 1F -> 2F -> 0F;"]),  # the cycle only, not 3F downstream of it
        (lambda: _task(0, duration=-1.0), ["0F", "duration", ">= 0", "-1"]),
        (lambda: _task(0, duration=float("nan")), ["0F", "duration", "finite"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0, deps=((3, "B"),)),)),
         ["0F", "depends on 3B", "not a task"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0), _task(0))), ["0F", "defined twice", "unique"]),
        (lambda: _task(0, kind="X"), ["0X", "F, B, I, W"]),
        (lambda: _task(0, ranks=()), ["0F", "no ranks"]),
        (lambda: _task(0, ranks=(1, 1)), ["0F", "rank twice"]),
        (lambda: _task(0, ranks=(-1,)), ["rank", "non-negative", "-1"]),
        (lambda: _task(0, deps=("0F",)), ["0F", "'0F'", "(stage, kind) pair"]),
        (lambda: _task(1, deps=((0, "F"), (0, "F"))), ["1F", "dependency twice"]),
        (lambda: Problem(num_ranks=0, tasks=(_task(0),)), ["num_ranks", "positive", "0"]),
        (lambda: Problem(num_ranks=1, tasks=()), ["no tasks"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0),), comm_latency=-0.5), ["comm_latency", "-0.5"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0),), memory_limit=-1),
         ["memory_limit must be >= 0", "-1", "None for no limit"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0),), memory_limit=-1e-300), ["memory_limit", ">= 0"]),
        (lambda: _task(0, duration=10**400), ["0F", "duration", "finite", "an integer of 401 digits"]),
        (lambda: Problem(num_ranks=1, tasks=(_task(0),), static_memory=(-(10**400),)),
         ["static_memory[0]", "finite"]),
        (lambda: Problem(num_ranks=2, tasks=(_task(0),), static_memory=(1.0,)),
         ["static_memory", "1 entries", "one per rank (2)"]),
        (lambda: Stage(ranks=0, memory=1.0, w_memory=2.0), ["w_memory 2", "memory 1"]),
        (lambda: Costs(w_memory=3.0), ["w_memory 3", "memory 1"]),
        (lambda: Costs(f=-1.0), ["cost f", "-1"]),
        (lambda: parse_task_name("F2"), ["'F2'", "e.g. '2F'"]),
    ],
)
def test_bad_problem_raises_problem_error_naming_the_value(build, words):
    with pytest.raises(ProblemError) as caught:
        build()
    message = str(caught.value)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


@pytest.mark.parametrize(
    ("edges", "words"),
    [
        ([(0, 3)], ["(0, 3)", "stage 3", "stages are 0..2"]),
        ([(-1, 0)], ["(-1, 0)", "stage -1"]),
        ([(1, 1)], ["(1, 1)", "itself"]),
        ([(0, 1, 2)], ["(0, 1, 2)", "pair"]),
        ([(1, 0), (0, 1)], ["cycle"]),
    ],
)
def test_bad_stage_graph_edges_raise_problem_error(edges, words):
    with pytest.raises(ProblemError) as caught:
        stage_graph([Stage(ranks=0), Stage(ranks=1), Stage(ranks=2)], edges=edges)
    for word in words:
        assert word in str(caught.value)


def test_limit_zero_and_negative_static_memory_are_accepted():
    """Only the limit must be >= 0; static memory is free-form (a rank may start in credit)."""
    problem = Problem(num_ranks=2, tasks=(_task(0),), memory_limit=0, static_memory=(-2.0, 0.5))
    assert (problem.memory_limit, problem.static_memory) == (0.0, (-2.0, 0.5))


def test_problem_module_functions_stay_under_sixty_lines():
    """STYLE §4: a function over ~60 lines is a smell; the stage-graph builder once had 78."""
    lengths = {}
    for module in (problem_module, stages_module):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        lengths |= {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert lengths["stage_graph"] > 0 and lengths["parse_task_name"] > 0
    assert {name: n for name, n in lengths.items() if n > 60} == {}


@pytest.mark.parametrize("edge", [5, (0,), "01", None])
def test_stage_graph_edges_that_are_not_pairs(edge):
    with pytest.raises(ProblemError, match=r"\(producer, consumer\) pair"):
        stage_graph([Stage(ranks=0), Stage(ranks=1)], edges=[edge])


def test_stage_graph_rejects_empty_and_unknown_backward():
    with pytest.raises(ProblemError, match="no stages"):
        stage_graph([])
    with pytest.raises(ProblemError, match="'full', 'split' or 'none'"):
        stage_graph([Stage(ranks=0)], backward="half")


def test_problem_errors_are_value_errors():
    """Callers that catch ValueError (the CLI, build_schedule users) also catch ProblemError."""
    with pytest.raises(ValueError):
        _task(0, duration=-1)


def test_task_names_round_trip():
    for key in [(0, "F"), (12, "B"), (3, "I"), (7, "W")]:
        assert parse_task_name(task_name(key)) == key
    assert parse_task_name(" 4W ") == (4, "W")


# ------------------------------------------------------------------------------- stage graph

# Stage DAG with a branch and a join: 0 -> 1 -> 3 and 0 -> 2 -> 3, stage s on rank s.
_DAG_EDGES = [(0, 1), (0, 2), (1, 3), (2, 3)]
_STAGES = [
    Stage(ranks=s, f=1.0 + s, b=2.0 + s, w=0.5 + s, memory=3.0 + s, w_memory=1.0) for s in range(4)
]


def _deps(problem: Problem) -> dict[str, set[str]]:
    return {task.name: {task_name(dep) for dep in task.deps} for task in problem.tasks}


def test_stage_graph_full_backward_derives_design_deps():
    problem = stage_graph(_STAGES, edges=_DAG_EDGES, backward="full")
    assert _deps(problem) == {
        "0F": set(), "1F": {"0F"}, "2F": {"0F"}, "3F": {"1F", "2F"},
        "3B": {"3F"}, "1B": {"1F", "3B"}, "2B": {"2F", "3B"}, "0B": {"0F", "1B", "2B"},
    }
    for s, stage in enumerate(_STAGES):
        forward, backward = problem.task((s, "F")), problem.task((s, "B"))
        assert (forward.duration, forward.memory, forward.ranks) == (stage.f, stage.memory, (s,))
        assert (backward.duration, backward.memory) == (stage.b + stage.w, -stage.memory)
    assert problem.num_ranks == 4 and problem.num_stages == 4 and not problem.splits_backward


def test_stage_graph_split_backward_derives_design_deps():
    problem = stage_graph(_STAGES, edges=_DAG_EDGES, backward="split")
    assert _deps(problem) == {
        "0F": set(), "1F": {"0F"}, "2F": {"0F"}, "3F": {"1F", "2F"},
        "3I": {"3F"}, "1I": {"1F", "3I"}, "2I": {"2F", "3I"}, "0I": {"0F", "1I", "2I"},
        "0W": {"0I"}, "1W": {"1I"}, "2W": {"2I"}, "3W": {"3I"},
    }
    for s, stage in enumerate(_STAGES):
        grad_input, grad_weight = problem.task((s, "I")), problem.task((s, "W"))
        assert grad_input.duration == stage.b and grad_weight.duration == stage.w
        # M_F + M_B + M_W = 0: I frees memory - w_memory, W frees w_memory.
        assert grad_input.memory == -(stage.memory - stage.w_memory)
        assert grad_weight.memory == -stage.w_memory
        assert problem.task((s, "F")).memory + grad_input.memory + grad_weight.memory == 0
    assert problem.splits_backward


def test_stage_graph_without_backward_is_forward_only_and_memory_free():
    problem = stage_graph(_STAGES, edges=_DAG_EDGES, backward="none")
    assert _deps(problem) == {"0F": set(), "1F": {"0F"}, "2F": {"0F"}, "3F": {"1F", "2F"}}
    assert all(task.memory == 0 for task in problem.tasks)


def test_stage_graph_default_edges_are_a_chain_and_duplicate_edges_count_once():
    chain = stage_graph([Stage(ranks=0), Stage(ranks=1), Stage(ranks=0)])
    assert _deps(chain) == {
        "0F": set(), "1F": {"0F"}, "2F": {"1F"}, "2B": {"2F"}, "1B": {"1F", "2B"}, "0B": {"0F", "1B"},
    }
    twice = stage_graph([Stage(ranks=0), Stage(ranks=1)], edges=[(0, 1), (0, 1)])
    assert twice.task((1, "F")).deps == ((0, "F"),)


def test_stage_graph_multi_rank_stage_and_machine_facts():
    problem = stage_graph(
        [Stage(ranks=(0, 1)), Stage(ranks=2)], num_ranks=4, comm_latency=0.25,
        memory_limit=3.0, static_memory=[1, 1, 1, 1],
    )
    assert problem.task((0, "B")).ranks == (0, 1)
    assert (problem.num_ranks, problem.comm_latency, problem.memory_limit) == (4, 0.25, 3.0)
    assert problem.static_memory == (1.0, 1.0, 1.0, 1.0)
    assert [t.name for t in problem.tasks_on(1)] == ["0F", "0B"]
    assert problem.tasks_on(3) == ()
    # Work per micro-batch: rank 0 and 1 run stage 0 (f + b + w = 3), rank 2 stage 1, rank 3 nothing.
    assert problem.work_per_microbatch() == (3.0, 3.0, 3.0, 0.0)


def test_costs_stage_share_scales_time_and_memory():
    stage = Costs(f=2, b=4, w=6, memory=8, w_memory=2).stage(3, share=0.5)
    assert (stage.ranks, stage.f, stage.b, stage.w, stage.memory, stage.w_memory) == ((3,), 1, 2, 3, 4, 1)


def test_problem_lookup_helpers():
    problem = stage_graph([Stage(ranks=0)])
    assert problem.has_task((0, "B")) and not problem.has_task((0, "W"))
    assert problem.index((0, "B")) == 1
    with pytest.raises(ProblemError, match="no task 0W"):
        problem.task((0, "W"))


def test_a_stage_number_past_the_most_stages_is_refused_before_any_table_is_made():
    """A one-task file at stage 10,000,000 had taken 2 GB and 25 s to search (stage-indexed tables)."""
    last = problem_module.MAX_STAGES - 1
    assert Task(stage=last, kind="F", ranks=(0,), duration=1.0).stage == last
    with pytest.raises(ProblemError, match=r"task stage 10000000 is above the 1,048,575 a problem may hold"):
        Task(stage=10_000_000, kind="F", ranks=(0,), duration=1.0)

