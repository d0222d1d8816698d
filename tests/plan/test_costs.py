"""Cost tables, their JSON file, byte sizes and the analytical GPT source.

Oracles: hand-computed values (link times, scaled costs, GPT parameter counts 12h² + 13h per block),
the round trip through JSON, and the exact error messages' key words.
"""

from __future__ import annotations

import json

import pytest

from pipeloom.formatting import format_bytes
from pipeloom.plan import (
    COSTS_FORMAT,
    CostTable,
    CostTableError,
    Link,
    Piece,
    analytical_gpt_costs,
    load_costs,
    parse_bytes,
    save_costs,
)
from pipeloom.plan.costs.analytical import gpt_block_flops
from pipeloom.plan.costs.file import COSTS_FORMAT_V1, costs_from_json, costs_to_json
from pipeloom.plan.costs.parts import RuntimeCorrections, SharedParam
from pipeloom.plan.costs.table import table_for_size


def _table(**overrides) -> CostTable:
    pieces = (
        Piece(name="embed", f=1.0, i=0.0, w=2.0, activation_bytes=10, param_bytes=100, output_bytes=8),
        Piece(name="layers.0", f=2.0, i=2.0, w=2.0, activation_bytes=40, w_activation_bytes=10, param_bytes=50,
              output_bytes=8),
        Piece(name="head", f=1.0, i=1.0, w=1.0, activation_bytes=20, param_bytes=30, output_bytes=64),
    )
    return CostTable(**{"pieces": pieces, "microbatch_size": 4, "link": Link(latency=0.5, bandwidth=4.0),
                        **overrides})


def _v1(text: str) -> str:
    """``text`` (``pipeloom.costs/2``) as ``pipeloom.costs/1`` wrote it: the runtime corrections at the top
    level, a piece's measured full backward as ``b``."""
    document = json.loads(text)
    document.update(format=COSTS_FORMAT_V1, **document.pop("runtime"))
    for piece in document["pieces"]:
        piece["b"] = piece.pop("measured_full_backward")
    return json.dumps(document)


def test_link_time_is_latency_plus_bytes_over_bandwidth():
    assert Link(latency=0.5, bandwidth=4.0).time(8) == 0.5 + 2.0
    assert Link(latency=0.5).time(1e12) == 0.5  # unlimited bandwidth
    assert Link(latency=0.5, bandwidth=4.0).time(0) == 0.0  # nothing to send
    with pytest.raises(CostTableError, match="bandwidth must be > 0"):
        Link(bandwidth=0)


def test_pieces_default_to_a_chain_and_edges_follow_inputs():
    table = _table()
    assert table.is_chain
    assert [p.inputs for p in table.pieces] == [(), ("embed",), ("layers.0",)]
    assert table.edges == ((0, 1), (1, 2))
    skip = CostTable(pieces=(*table.pieces[:2], Piece(name="head", f=1, i=1, w=1, inputs=("embed", "layers.0"))),
                     microbatch_size=1)
    assert not skip.is_chain
    assert skip.edges == ((0, 1), (0, 2), (1, 2))


@pytest.mark.parametrize(("pieces", "words"), [
    ((Piece(name="a", f=1, i=1, w=1), Piece(name="a", f=1, i=1, w=1)), "appears twice"),
    ((Piece(name="a", f=1, i=1, w=1, inputs=("b",)), Piece(name="b", f=1, i=1, w=1)), "a later piece"),
    ((Piece(name="a", f=1, i=1, w=1, inputs=("zz",)),), "no piece of the table"),
    ((Piece(name="a", f=1, i=1, w=1), Piece(name="b", f=1, i=1, w=1, inputs=("b",))), "reads from 'b', which is "
                                                                                     "itself"),
    ((), "no pieces"),
])
def test_bad_tables_say_what_is_wrong(pieces, words):
    with pytest.raises(CostTableError, match=words):
        CostTable(pieces=pieces, microbatch_size=1)


def test_bad_piece_values_are_refused():
    with pytest.raises(CostTableError, match="piece 'x' f must be >= 0"):
        Piece(name="x", f=-1, i=0, w=0)
    with pytest.raises(CostTableError, match="w_activation_bytes .* exceeds"):
        Piece(name="x", f=1, i=1, w=1, activation_bytes=1, w_activation_bytes=2)
    with pytest.raises(CostTableError, match="microbatch_size must be a positive integer"):
        _table(microbatch_size=0)


def test_static_bytes_count_weights_gradients_and_optimizer_state():
    table = _table(optimizer_factor=2.0)
    assert table.static_bytes(table.pieces[0]) == 100 * 4  # weights + grads + two Adam moments
    assert _table(optimizer_factor=6.0).static_bytes(table.pieces[0]) == 800


