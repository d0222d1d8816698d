"""Measured tensor-parallel costs in a cost table (pipeloom.plan.tp.megatron's TensorProfile, what
profile_in_engine writes on a ("pp", "tp") mesh): the planner takes a measured size's times instead of
Megatron's formulas, prices the sizes not measured with the counted collectives and the fitted per-collective
overhead, and the ``profiled`` JSON round-trips (files without it load as before). Compared against: the
measured numbers themselves, and a per-collective overhead planted in synthetic measurements."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeloom.plan import analytical_gpt_costs
from pipeloom.plan.costs.file import costs_from_json, costs_to_json
from pipeloom.plan.costs.parts import Link
from pipeloom.plan.errors import CostTableError, TensorParallelError
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.tp.collectives import Collective, CollectiveFit, collective_seconds
from pipeloom.plan.tp.measured import MeasuredPiece, TensorProfile, fit_overhead
from pipeloom.plan.tp.megatron import TensorInfo, tensor_parallel_table

LINK = Link(latency=1e-5, bandwidth=1e10)
FIT = CollectiveFit(latency={"all_reduce": 0.0}, bandwidth={"all_reduce": 1e9}, overhead={"all_reduce": 2e-5})


def base(layers: int = 4) -> object:
    table = analytical_gpt_costs(layers=layers, hidden=1024, heads=8, seq=512, vocab=32000, microbatch_size=1,
                                 flops_per_second=1e13, bytes_per_second=1e12, link=LINK)
    info = TensorInfo(heads=8, layers=tuple(n for n in table.names if n.startswith("blocks.")),
                      column=("attn.qkv", "mlp.0"), row=("attn.proj", "mlp.2"), fit=FIT)
    return dataclasses.replace(table, tensor=info)


def counted(piece) -> tuple[Collective, ...]:
    return tuple(Collective(kind="all_reduce", phase=phase, bytes=piece.output_bytes)
                 for phase in ("F", "F", "I", "I"))


def profiled(table, *, size: int = 2, slower: float = 1.0, overhead: float = 0.0) -> object:
    """``table`` with a profile of ``size`` whose layer pieces take their formula time times ``slower`` plus
    ``overhead`` per collective, and whose runtime corrections differ from the table's."""
    def timed(comms: tuple[Collective, ...], phase: str, alone: float) -> float:
        mine = [c for c in comms if c.phase == phase]
        return (alone / size + collective_seconds(mine, FIT, size, phase) + overhead * len(mine)) * slower

    pieces = []
    for piece in table.pieces:
        if piece.name not in table.tensor.layers:
            pieces.append(MeasuredPiece(name=piece.name, f=piece.f, i=piece.i, w=piece.w))
            continue
        comms = counted(piece)
        pieces.append(MeasuredPiece(name=piece.name, f=timed(comms, "F", piece.f), i=timed(comms, "I", piece.i),
                                    w=timed(comms, "W", piece.w), collectives=comms))
    profile = TensorProfile(size=size, pieces=tuple(pieces), latency=3e-4,
                            runtime={"step_overhead": 5e-3, "message_cost": 1e-4})
    return dataclasses.replace(table, tensor=dataclasses.replace(table.tensor, profiles=(profile,)))


def test_a_measured_size_takes_the_measured_times_and_runtime_corrections():
    table = profiled(base(), slower=3.0)
    sharded = tensor_parallel_table(table, 2)
    profile = table.tensor.profiles[0]
    assert [(p.f, p.i, p.w) for p in sharded.pieces] == [(p.f, p.i, p.w) for p in profile.pieces]
    assert sharded.link.latency == 3e-4 and sharded.link.bandwidth == LINK.bandwidth
    assert sharded.runtime.step_overhead == 5e-3 and sharded.runtime.message_cost == 1e-4
    formula = tensor_parallel_table(base(), 2)
    layer = table.names.index("blocks.0")
    assert sharded.pieces[layer].f == pytest.approx(3 * formula.pieces[layer].f)
    assert sharded.pieces[layer].param_bytes == formula.pieces[layer].param_bytes  # bytes: still the formulas
    assert sharded.pieces[layer].activation_bytes == formula.pieces[layer].activation_bytes


