"""The profiler on small CPU models.

Oracles: exact byte counts (parameters, outputs, the activations a Linear + ReLU saves), the module
structure (piece names, call order, DAG inputs from a skip connection), and that profiling leaves
no gradients behind. Times are only checked to be positive: no timed assertions.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from pipeloom.profile.model import profile_model
from pipeloom.profile.pieces import default_pieces


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


class Skip(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x):
        first = self.a(x)
        return self.c(self.b(first)) + first  # the add runs in piece c, reading a's output


class Declared(nn.Module):
    """Children declared in another order than called, one never called."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x))


def test_default_pieces_expand_module_lists_in_call_order():
    assert default_pieces(MLP()) == ["inp", "layers.0", "layers.1", "layers.2", "out"]
    assert default_pieces(Declared()) == ["first", "second"]


def test_profile_counts_bytes_exactly():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 16)
    table = profile_model(model, x, warmup=0, repeats=1)
    assert table.names == ("inp", "layers.0", "layers.1", "layers.2", "out")
    assert table.is_chain and table.microbatch_size == 5 and table.source == "profile"
    assert table.device.startswith("cpu")
    assert table.pieces[0].param_bytes == (16 * 16 + 16) * 4
    assert table.pieces[-1].param_bytes == (16 * 2 + 2) * 4
    assert [p.output_bytes for p in table.pieces] == [5 * 16 * 4] * 4 + [5 * 2 * 4]
    # layers.k saves its input (for the weight gradient) and relu's output: 2 x (5, 16) floats
    assert table.pieces[1].activation_bytes == 2 * 5 * 16 * 4
    for piece in table.pieces:
        assert piece.f > 0 and piece.i >= 0 and piece.w > 0
    assert all(p.grad is None for p in model.parameters())


def test_profile_reads_dag_inputs_and_runs_the_loss():
    model = Skip()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    table = profile_model(model, x, warmup=0, repeats=1, loss_fn=nn.functional.mse_loss, target=y)
    assert [p.inputs for p in table.pieces] == [(), ("a",), ("a", "b")]
    assert not table.is_chain


def test_profile_takes_given_pieces_and_options():
    model = MLP(depth=4)
    table = profile_model(model, torch.randn(2, 16), pieces=["inp", "layers.2", "out"], warmup=1, repeats=2,
                          optimizer_factor=6.0)
    assert table.names == ("inp", "layers.2", "out")
    assert table.optimizer_factor == 6.0
    # "inp" runs up to layers.2, so it holds inp, layers.0 and layers.1
    assert table.pieces[0].param_bytes == 3 * (16 * 16 + 16) * 4
    # out of call order: refused (a trial's reversed pieces had each been given the other's costs)
    from pipeloom.plan.errors import PlanError

    with pytest.raises(PlanError, match=r"pieces \['layers.2', 'layers.1', 'out'\] are not in call order: the model "
                                        r"calls them as \['layers.1', 'layers.2', 'out'\]; give them in that order"):
        profile_model(model, torch.randn(2, 16), pieces=["layers.2", "layers.1", "out"], warmup=0, repeats=1)


def test_a_piece_with_running_statistics_is_marked_and_planned_on_one_replica():
    """BatchNorm's running statistics, updated by each training step: the profile marks its pieces, the cost file
    keeps the mark (written only where true), and the planner leaves out two-replica schedules, whose replicas would
    update them apart (the runtime refuses them after the first step; the planner had chosen chimera for a CNN)."""
    import json

    from pipeloom.plan import plan_pipeline
    from pipeloom.plan.costs.file import costs_from_json, costs_to_json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    table = profile_model(model, torch.randn(4, 8), warmup=0, repeats=1)
    assert [p.name for p in table.pieces if p.running_stats] == ["1"]
    document = json.loads(costs_to_json(table))
    assert [piece.get("running_stats") for piece in document["pieces"]][:3] == [None, True, None]
    assert costs_from_json(json.dumps(document)) == table
    document["pieces"][1]["running_stats"] = "yes"
    with pytest.raises(Exception, match=r"pieces\[1\]\.running_stats: expected true or false"):
        costs_from_json(json.dumps(document))
    result = plan_pipeline(table, num_ranks=2, global_batch=8, microbatches=[4], schedules=["chimera", "1f1b"])
    chimera = next(c for c in result.candidates if c.schedule == "chimera")
    assert not chimera.fits and "update running statistics (BatchNorm)" in chimera.reason
    assert result.plan.schedule == "1f1b"
    model[1].track_running_stats = False  # statistics of each batch alone: nothing kept, nothing to diverge
    assert not any(p.running_stats for p in profile_model(model, torch.randn(4, 8), warmup=0, repeats=1).pieces)