def test_scaling_is_linear_except_parameters():
    table = _table()
    double = table.scaled(8)
    assert double.microbatch_size == 8
    for old, new in zip(table.pieces, double.pieces):
        assert (new.f, new.i, new.w) == (2 * old.f, 2 * old.i, 2 * old.w)
        assert new.activation_bytes == 2 * old.activation_bytes
        assert new.w_activation_bytes == 2 * old.w_activation_bytes
        assert new.output_bytes == 2 * old.output_bytes
        assert new.param_bytes == old.param_bytes
    assert table.scaled(4) is table
    per_action = _table(runtime=RuntimeCorrections(action_overhead=0.5))
    assert per_action.scaled(8).runtime.action_overhead == 0.5  # per action, not per sample
    # costs a float cannot hold at the size asked: said with the factor (an inf had been blamed on the file's piece)
    huge = _table(pieces=(Piece(name="a", f=1e307, i=1.0, w=1.0),))
    with pytest.raises(CostTableError, match=r"times 256 \(micro-batches of 1024 sequences against the table's 4\) "
                                             r"pass a float's range: its costs are up to 1e\+307"):
        huge.scaled(1024)


def test_json_round_trip(tmp_path):
    table = _table(device="cpu", source="profile", optimizer_factor=3.0,
                   runtime=RuntimeCorrections(action_overhead=1e-4))
    path = tmp_path / "costs.json"
    save_costs(table, path)
    document = json.loads(path.read_text())
    assert document["format"] == COSTS_FORMAT
    assert load_costs(path) == table


def test_json_optional_keys_take_their_defaults():
    text = json.dumps({"format": COSTS_FORMAT, "microbatch_size": 2,
                       "pieces": [{"name": "a", "f": 1, "i": 1, "w": 1}, {"name": "b", "f": 2, "i": 2, "w": 2}]})
    table = costs_from_json(text)
    assert table.link == Link() and table.optimizer_factor == 2.0 and table.source == "manual"
    assert table.runtime.action_overhead == 0.0
    assert table.pieces[1].inputs == ("a",) and table.pieces[0].param_bytes == 0.0


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.pop("format"), "missing key 'format'"),
    (lambda d: d.update(format="pipeloom.costs/9"), "expected 'pipeloom.costs/1'"),
    (lambda d: d.update(extra=1), r"unknown key\(s\) \['extra'\]"),
    (lambda d: d["pieces"][0].update(flops=1), r"pieces\[0\]: unknown key\(s\) \['flops'\]"),
    (lambda d: d["pieces"][0].update(f="fast"), r"pieces\[0\]\.f: expected a finite number"),
    (lambda d: d["pieces"][0].pop("w"), r"pieces\[0\]: missing key 'w'"),
    (lambda d: d.update(link={"latency": 1, "speed": 2}), r"costs\.link: unknown key"),
    (lambda d: d.update(microbatch_size=1.5), "microbatch_size: expected an integer"),
    (lambda d: d.update(action_overhead=-1), "action_overhead: must be >= 0"),
    (lambda d: d.update(replica_link={"latency": 1, "speed": 2}), r"costs\.replica_link: unknown key"),
    (lambda d: d.update(replica_link=[1, 2]), r"costs\.replica_link: expected an object"),
    (lambda d: d.update(time_spread=-0.5), "time_spread: must be >= 0"),
    (lambda d: d.update(start_skew=-0.5), "start_skew: must be >= 0"),
    (lambda d: d.update(message_cost=-1e-4), "message_cost: must be >= 0"),
    (lambda d: d.update(start_skew="late"), r"start_skew: expected a finite number"),
])
def test_json_errors_name_the_key(change, words):
    document = json.loads(_v1(costs_to_json(_table())))  # a pipeloom.costs/1 file: flat runtime keys
    change(document)
    with pytest.raises(CostTableError, match=words):
        costs_from_json(json.dumps(document))


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d.update(format="pipeloom.costs/9"), "expected 'pipeloom.costs/1' or 'pipeloom.costs/2'"),
    (lambda d: d.update(action_overhead=1), r"unknown key\(s\) \['action_overhead'\]"),  # /1's place
    (lambda d: d["pieces"][0].update(b=1), r"pieces\[0\]: unknown key\(s\) \['b'\]"),
    (lambda d: d["pieces"][0].update(measured_full_backward=-1),
     r"pieces\[0\]\.measured_full_backward: must be >= 0"),
    (lambda d: d.update(runtime=[1]), r"costs\.runtime: expected an object"),
    (lambda d: d["runtime"].update(extra=1), r"costs\.runtime: unknown key\(s\) \['extra'\]"),
    (lambda d: d["runtime"].update(action_overhead=-1), r"costs\.runtime\.action_overhead: must be >= 0"),
    (lambda d: d["runtime"].update(replica_link={"latency": 1, "speed": 2}),
     r"costs\.runtime\.replica_link: unknown key"),
    (lambda d: d["runtime"].update(start_skew="late"),
     r"costs\.runtime\.start_skew: expected a finite number"),
])
def test_json_errors_name_the_key_in_format_2(change, words):
    document = json.loads(costs_to_json(_table()))
    change(document)
    with pytest.raises(CostTableError, match=words):
        costs_from_json(json.dumps(document))


