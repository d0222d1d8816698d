"""warmup_forwards reads each rank's warm-up from the builders' rules: the same counts as the built schedules."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeloom.ir import Action
from pipeloom.schedules import build_schedule
from pipeloom.schedules.warmup import WARMUP_SCHEDULES, warmup_forwards


def _built_warmup(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank of the built schedule, the forwards per stage before its first other action."""
    options = {"stages_per_rank": v} if name == "interleaved-1f1b" else {}
    out = []
    for actions in build_schedule(name, p, m, **options).ranks:
        counts = Counter[int]()
        for action in actions:
            if type(action) is not Action or action.kind != "F":
                break
            counts[action.stage] += 1
        out.append(tuple(sorted(counts.items())))
    return tuple(out)


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in WARMUP_SCHEDULES:
        for p in (1, 2, 3, 4, 5, 8):
            if name == "dualpipe" and p % 2:
                continue
            for m in range(1, 4 * p + 3):
                if name in ("dualpipe", "dualpipev") and (m < 2 * p or (name == "dualpipe" and m % 2)):
                    continue
                for v in ((2, 3, 4) if name == "interleaved-1f1b" else (1,)):
                    cases.append((name, p, m, v))
    return cases


@pytest.mark.parametrize(("name", "p", "m", "v"), _cases())
def test_warmup_equals_the_built_schedule(name, p, m, v):
    assert warmup_forwards(name, p, m, stages_per_rank=v) == _built_warmup(name, p, m, v)


@pytest.mark.parametrize(("name", "p", "m", "v"), [("interleaved-1f1b", 16, 48, 8), ("interleaved-1f1b", 32, 100, 3),
                                                   ("dualpipe", 32, 96, 1), ("dualpipev", 16, 40, 1),
                                                   ("zb-h1", 64, 192, 1)])
def test_warmup_equals_the_built_schedule_at_scale(name, p, m, v):
    assert warmup_forwards(name, p, m, stages_per_rank=v) == _built_warmup(name, p, m, v)


def test_warmup_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="zbv"):
        warmup_forwards("zbv", 4, 8)
    with pytest.raises(ValueError, match="even"):
        warmup_forwards("dualpipe", 3, 8)
    with pytest.raises(ValueError, match="dualpipev needs at least 8 micro-batches with 4 ranks"):
        warmup_forwards("dualpipev", 4, 7)
