"""``tp_plan="auto"`` (pipeloom.runtime.parallel.tp_auto): the regions found in the test transformer and in tiny
random-init LLaMA (against LLaMA's own tensor-parallel plan), the refusals by name (GPT-2's Conv1D, no blocks,
no sizes, no OR-Tools), the search's choice from the model's shapes (replication when memory is free, tensor
parallelism when it binds, a cost table's prices, the options DTensor's own rules offer), and on gloo ranks
the auto plan run by ``pipeline()`` with gradients bitwise equal to torch's ``parallelize_module`` of the same
plan without pipelining: the test transformer on pp 2 x tp 2 (tp_auto_jobs.auto_job) and LLaMA on pp 1 x tp 2
(tp_auto_jobs.llama_auto_job)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tp_auto_jobs as jobs
from ranks import run_ranks

from pipeloom.plan.costs.parts import Link, Piece
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import SolverMissingError
from pipeloom.plan.tp.sharding import OPTIONS
from pipeloom.runtime.errors import PipelineError, RegionsNotFoundError
from pipeloom.runtime.parallel.tp_auto import AutoPlan, auto_tp_plan, find_regions
from pipeloom.runtime.parallel.tp_rules import dtensor_options


class Mesh:
    """What auto_tp_plan reads of a DeviceMesh: its dimension names and sizes (pp 2 x tp 2)."""

    mesh_dim_names = ("pp", "tp")

    def size(self, dim: int) -> int:
        return 2


EXAMPLE = (jobs.batch(0)[0],)  # a batch as step() takes: 8 sequences of SEQ tokens


def _auto(options: AutoPlan | str = "auto", model=None):
    return auto_tp_plan(model or jobs.build(), Mesh(), microbatches=jobs.MICROBATCHES, example_inputs=EXAMPLE,
                        options=options)


def _free_memory() -> float:
    return _auto().predicted_memory


def test_regions_of_the_test_transformer():
    regions = find_regions(jobs.build())
    m = regions.modules
    assert m.attention_column == ("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v")
    assert m.attention_row == ("layers.*.attn.out",) and m.mlp_column == ("layers.*.mlp.up",)
    assert m.mlp_row == ("layers.*.mlp.down",)
    assert (m.attention_module, m.mlp_module) == ("layers.*.attn", "layers.*.mlp")
    assert m.norms == ("layers.*.norm1", "layers.*.norm2", "norm") and (m.embedding, m.head) == ("embed", "head")
    assert (regions.layers, regions.hidden, regions.heads, regions.ffn_width, regions.vocab) == (2, 16, 4, 64, 32)
    assert regions.attention_weights == 4 * 16 * 16 and regions.mlp_weights == 2 * 16 * 64


def test_regions_of_llama_are_the_modules_of_its_own_plan():
    """LLaMA's regions (GQA: k and v narrower; a gated MLP) found from shapes cover exactly the modules its
    config's base_model_tp_plan shards, with the same column/row roles."""
    from hf_models import build_hf

    from pipeloom.runtime.parallel.tp import hf_plan

    model = build_hf("llama")
    m = find_regions(model).modules
    own = {key: type(style).__name__ for key, style in hf_plan(model).items() if key != "lm_head"}
    found = {key: "ColwiseParallel" for key in m.attention_column + m.mlp_column}
    found.update({key: "RowwiseParallel" for key in m.attention_row + m.mlp_row})
    assert found == own
    assert (m.embedding, m.head, m.attention_module) == ("model.embed_tokens", "lm_head", "model.layers.*.self_attn")


def test_models_without_regions_are_refused_by_name():
    from hf_models import build_hf
    from tp_jobs import MLP

    with pytest.raises(RegionsNotFoundError, match="Conv1D .*'attn.c_attn'.*pass torch's parallelize_module plan"):
        find_regions(build_hf("gpt2"))
    with pytest.raises(RegionsNotFoundError, match="no nn.ModuleList or nn.Sequential of identical blocks"):
        find_regions(MLP())
    with pytest.raises(PipelineError, match="pass tracing=Tracing\\(example_inputs=.* or tp_plan=AutoPlan\\(seq="):
        auto_tp_plan(jobs.build(), Mesh())
    with pytest.raises(PipelineError, match="AutoPlan.memory_limit must be a positive number"):
        AutoPlan(memory_limit=-1)


def test_a_regions_refusal_gives_its_advice_once():
    from hf_models import build_hf

    headless = jobs.build()
    for module in headless.modules():
        if hasattr(module, "head_dim"):
            module.head_dim = None  # no head count anywhere
    for model in (headless, build_hf("gpt2")):
        with pytest.raises(RegionsNotFoundError) as refused:
            find_regions(model)
        assert str(refused.value).count("parallelize_module plan") == 1, refused.value
    assert "no head count" in str(refused.value) or "Conv1D" in str(refused.value)
    with pytest.raises(RegionsNotFoundError, match=r"no head count .*\); pass tp_plan=AutoPlan\(heads=\.\.\.\) or"):
        find_regions(headless)