def test_format_2_nests_the_runtime_corrections_and_format_1_still_loads():
    runtime = RuntimeCorrections(action_overhead=1e-4, message_cost=3e-4, step_overhead=2e-3, time_spread=0.1,
                                 start_skew=1e-3, replica_link=Link(latency=2e-3))
    piece = Piece(name="a", f=1.0, i=1.0, w=1.0, measured_full_backward=1.5)
    table = _table(runtime=runtime, pieces=(piece,))
    document = json.loads(costs_to_json(table))
    assert document["format"] == COSTS_FORMAT == "pipeloom.costs/2"
    assert document["runtime"] == {"action_overhead": 1e-4, "message_cost": 3e-4, "step_overhead": 2e-3,
                                   "time_spread": 0.1, "start_skew": 1e-3,
                                   "replica_link": {"latency": 2e-3, "bandwidth": None}}
    assert document["pieces"][0]["measured_full_backward"] == 1.5 and "b" not in document["pieces"][0]
    assert costs_from_json(_v1(costs_to_json(table))) == table  # the same table from the old file
    del document["runtime"]
    assert costs_from_json(json.dumps(document)).runtime == RuntimeCorrections()  # none measured


def test_costs_v1_names_are_file_names_only():
    """costs/1's flat names and a piece's ``b`` load from files (above), but the Python API has one name each."""
    with pytest.raises(TypeError):
        _table(action_overhead=1e-4)
    with pytest.raises(TypeError):
        Piece(name="x", f=1.0, i=1.0, w=1.0, b=2.5)
    assert not hasattr(_table(), "action_overhead") and not hasattr(Piece(name="x", f=1.0, i=1.0, w=1.0), "b")


def test_load_costs_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(CostTableError, match="bad.json.*malformed JSON"):
        load_costs(path)
    with pytest.raises(CostTableError, match="missing.json"):
        load_costs(tmp_path / "missing.json")


