"""What one micro-batch's work is made of (``PhaseTimes.parts``, ``Estimate.work``, the report's "work per
micro-batch" line): the parts of every layer add up to its F + I + W, and each part is the seconds the pricing gave
that kind of work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeloom.cli import main
from pipeloom.plan.cluster.api import plan_cluster
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.gpus import hardware
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layer_time import layer_times
from pipeloom.plan.cluster.layout import Layout
from pipeloom.plan.cluster.model.kinds import layer_kinds
from pipeloom.plan.cluster.model.reader import model_spec
from pipeloom.plan.cluster.step import WORK_PARTS

CONFIGS = Path(__file__).parents[3] / "benchmarks/data/configs"


@pytest.mark.parametrize(("name", "layout", "options"), [
    ("llama3-8b", Layout(dp=2, tp=4, mbs=2, recompute="selective"), {}),
    ("llama3-70b", Layout(dp=1, tp=8, cp=2, recompute="full"), {}),
    ("qwen3-30b-a3b", Layout(dp=16, ep=16), {"moe_comm": "hybridep"}),
    ("deepseek-v3", Layout(dp=16, ep=16, recompute="selective"), {"selective": "mla_up_proj"}),
    ("gpt-oss-120b", Layout(dp=16, ep=8), {}),
], ids=["llama-tp", "llama-cp", "qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_every_layers_parts_add_up_to_its_time(name, layout, options):
    spec = model_spec(json.loads((CONFIGS / f"{name}.json").read_text()))
    job = Job(spec=spec, hw=hardware("h100"), gpus=layout.gpus, global_batch=64, seq=8192, **options)
    for kind in {*layer_kinds(spec), "embedding", "head"}:
        times = layer_times(job, layout, kind)
        parts = dict(times.parts)
        assert set(parts) <= set(WORK_PARTS) and all(seconds > 0 for seconds in parts.values()), (kind, parts)
        assert sum(parts.values()) == pytest.approx(times.f + times.i + times.w, rel=1e-12), kind
        if layout.ep > 1 and kind.startswith("moe"):
            assert parts["expert all-to-all"] >= times.f_comm + times.i_comm > 0
        assert ("recomputation" in parts) == (layout.recompute != "none" and kind not in ("embedding", "head"))
        assert ("tensor-parallel exchanges" in parts) == (layout.tp > 1)


def test_the_expert_all_to_all_is_what_the_dispatch_priced():
    """Qwen3-30B-A3B's ep 16 over two nodes of H100s with Hybrid-EP (tests/plan/cluster/test_hybridep.py): both
    passes' dispatch and combine, their host synchronization included."""
    spec = model_spec(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))
    job = Job(spec=spec, hw=hardware("h100"), gpus=16, global_batch=1024, seq=4096, moe_comm="hybridep")
    reach = 1 - math.comb(64, 8) / math.comb(128, 8)
    ours, calls = 4096 * 2 * reach * 2048 * 2, 4096 * 2 * reach * 7168 * 2
    one_pass = (ours / 71.71e9 + ours / 62.95e9 + (calls / 54.47e9 - calls / 71.71e9)
                + (calls / 53.35e9 - calls / 62.95e9))
    assert dict(layer_times(job, Layout(dp=16, ep=16), "moe").parts)["expert all-to-all"] == pytest.approx(2 * one_pass)


def test_a_plans_work_is_its_stages_and_the_report_says_it(capsys, tmp_path):
    """Estimate.work adds every model stage's parts (one copy of the model), what no part names (blocking pipeline
    sends here) as other; the report prints the shares largest first and --json the seconds."""
    config = json.loads((CONFIGS / "llama3-8b.json").read_text())
    layout = "dp=2,tp=2,pp=2,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"
    result = plan_cluster(config, "h100", gpus=8, global_batch=16, seq=4096, layout=layout, p2p_overlap=False)
    stages = Estimator(result.job).stages(result.best.layout)[0]
    work = dict(result.best.work)
    assert sum(work.values()) == pytest.approx(sum(t.f + t.i + t.w for t in stages), rel=1e-12)
    assert work["other"] > 0  # the sends that block the ranks (p2p_overlap=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "8", "--global-batch", "16", "--seq",
               "4096", "--layout", layout]
    assert main(command) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("work per micro-batch"))
    shares = [float(part.rsplit(" ", 2)[1]) for part in line.split(": ", 1)[1].split(", ")]
    assert shares == sorted(shares, reverse=True) and line.split(": ", 1)[1].startswith("GEMMs ")
    assert main([*command, "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["best"]["work_per_microbatch"]) <= {*WORK_PARTS, "other"}
