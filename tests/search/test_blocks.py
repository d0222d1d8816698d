"""The Tessel-style block builder: stages, dependencies, split/inference rewriting and input checks.

Oracles: hand-written task lists, ``stage_graph`` (a chain of layers must give its tasks and
dependency sets), and reachability in the built DAG (a backward always waits for its forward).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeloom.errors import ProblemError
from pipeloom.problem import Problem
from pipeloom.search.blocks import PlacementBuilder, split_span
from pipeloom.stages import Stage, stage_graph


def _deps(problem: Problem) -> dict[str, set[str]]:
    return {task.name: {f"{s}{k}" for s, k in task.deps} for task in problem.tasks}


def _reaches(problem: Problem, user: tuple[int, str], dep: tuple[int, str]) -> bool:
    stack, seen = [user], set()
    while stack:
        key = stack.pop()
        if key == dep:
            return True
        if key not in seen:
            seen.add(key)
            stack.extend(problem.task(key).deps)
    return False


def test_example_from_the_docs_builds_the_expected_tasks():
    b = PlacementBuilder(num_ranks=4)
    embed = b.block("embed", ranks=[0, 1, 2, 3], span=1, memory=0)
    layer = b.block("layer", ranks=[1], span=2, memory=1)
    grad = b.block("layer.B", kind="B", of=layer, span=3, memory=-1)
    b.chain(embed, layer, grad)
    problem = b.build(memory_limit=4, comm_latency=0.5)
    assert [(t.name, t.ranks, t.duration, t.memory) for t in problem.tasks] == [
        ("0F", (0, 1, 2, 3), 1.0, 0.0),
        ("1F", (1,), 2.0, 1.0),
        ("1B", (1,), 3.0, -1.0),
    ]
    assert _deps(problem) == {"0F": set(), "1F": {"0F"}, "1B": {"1F"}}
    assert problem.memory_limit == 4.0 and problem.comm_latency == 0.5 and problem.num_ranks == 4
    assert (embed.key, layer.key, grad.key) == ((0, "F"), (1, "F"), (1, "B"))


def test_stages_follow_creation_order_and_backwards_share_their_forward_stage():
    b = PlacementBuilder(3)
    x = b.block("x", ranks=[0])
    orphan = b.block("orphan", ranks=[2], kind="B")  # a backward without a forward opens a stage
    y = b.block("y", ranks=[1, 2])
    gy = b.block("gy", kind="B", of=y)
    assert (x.stage, orphan.stage, y.stage, gy.stage) == (0, 1, 2, 2)
    assert gy.ranks == (1, 2)  # taken from the forward when not given
    assert b.blocks == (x, orphan, y, gy)


def test_a_backward_waits_for_its_forward_only_when_no_declared_path_implies_it():
    b = PlacementBuilder(2)
    f0 = b.block("f0", ranks=[0], memory=1)
    f1 = b.block("f1", ranks=[1], memory=1)
    b1 = b.block("b1", kind="B", of=f1, span=3, memory=-1)
    b0 = b.block("b0", kind="B", of=f0, span=3, memory=-1)
    b.chain(f0, f1, b1, b0)
    assert _deps(b.build()) == {"0F": set(), "1F": {"0F"}, "1B": {"1F"}, "0B": {"1B"}}
    # Without the chain through f1 the edge f0 -> b0 is added.
    b = PlacementBuilder(2)
    f0 = b.block("f0", ranks=[0], memory=1)
    other = b.block("other", ranks=[1])
    b0 = b.block("b0", kind="B", of=f0, memory=-1)
    b.depends(b0, on=other)
    assert _deps(b.build())["0B"] == {"1F", "0F"}
    assert b.deps(b0) == (other,)


@pytest.mark.parametrize("split", [False, True])
def test_a_chain_of_layers_is_the_stage_graph_chain(split):
    b = PlacementBuilder(3)
    layers = [b.layer(f"l{r}", ranks=[r], f_span=1, b_span=2, memory=1) for r in range(3)]
    b.chain_layers(*layers)
    built = b.build(split_backward=split)
    expected = stage_graph(
        [Stage(ranks=r, f=1, b=1, w=1) for r in range(3)], backward="split" if split else "full"
    )
    assert {(t.name, t.ranks, t.duration, t.memory) for t in built.tasks} == {
        (t.name, t.ranks, t.duration, t.memory) for t in expected.tasks
    }
    assert _deps(built) == _deps(expected)


def test_split_backward_turns_each_b_into_i_and_w():
    b = PlacementBuilder(2)
    f = b.block("f", ranks=[0], memory=2)
    g = b.block("g", kind="B", of=f, span=3, memory=-2)
    after = b.block("after", ranks=[1])
    b.chain(f, g, after)
    problem = b.build(split_backward=True)
    assert [(t.name, t.duration, t.memory) for t in problem.tasks] == [
        ("0F", 1.0, 2.0), ("0I", 2.0, -2.0), ("0W", 1.0, 0.0), ("1F", 1.0, 0.0)
    ]
    assert _deps(problem) == {"0F": set(), "0I": {"0F"}, "0W": {"0I"}, "1F": {"0I"}}


def test_hand_made_i_and_w_blocks_are_kept_as_they_are():
    b = PlacementBuilder(1)
    f = b.block("f", ranks=[0], memory=1)
    i = b.block("i", kind="I", of=f, memory=-0.5)
    w = b.block("w", kind="W", of=f, memory=-0.5, span=2)
    b.chain(i, w)
    problem = b.build(split_backward=True)
    assert [(t.name, t.duration, t.memory) for t in problem.tasks] == [
        ("0F", 1.0, 1.0), ("0I", 1.0, -0.5), ("0W", 2.0, -0.5)
    ]
    assert _deps(problem) == {"0F": set(), "0I": {"0F"}, "0W": {"0I"}}


def test_inference_keeps_forwards_with_no_memory_and_bridges_dropped_blocks():
    b = PlacementBuilder(2)
    x = b.block("x", ranks=[0], memory=1)
    gx = b.block("gx", kind="B", of=x, memory=-1)
    y = b.block("y", ranks=[1], memory=1)
    b.depends(y, on=gx)  # y waits for a backward: in inference it waits for what gx waited for
    problem = b.build(inference=True)
    assert [(t.name, t.memory) for t in problem.tasks] == [("0F", 0.0), ("1F", 0.0)]
    assert _deps(problem) == {"0F": set(), "1F": {"0F"}}


@pytest.mark.parametrize(
    ("span", "parts"),
    [(3, (2.0, 1.0)), (2, (1.0, 1.0)), (1, (1.0, 0.0)), (4, (2.0, 2.0)), (0.5, (0.5, 0.0)), (0, (0.0, 0.0))],
)
def test_split_span_rule(span, parts):
    assert split_span(span) == parts
    assert math.isclose(sum(split_span(span)), span)


def _builder_with_two_blocks() -> tuple[PlacementBuilder, object, object]:
    b = PlacementBuilder(2)
    return b, b.block("x", ranks=[0], memory=1), b.block("y", ranks=[1])


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda b, x, y: b.block("z", ranks=[2]), "block 'z' names rank 2"),
        (lambda b, x, y: b.block("z", ranks=[-1]), "block 'z' names rank -1"),
        (lambda b, x, y: b.block("z", ranks=[]), "block 'z' has no ranks"),
        (lambda b, x, y: b.block("z"), "block 'z' has no ranks"),
        (lambda b, x, y: b.block("z", ranks=[0, 0]), "block 'z' lists a rank twice"),
        (lambda b, x, y: b.block("z", ranks="0"), "block 'z': ranks must be a list"),
        (lambda b, x, y: b.block("z", ranks=[0], span=-1), "block 'z' span must be >= 0"),
        (lambda b, x, y: b.block("z", ranks=[0], span=float("inf")), "block 'z' span must be a finite"),
        (lambda b, x, y: b.block("z", ranks=[0], memory=float("nan")), "block 'z' memory must be a finite"),
        (lambda b, x, y: b.block("z", ranks=[0], memory="1"), "block 'z' memory must be a number"),
        (lambda b, x, y: b.block("z", ranks=[0], kind="X"), "block 'z': kind must be one of"),
        (lambda b, x, y: b.block("x", ranks=[0]), "block 'x' is defined twice"),
        (lambda b, x, y: b.block("", ranks=[0]), "non-empty string"),
        (lambda b, x, y: b.block("z", ranks=[0], of=x), "only a backward block"),
        (lambda b, x, y: b.depends(x, on=x), "block 'x' cannot depend on itself"),
        (lambda b, x, y: b.depends(x, on="y"), "expected a Block"),
        (lambda b, x, y: b.build(split_backward=True, inference=True), "exclude each other"),
        (lambda b, x, y: b.build(memory_limit=-1), "memory_limit"),
        (lambda b, x, y: b.build(comm_latency=-1), "comm_latency"),
    ],
)
def test_bad_inputs_raise_a_problem_error_naming_the_block(action, message):
    b, x, y = _builder_with_two_blocks()
    with pytest.raises(ProblemError, match=message):
        action(b, x, y)


def test_cycles_are_refused_naming_both_blocks():
    b, x, y = _builder_with_two_blocks()
    z = b.block("z", ranks=[0])
    b.chain(x, y, z)
    with pytest.raises(ProblemError, match="block 'x' wait for 'z' closes a cycle"):
        b.depends(x, on=z)
    # The implied forward -> backward edge counts: a forward cannot wait for its own backward.
    gx = b.block("gx", kind="B", of=x)
    with pytest.raises(ProblemError, match="closes a cycle"):
        b.depends(x, on=gx)
    b.depends(z, on=[y, y])  # repeating a dependency is harmless
    assert b.deps(z) == (y,)


def test_blocks_from_another_builder_or_kinds_per_stage_are_refused():
    b, x, _ = _builder_with_two_blocks()
    _, ox, _ = _builder_with_two_blocks()
    with pytest.raises(ProblemError, match="was not made by this builder"):
        b.depends(x, on=ox)
    with pytest.raises(ProblemError, match="was not made by this builder"):
        b.block("g", kind="B", of=ox)
    g = b.block("g", kind="B", of=x)
    with pytest.raises(ProblemError, match="already has a B block"):
        b.block("g2", kind="B", of=x)
    with pytest.raises(ProblemError, match="both a full backward B and a split"):
        b.block("i", kind="I", of=x)
    with pytest.raises(ProblemError, match="of='g' is a B block"):
        b.block("w", kind="W", of=g)


def test_empty_builder_and_bad_rank_counts_are_refused():
    with pytest.raises(ProblemError, match="no blocks"):
        PlacementBuilder(2).build()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ProblemError, match="num_ranks must be a positive integer"):
            PlacementBuilder(bad)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_block_graphs_build_and_every_backward_follows_its_forward(data):
    """Random forwards with random backward pairs and random forward-ward edges (always acyclic)."""
    num_ranks = data.draw(st.integers(1, 4))
    b = PlacementBuilder(num_ranks)
    blocks = []
    for k in range(data.draw(st.integers(1, 8))):
        rank = st.integers(0, num_ranks - 1)
        ranks = data.draw(st.lists(rank, min_size=1, max_size=num_ranks, unique=True))
        paired = {o.stage for o in blocks if o.kind == "B"}
        forwards = [blk for blk in blocks if blk.kind == "F" and blk.stage not in paired]
        if forwards and data.draw(st.booleans()):
            blk = b.block(f"b{k}", kind="B", of=data.draw(st.sampled_from(forwards)), span=3, memory=-1)
        else:
            blk = b.block(f"f{k}", ranks=ranks, memory=1)
        if blocks:
            b.depends(blk, on=data.draw(st.lists(st.sampled_from(blocks), max_size=3)))
        blocks.append(blk)
    for split in (False, True):
        problem = b.build(split_backward=split)
        back = "I" if split else "B"
        for blk in blocks:
            if blk.kind == "B":
                assert _reaches(problem, (blk.stage, back), (blk.stage, "F"))
            for dep in b.deps(blk):
                dep_kind = back if dep.kind == "B" else dep.kind
                user_kind = back if blk.kind == "B" else blk.kind
                assert _reaches(problem, (blk.stage, user_kind), (dep.stage, dep_kind))
    assert all(task.kind == "F" and task.memory == 0 for task in b.build(inference=True).tasks)