@pytest.mark.parametrize(("text", "value"), [
    ("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("16GB", 16e9), ("1.5 kib", 1536), ("1e9", 1e9),
    ("100", 100), ("2TiB", 2 * 2**40), (4096, 4096),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80XB", "GiB", "-1GiB", "", "1,5GB"])
def test_parse_bytes_refuses_other_text(text):
    with pytest.raises(CostTableError, match="bad size|must be >= 0"):
        parse_bytes(text)


def test_a_size_of_one_letter_asks_binary_or_decimal():
    with pytest.raises(CostTableError, match=r"bad size '80G': write 80GiB \(powers of 1024.* or 80GB \(powers of"):
        parse_bytes("80G")


def test_format_bytes():
    assert format_bytes(80 * 2**30) == "80 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 2**40) == "3 TiB"


def test_gpt_block_flops_matches_the_closed_form():
    f, i, w = gpt_block_flops(batch=2, seq=8, hidden=16)
    linear, attention = 24 * 2 * 8 * 16**2, 4 * 2 * 8**2 * 16
    assert (f, i, w) == (linear + attention, linear + 2 * attention, linear)


def test_analytical_gpt_costs():
    table = analytical_gpt_costs(layers=4, hidden=1024, heads=16, seq=128, vocab=1000, microbatch_size=2,
                                 flops_per_second=1e14, bytes_per_second=1e18)
    assert table.names == ("token_embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head")
    assert table.is_chain and table.source == "analytical" and table.microbatch_size == 2
    block = table.pieces[1]
    assert block.param_bytes == (12 * 1024**2 + 13 * 1024) * 2  # 12h² + 13h parameters of 2 bytes
    assert block.activation_bytes == pytest.approx(128 * 2 * 1024 * (34 + 5 * 16 * 128 / 1024))
    # compute-bound (huge memory bandwidth) and s << h: I ≈ W ≈ F, within the attention share
    assert block.i == pytest.approx(block.f, rel=0.03) and block.w == pytest.approx(block.f, rel=0.03)
    assert block.f == pytest.approx(gpt_block_flops(batch=2, seq=128, hidden=1024)[0] / 1e14)
    head = table.pieces[-1]
    assert head.f == pytest.approx(2 * 2 * 128 * 1024 * 1000 / 1e14)
    assert table.pieces[0].i == 0.0  # no gradient flows into token ids
    assert table.scaled(4).pieces[1].f == pytest.approx(2 * block.f)


def test_analytical_gpt_costs_checks_its_arguments():
    with pytest.raises(CostTableError, match="not a multiple of heads"):
        analytical_gpt_costs(layers=1, hidden=10, heads=3, seq=4, vocab=5, microbatch_size=1,
                             flops_per_second=1, bytes_per_second=1)
    with pytest.raises(CostTableError, match="flops_per_second must be a positive number"):
        analytical_gpt_costs(layers=1, hidden=8, heads=2, seq=4, vocab=5, microbatch_size=1,
                             flops_per_second=0, bytes_per_second=1)


def test_table_for_size_interpolates_between_measured_sizes():
    from pipeloom.plan.costs.table import table_for_size

    small = CostTable(pieces=(Piece(name="a", f=1.0, i=1.0, w=1.0, activation_bytes=10, param_bytes=7),),
                      microbatch_size=1)
    large = CostTable(pieces=(Piece(name="a", f=5.0, i=3.0, w=1.0, activation_bytes=50, param_bytes=7),),
                      microbatch_size=5)
    assert table_for_size([small, large], 5) is large
    middle = table_for_size([large, small], 2).pieces[0]  # any order
    assert (middle.f, middle.i, middle.w, middle.activation_bytes) == (2.0, 1.5, 1.0, 20.0)
    assert table_for_size([small, large], 10).pieces[0].f == 10.0  # beyond: the nearest, scaled
    assert table_for_size(small, 3).pieces[0].f == 3.0
    other = CostTable(pieces=(Piece(name="b", f=1, i=1, w=1),), microbatch_size=2)
    with pytest.raises(CostTableError, match="list different pieces"):
        table_for_size([small, other], 2)


def test_full_backward_is_b_where_measured_else_i_plus_w():
    table = _table()
    assert [p.full_backward for p in table.pieces] == [2.0, 4.0, 2.0]
    measured = Piece(name="x", f=1.0, i=2.0, w=3.0, measured_full_backward=4.0)
    assert measured.full_backward == 4.0
    assert measured.time == 6.0  # f + i + w: the split's compute, whatever b is
    with pytest.raises(CostTableError, match="piece 'x' measured_full_backward must be >= 0"):
        Piece(name="x", f=1.0, i=1.0, w=1.0, measured_full_backward=-1.0)


def test_b_and_step_overhead_round_trip_and_default_for_old_files():
    pieces = (Piece(name="a", f=1.0, i=1.0, w=1.0, measured_full_backward=1.5),
              Piece(name="b", f=2.0, i=2.0, w=2.0))
    table = CostTable(pieces=pieces, microbatch_size=2, runtime=RuntimeCorrections(step_overhead=3e-3))
    again = costs_from_json(costs_to_json(table))
    assert again == table and again.pieces[0].measured_full_backward == 1.5
    assert again.pieces[1].measured_full_backward is None
    old = json.dumps({"format": COSTS_FORMAT, "microbatch_size": 2, "pieces": [{"name": "a", "f": 1, "i": 1, "w": 2}]})
    table = costs_from_json(old)
    assert table.runtime.step_overhead == 0.0 and table.pieces[0].measured_full_backward is None
    assert table.pieces[0].full_backward == 3.0


def test_b_scales_and_interpolates_with_the_other_times():
    pieces = (Piece(name="a", f=1.0, i=1.0, w=1.0, measured_full_backward=1.5),
              Piece(name="b", f=2.0, i=2.0, w=2.0))
    small = CostTable(pieces=pieces, microbatch_size=2)
    assert [p.measured_full_backward for p in small.scaled(4).pieces] == [3.0, None]
    big = CostTable(pieces=tuple(Piece(name=p.name, f=2 * p.f, i=2 * p.i, w=2 * p.w,
                                       measured_full_backward=5.5) for p in pieces),
                    microbatch_size=6)
    middle = table_for_size([small, big], 4)
    # halfway: a from 1.5 to 5.5, b from i + w = 4 (not measured) to 5.5
    assert [p.measured_full_backward for p in middle.pieces] == [pytest.approx(3.5), pytest.approx(4.75)]


def test_time_spread_and_replica_link_round_trip_and_default_for_old_files():
    table = _table(runtime=RuntimeCorrections(time_spread=0.15, start_skew=2e-3, message_cost=3e-4,
                                              replica_link=Link(latency=2e-3, bandwidth=3e9)))
    again = costs_from_json(costs_to_json(table))
    assert again == table and again.runtime.replica_link == Link(latency=2e-3, bandwidth=3e9)
    assert (again.runtime.start_skew, again.runtime.message_cost) == (2e-3, 3e-4)
    document = json.loads(_v1(costs_to_json(_table())))  # an old file, written by pipeloom.costs/1
    assert document["replica_link"] is None and document["time_spread"] == 0.0 and document["start_skew"] == 0.0
    for key in ("replica_link", "time_spread", "start_skew", "message_cost"):
        document.pop(key)
    old = costs_from_json(json.dumps(document))
    corrections = old.runtime
    assert corrections.replica_link is None
    assert corrections.time_spread == corrections.start_skew == corrections.message_cost == 0.0


def test_replica_link_must_be_a_link():
    with pytest.raises(CostTableError, match="replica_link is dict, expected a Link"):
        _table(runtime=RuntimeCorrections(replica_link={"latency": 1.0}))


def test_table_for_size_keeps_a_replica_link_any_table_measured():
    exchange = Link(latency=2e-3)
    small = _table(microbatch_size=2)  # e.g. one micro-batch per step: no two-replica profile there
    large = _table(microbatch_size=8, runtime=RuntimeCorrections(replica_link=exchange))
    assert table_for_size([small, large], 4).runtime.replica_link == exchange
    assert table_for_size([small, large], 2).runtime.replica_link == exchange
    assert table_for_size([small, large], 16).runtime.replica_link == exchange
    assert table_for_size([small], 2).runtime.replica_link is None


def test_table_for_size_interpolates_the_fitted_action_overhead_and_time_spread():
    small = _table(microbatch_size=2, runtime=RuntimeCorrections(
        action_overhead=1e-4, time_spread=0.2, step_overhead=1e-3, start_skew=1e-3, message_cost=4e-4))
    large = _table(microbatch_size=6, runtime=RuntimeCorrections(
        action_overhead=3e-4, time_spread=0.1, step_overhead=5e-3, start_skew=3e-3, message_cost=2e-4))
    middle = table_for_size([small, large], 4)
    assert middle.runtime.action_overhead == pytest.approx(2e-4) and middle.runtime.time_spread == pytest.approx(0.15)
    assert middle.runtime.start_skew == pytest.approx(2e-3) and middle.runtime.message_cost == pytest.approx(3e-4)
    assert middle.runtime.step_overhead == 1e-3  # the first table's, as before
    assert table_for_size([small, large], 6).runtime.action_overhead == 3e-4  # a measured size keeps its own


def _shared_table(**overrides) -> CostTable:
    return _table(shared=(SharedParam(name="embed.weight", bytes=60, pieces=("head", "embed")),), **overrides)


def test_shared_parameters_round_trip_in_call_order():
    table = _shared_table()
    assert table.shared[0].pieces == ("embed", "head")  # sorted into call order
    text = costs_to_json(table)
    assert json.loads(text)["shared"] == [{"name": "embed.weight", "bytes": 60.0, "pieces": ["embed", "head"]}]
    assert costs_from_json(text) == table
    assert table.scaled(8).shared == table.shared  # bytes of parameters do not scale
    assert table_for_size([table, table.scaled(8)], 6).shared == table.shared


def test_old_files_without_shared_parameters_still_load():
    document = json.loads(costs_to_json(_table()))
    assert "shared" not in document  # written only when some piece shares a parameter
    assert costs_from_json(json.dumps(document)).shared == ()


@pytest.mark.parametrize(("shared", "words"), [
    ([{"name": "w", "bytes": 1, "pieces": ["embed", "nowhere"]}], "nowhere"),
    ([{"name": "w", "bytes": 1, "pieces": ["embed"]}], "two or more pieces"),
    ([{"name": "w", "bytes": -1, "pieces": ["embed", "head"]}], "bytes"),
    ([{"name": "w", "bytes": 1, "pieces": ["embed", "head"], "extra": 1}], "unknown key"),
    ({"name": "w"}, "list of shared parameters"),
])
def test_bad_shared_entries_say_what_is_wrong(shared, words):
    document = json.loads(costs_to_json(_table()))
    document["shared"] = shared
    with pytest.raises(CostTableError, match=words):
        costs_from_json(json.dumps(document))