def test_sizes_not_measured_use_the_counted_collectives_and_the_fitted_overhead():
    table = profiled(base(), overhead=4e-5)
    fit = fit_overhead(table, table.tensor.profiles[0], FIT)
    assert fit.overhead["all_reduce"] == pytest.approx(2e-5 + 4e-5)  # the planted overhead, recovered
    assert fit.bandwidth == FIT.bandwidth
    sized = dataclasses.replace(table, tensor=dataclasses.replace(table.tensor, fit=fit))
    four = tensor_parallel_table(sized, 4)
    piece, whole = four.pieces[1], table.pieces[1]
    one = fit.seconds("all_reduce", whole.output_bytes, 4)
    assert piece.f == pytest.approx(whole.f / 4 + 2 * one) and piece.i == pytest.approx(whole.i / 4 + 2 * one)
    # counted collectives replace Megatron's formula: a profile that counted 1 forward all-reduce prices 1
    single = dataclasses.replace(table.tensor.profiles[0], pieces=tuple(
        dataclasses.replace(p, collectives=p.collectives[1:]) for p in table.tensor.profiles[0].pieces))
    fewer = dataclasses.replace(sized, tensor=dataclasses.replace(sized.tensor, profiles=(single,)))
    assert tensor_parallel_table(fewer, 4).pieces[1].f == pytest.approx(whole.f / 4 + one)


def test_the_planner_prices_a_measured_size_with_its_measurements():
    def best(table, tp: int) -> float:
        result = plan_mesh(table, num_ranks=4, global_batch=8, tensor_parallel=[tp], data_parallel=[1],
                           schedules=["1f1b"], microbatches=[4])
        return result.candidates[0].step_time

    table = base()
    assert best(profiled(table, slower=1.0), 2) == pytest.approx(best(table, 2) + 5e-3, rel=0.05)
    assert best(profiled(table, slower=10.0), 2) > 5 * best(table, 2)  # measured: ten times slower layers
    slow = profiled(table, slower=10.0)
    assert plan_mesh(slow, num_ranks=4, global_batch=8, tensor_parallel=[1, 2], data_parallel=[1],
                     schedules=["1f1b"], microbatches=[4]).plan.tensor_parallel == 1


def test_profiled_json_round_trips_and_older_tensor_fields_load():
    table = profiled(base(2))
    text = costs_to_json(table)
    assert costs_from_json(text) == table
    document = json.loads(text)
    entry = document["tensor"]["profiled"][0]["pieces"][1]
    assert entry["collectives"] == [{"kind": "all_reduce", "phase": "F", "bytes": table.pieces[1].output_bytes,
                                     "count": 2}, {"kind": "all_reduce", "phase": "I",
                                                   "bytes": table.pieces[1].output_bytes, "count": 2}]
    del document["tensor"]["profiled"]  # a table written before profiles existed
    assert costs_from_json(json.dumps(document)).tensor.profiles == ()
    assert "profiled" not in costs_to_json(base(2))


@pytest.mark.parametrize(("change", "words"), [
    (lambda p: p.update(tp=1), "size must be an integer >= 2"),
    (lambda p: p.update(extra=1), "unknown key(s) ['extra']"),
    (lambda p: p["pieces"][0].update(f=-1.0),
     "profiled[0].pieces[0]: piece 'token_embedding' f must be a number of seconds >= 0"),
    (lambda p: p["pieces"][1]["collectives"][0].update(count=0), "count must be a positive integer"),
    (lambda p: p["pieces"][1]["collectives"][0].update(kind="broadcast"), "kind 'broadcast' is not one of"),
    (lambda p: p["runtime"].update(start_skew=1.0), "unknown key(s) ['start_skew']"),
])
def test_bad_profiled_entries_are_refused_by_name(change, words):
    document = json.loads(costs_to_json(profiled(base(2))))
    change(document["tensor"]["profiled"][0])
    with pytest.raises(CostTableError, match="costs.tensor: ") as error:
        costs_from_json(json.dumps(document))
    assert words in str(error.value)


def test_a_profile_of_other_pieces_is_refused():
    table = profiled(base(2))
    other = dataclasses.replace(table, tensor=dataclasses.replace(table.tensor, profiles=(
        dataclasses.replace(table.tensor.profiles[0], pieces=table.tensor.profiles[0].pieces[1:]),)))
    with pytest.raises(TensorParallelError, match="profile the same pieces"):
        tensor_parallel_table(other, 2)
    with pytest.raises(TensorParallelError, match="measures a size twice"):
        dataclasses.replace(table.tensor, profiles=table.tensor.profiles * 2)