def test_replication_when_memory_is_free_and_tensor_parallel_when_it_binds():
    """Tiny layers on the CPU default prices: collectives cost more than they save, so everything is replicated
    (an empty plan); under 0.6 of that memory attention and MLP go Megatron, within the limit; sequence
    parallelism, when allowed, fits where Megatron does not, and the loss-parallel head (when allowed) where
    nothing else does; what fits nothing is refused by name."""
    free = _auto()
    assert set(free.result.choice.values()) == {"replicate"} and free.plan == {}
    limit = 0.6 * free.predicted_memory
    bound = _auto(AutoPlan(memory_limit=limit))
    assert bound.result.choice["attention"] == bound.result.choice["mlp"] == "megatron"
    assert bound.predicted_memory <= limit < free.predicted_memory
    assert bound.predicted_step_time > free.predicted_step_time
    assert type(bound.plan["layers.*.attn.q"]).__name__ == "ColwiseParallel"
    assert type(bound.plan["layers.*.mlp.down"]).__name__ == "RowwiseParallel"
    sp_limit = 0.99 * bound.predicted_memory
    with pytest.raises(PipelineError, match="no sharding of LM fits memory_limit") as refused:
        _auto(AutoPlan(memory_limit=sp_limit))
    # the refusal names the least memory the search reaches: that limit is accepted, one KiB less is not
    reach = re.search(r"the least its candidates reach is ([\d,]+) bytes per rank \((?:embedding|attention) ",
                      str(refused.value))
    assert reach, refused.value
    least = float(reach.group(1).replace(",", ""))
    assert sp_limit < least <= bound.predicted_memory + 4 * 1024
    assert _auto(AutoPlan(memory_limit=least)).predicted_memory <= least
    with pytest.raises(PipelineError, match="no sharding of LM fits memory_limit"):
        _auto(AutoPlan(memory_limit=least - 1024))
    sp = _auto(AutoPlan(memory_limit=sp_limit, sequence_parallel=True))
    assert sp.result.choice == jobs.SP_CHOICE and sp.result.recipe["recipe"] == "megatron-sp"
    assert type(sp.plan["layers.*.attn"]).__name__ == "PrepareModuleInput"
    lp_limit = 0.999 * sp.predicted_memory  # only vocabulary-sharded logits (the loss-parallel head) fit
    with pytest.raises(PipelineError, match="no sharding of LM fits memory_limit"):
        _auto(AutoPlan(memory_limit=lp_limit, sequence_parallel=True))
    lp = _auto(AutoPlan(memory_limit=lp_limit, sequence_parallel=True, loss_parallel=True))
    assert lp.result.choice == jobs.LOSS_CHOICE and lp.predicted_memory <= lp_limit
    assert lp.result.recipe["loss_head"] == ["head"] and not lp.plan["head"].use_local_output


def test_a_cost_table_sets_the_compute_rate_and_link():
    """A cost table whose block pieces take 1 ms: the compute rate is one block's analytical forward FLOPs per
    ms; collectives are priced on its link."""
    pieces = (Piece(name="embed", f=1e-4, i=1e-4, w=0.0), Piece(name="layers.0", f=1e-3, i=1e-3, w=1e-3),
              Piece(name="layers.1", f=1e-3, i=1e-3, w=1e-3), Piece(name="head", f=1e-4, i=1e-4, w=1e-4))
    table = CostTable(pieces=pieces, microbatch_size=2, link=Link(latency=1e-3, bandwidth=1e6))
    found = _auto(AutoPlan(costs=table))
    b, s = 2, jobs.SEQ
    work = 2.0 * b * s * (4 * 16 * 16 + 2 * 16 * 64) + 4.0 * b * s * s * 16
    assert found.problem.flops_per_second == pytest.approx(work / 1e-3)
    assert found.problem.microbatch_size == 2
    assert found.problem.fit.latency["all_reduce"] == 1e-3 and found.problem.fit.bandwidth["all_reduce"] == 1e6
    assert any("cost table" in note for note in found.notes)


