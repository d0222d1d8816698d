"""Golden outputs of the list schedulers (ZB-V, interleaved zero bubble, Chimera's list order, the search's greedy).

Oracle: tests/schedules/data/list_schedules_golden.json, the sha256 of every per-rank action list
(and, per ZB-V policy, the makespan) these schedulers produced on the grids below *before* they
moved onto :mod:`pipeloom.schedules.kernel` (commit 7cff6dd; ZB-V's inlined copy of its policy and
interleaved-zb's own scheduler until commit c7cf0fc, from which ``interleaved_zb_policies`` was
made). Regenerate the fixture only on purpose: ``.venv/bin/python tests/schedules/test_list_golden.py``
(then review the diff).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedules import build_schedule
from pipeloom.schedules import interleaved_zb as interleaved_zb_module
from pipeloom.schedules import zbv as zbv_module
from pipeloom.schedules.chimera import chimera_list_order
from pipeloom.schedules.common import v_problem
from pipeloom.schedules.interleaved import looped_problem
from pipeloom.schedules.zbv_plan import VPlan, v_plan
from pipeloom.search.greedy import list_schedule, microbatch_peak_memory
from pipeloom.search.placements import placement
from pipeloom.stages import Costs

FIXTURE = Path(__file__).parent / "data" / "list_schedules_golden.json"

_COSTS = {
    "unit": dict(f=1.0, b=1.0, w=1.0),
    "paper": dict(f=18522.0, b=18086.0, w=9337.0, comm=601.0),
    "skew": dict(f=1.0, b=2.0, w=0.5, comm=0.25),
}
ZBV_GRID = [
    (p, m, cost, limit, w_memory)
    for p in (1, 2, 3, 4, 8)
    for m in (1, 2, 4, 8, 16)
    for cost in _COSTS
    for limit in (None, "p", "1.5p")
    for w_memory in (0.0, 0.43)
]
_IZB_COSTS = {**_COSTS, "heavy": dict(f=2.0, b=1.0, w=3.0)}
"""interleaved-zb's costs; "heavy" (F and W longer than I) is where ranks due at the same time see
each other's placements (the kernel's ``rank_order_ties``)."""
IZB_GRID = [
    (p, m, v, cost, limit)
    for p in (1, 2, 3, 4, 8)
    for m in (1, 3, 8, 16)
    for v in (2, 3)
    for cost in _IZB_COSTS
    for limit in (None, "p")
]
CHIMERA_GRID = [(p, m, cost) for p in (2, 4, 6, 8) for m in (2, 4, 6, 8, 12, 16, 32) for cost in _COSTS]
GREEDY_GRID = [
    (name, p, split, limit)
    for name in ("vshape", "xshape", "mshape", "nnshape", "kshape", "linear", "v", "interleaved")
    for p in (2, 4)
    for split in (False, True)
    for limit in (None, "tight")
]
GREEDY_MICROBATCHES = 8


def _digest(ranks) -> str:
    text = "|".join(" ".join(str(action) for action in actions) for actions in ranks)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def zbv_digest(p: int, m: int, cost: str, limit: str | None, w_memory: float) -> str:
    costs = Costs(**_COSTS[cost], w_memory=w_memory)
    memory_limit = None if limit is None else {"p": 1.0, "1.5p": 1.5}[limit] * p * costs.memory
    try:
        return _digest(build_schedule("zbv", p, m, costs=costs, memory_limit=memory_limit).ranks)
    except (PipeloomError, ValueError) as error:
        return f"error: {type(error).__name__}"


def zbv_plan(p: int, m: int, cost: str, limit: str | None, w_memory: float) -> VPlan:
    costs = Costs(**_COSTS[cost], w_memory=w_memory)
    memory_limit = (min(p, m) if limit is None else {"p": 1.0, "1.5p": 1.5}[limit] * p) * costs.memory
    return v_plan(v_problem(p, costs=costs, memory_limit=memory_limit), m, memory_limit)


def zbv_policies_digest(p: int, m: int, cost: str, limit: str | None, w_memory: float) -> str:
    """Every list policy's order and makespan (before zbv keeps the best or a round order)."""
    plan = zbv_plan(p, m, cost, limit, w_memory)
    results = [zbv_module._list_schedule(plan, policy) for policy in zbv_module._VARIANTS]
    text = ";".join("None" if r is None else f"{r[1]!r}:{_digest(r[0])}" for r in results)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def interleaved_zb_policies_digest(p: int, m: int, v: int, cost: str, limit: str | None) -> str:
    """Every list policy's order (before interleaved_zb keeps the fastest candidate)."""
    costs = Costs(**_IZB_COSTS[cost])
    if limit is None:
        caps = interleaved_zb_module._default_caps(p, m, v, costs=costs)
        memory_limit = max(caps)
    else:
        memory_limit = p * costs.memory
        caps = [memory_limit] * p
    problem = looped_problem(p, stages_per_rank=v, costs=costs, memory_limit=memory_limit, split_backward=True)
    plan = interleaved_zb_module._plan(problem, m, v, caps)
    results = [interleaved_zb_module._list_schedule(plan, policy) for policy in interleaved_zb_module._POLICIES]
    text = ";".join("None" if r is None else _digest(r) for r in results)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def chimera_digest(p: int, m: int, cost: str) -> str:
    return _digest(chimera_list_order(p, m // 2, Costs(**_COSTS[cost])))


def greedy_digest(name: str, p: int, split: bool, limit: str | None) -> str:
    problem = placement(name, p, split_backward=split, comm_latency=0.25)
    memory_limit = None
    if limit == "tight":  # room for two micro-batches' worst case on the fullest rank
        static = problem.static_memory or (0.0,) * p
        memory_limit = max(s + 2 * h for s, h in zip(static, microbatch_peak_memory(problem), strict=True))
    try:
        return _digest(list_schedule(problem, GREEDY_MICROBATCHES, memory_limit=memory_limit).ranks)
    except PipeloomError as error:
        return f"error: {type(error).__name__}"


def _key(*cell) -> str:
    return ",".join(map(str, cell))


def generate() -> dict[str, dict[str, str]]:
    return {
        "zbv": {_key(*cell): zbv_digest(*cell) for cell in ZBV_GRID},
        "zbv_policies": {_key(*cell): zbv_policies_digest(*cell) for cell in ZBV_GRID},
        "interleaved_zb_policies": {_key(*cell): interleaved_zb_policies_digest(*cell) for cell in IZB_GRID},
        "chimera": {_key(*cell): chimera_digest(*cell) for cell in CHIMERA_GRID},
        "greedy": {_key(*cell): greedy_digest(*cell) for cell in GREEDY_GRID},
    }


@pytest.fixture(scope="module")
def golden() -> dict[str, dict[str, str]]:
    return json.loads(FIXTURE.read_text())


def test_fixture_covers_the_grids(golden):
    assert len(golden["zbv"]) == len(ZBV_GRID) == 450
    assert len(golden["chimera"]) == len(CHIMERA_GRID)
    assert len(golden["greedy"]) == len(GREEDY_GRID)
    assert sum(not d.startswith("error") for d in golden["zbv"].values()) > 400
    assert len(golden["interleaved_zb_policies"]) == len(IZB_GRID) == 320


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zbv_matches_golden(golden, p):
    cells = [cell for cell in ZBV_GRID if cell[0] == p]
    assert {_key(*c): zbv_digest(*c) for c in cells} == {_key(*c): golden["zbv"][_key(*c)] for c in cells}


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_zbv_list_policies_match_golden(golden, p):
    cells = [cell for cell in ZBV_GRID if cell[0] == p]
    assert ({_key(*c): zbv_policies_digest(*c) for c in cells}
            == {_key(*c): golden["zbv_policies"][_key(*c)] for c in cells})


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_interleaved_zb_list_policies_match_golden(golden, p):
    cells = [cell for cell in IZB_GRID if cell[0] == p]
    assert ({_key(*c): interleaved_zb_policies_digest(*c) for c in cells}
            == {_key(*c): golden["interleaved_zb_policies"][_key(*c)] for c in cells})


def test_chimera_list_order_matches_golden(golden):
    assert {_key(*c): chimera_digest(*c) for c in CHIMERA_GRID} == golden["chimera"]


def test_greedy_matches_golden(golden):
    assert {_key(*c): greedy_digest(*c) for c in GREEDY_GRID} == golden["greedy"]


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(generate(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