def test_the_options_are_those_dtensors_own_rules_offer(monkeypatch):
    """torch 2.13's single-dimension rules for aten.mm (column: R, S(1) -> S(1); row: S(1), S(0) -> Partial)
    and aten.embedding (vocabulary rows: S(0) -> masked Partial) offer every option of the hand table. With
    the row rule taken away, Megatron and SP drop out (the head's column-parallel options stay) and the search
    cannot use them; without the registry, the search runs unchecked and says so."""
    import torch
    from torch.distributed.tensor import DTensor

    assert dtensor_options() == OPTIONS
    rules = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    mm = rules[torch.ops.aten.mm.default]
    monkeypatch.setitem(rules, torch.ops.aten.mm.default,
                        lambda *args: [s for s in mm(*args) if "Partial" not in type(s[0]).__name__])
    narrowed = dtensor_options()
    assert narrowed["attention"] == narrowed["mlp"] == ("replicate",)
    assert narrowed["head"] == OPTIONS["head"] and narrowed["embedding"] == OPTIONS["embedding"]
    with pytest.raises(PipelineError, match="no sharding of LM fits memory_limit"):
        _auto(AutoPlan(memory_limit=0.6 * _free_memory()))
    monkeypatch.setitem(rules, torch.ops.aten.mm.default, mm)
    monkeypatch.delitem(rules, torch.ops.aten.embedding.default)
    found = _auto()
    assert any("not checked against DTensor's rules" in note for note in found.notes), found.notes


def test_without_ortools_the_runtime_imports_and_auto_names_the_fix():
    """OR-Tools hidden: pipeloom.runtime (and tp_auto) still import, and the search raises SolverMissingError
    naming `pip install ortools`."""
    blocker = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'ortools' or name.startswith('ortools.'):\n"
               "            raise ImportError('ortools hidden by the test')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import pipeloom.runtime, pipeloom.runtime.parallel.tp_auto, pipeloom.plan.tp.sharding\n"
               "print('imported')\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "ortools"}
    sys.modules["ortools"] = None  # type: ignore[assignment]
    try:
        with pytest.raises(SolverMissingError, match="pip install ortools"):
            _auto()
    finally:
        del sys.modules["ortools"]
        sys.modules.update(hidden)


# ------------------------------------------------------------------------------------ on 4 gloo ranks


@pytest.fixture(scope="module")
def auto_runs():
    results = run_ranks(4, jobs.auto_job, 0.6 * _free_memory(), timeout=240)
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in results.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["free", "bound"])
def test_auto_plan_runs_bitwise_as_torch_without_pipelining(auto_runs, case):
    """pp 2 x tp 2, 1f1b, 2 SGD steps: ``tp_plan="auto"`` replicates everything (no DTensor parameter) and
    ``AutoPlan(memory_limit=0.6 x that memory)`` shards attention and MLP (Megatron); either way every rank's
    local gradients are bitwise those of the chosen plan run by torch without pipelining, the same loss on
    every rank, no parameter without a gradient; engine.tp_sharding is what auto_tp_plan returns."""
    losses = {tuple(runs[case]["pipeline"]["loss"]) for runs in auto_runs.values()}
    assert len(losses) == 1, losses
    for rank, runs in auto_runs.items():
        found = runs[case]
        mine, alone = found["pipeline"], found["alone"]
        assert mine["loss"] == alone["loss"] and found["same_as_function"], rank
        if case == "free":
            assert set(found["choice"].values()) == {"replicate"} and found["sharded"] == [], (rank, found)
        else:
            assert found["choice"]["attention"] == found["choice"]["mlp"] == "megatron", (rank, found["choice"])
            assert any(name.endswith("attn.q.weight") for name in found["sharded"]), (rank, found["sharded"])
        for step in range(jobs.STEPS):
            assert mine["missing"][step] == [] and mine["local"][step], (rank, step)
            for name, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][name]), (rank, case, step, name)


@pytest.mark.timeout(300)
def test_auto_plan_runs_llama_bitwise_as_torch_without_pipelining():
    """pp 1 x tp 2, tiny random-init LLaMA (float64, the model as the one stage): under 0.6 of the replicated
    memory the search shards attention, MLP (GQA's k/v and the gated MLP as found) and the embedding; 2 steps,
    gradients bitwise those of the same plan run by torch, none missing, the same loss on both ranks."""
    results = run_ranks(2, jobs.llama_auto_job, 0.6, timeout=240)
    bad = {rank: value for rank, value in results.items() if value[0] != "ok"}
    assert not bad, bad
    runs = {rank: value for rank, (_, value) in results.items()}
    assert len({tuple(found["pipeline"]["loss"]) for found in runs.values()}) == 1
    for rank, found in runs.items():
        assert set(found["free"].values()) == {"replicate"}, found["free"]
        assert found["choice"]["attention"] == found["choice"]["mlp"] == "megatron", found["choice"]
        assert "model.layers.*.self_attn.k_proj" in found["plan"] and found["sharded"], found["plan"]
        mine, alone = found["pipeline"], found["alone"]
        assert mine["loss"] == alone["loss"]
        for step in range(jobs.STEPS):
            assert mine["missing"][step] == [] and mine["local"][step], (rank, step)
            for name, grad in mine["local"][step].items():
                assert np.array_equal(grad, alone["local"][step][name]), (rank, step, name)
