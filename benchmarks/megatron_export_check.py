"""``pipeloom plan --export megatron`` against Megatron-LM's own argument checks: every published run's layout
(``benchmarks/data/published_runs.json``, priced as ``cluster_published.py`` prices it) and, with ``--search``, the
planner's choice for Megatron-LM on the same job, exported, then parsed and validated by each given Megatron-LM
source tree (``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``: the degrees' divisibility,
the pipeline layout, the recomputation, the FP8 recipe and the expert options), with model arguments written from
the config (layers, hidden size, heads and query groups, MLP and experts, multi-token prediction).

    python benchmarks/megatron_export_check.py --megatron-src DIR [DIR ...] [--search] [--only SUBSTRING]

Each DIR is a Megatron-LM checkout (``git archive core_v0.15.3 megatron | tar -x -C DIR``); torch only (no GPU, no
Transformer Engine: the checks' device queries are answered as a Hopper's, or a Blackwell's for those GPUs, and
their Transformer Engine version as 2.9). Prints one line
per row and version: ok, Megatron's refusal, or why the layout is not exported (a choice the arguments cannot carry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_published import _published, options  # noqa: E402
from pipeloom.plan.cluster.api import plan_cluster  # noqa: E402
from pipeloom.plan.errors import NoLayoutFits  # noqa: E402
from pipeloom.plan.export.megatron import megatron_args, megatron_problems, unwritten  # noqa: E402
from published_runs import load_runs, run_config, run_hardware  # noqa: E402

_WORKER = r'''
import contextlib, io, json, os, sys
import torch
from packaging.version import Version
import megatron.core.utils as utils
from megatron.training import arguments
utils._te_version = Version("2.9.0")  # the checks that ask for Transformer Engine see a recent one
cases = json.load(open(sys.argv[1]))
out = []
for case in cases:
    os.environ.update(WORLD_SIZE=str(case["world"]), RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    arguments.get_device_arch_version = lambda: case["arch"]
    torch.cuda.get_device_capability = lambda *device: (case["arch"], 0)
    sys.argv = ["pretrain_gpt.py", *case["args"]]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            args = arguments.validate_args(arguments.parse_args(), {})
            arguments.core_transformer_config_from_args(args)
        out.append({"ok": True, "dp": args.data_parallel_size})
    except BaseException as error:  # argparse exits (its message on stderr); Megatron asserts
        lines = [line for line in said.getvalue().splitlines() if "error:" in line]
        text = lines[-1] if isinstance(error, SystemExit) and lines else str(error) or type(error).__name__
        out.append({"ok": False, "error": text.splitlines()[0][:300]})
print("RESULTS" + json.dumps(out))
'''


def model_args(config: dict, spec, seq: int) -> list[str]:
    """Megatron-LM's model arguments for ``spec`` (what its checks need: shapes, heads, experts, MTP; the head's tie
    is the export's own)."""
    att = spec.attention
    args = ["--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden), "--num-attention-heads",
            str(att.heads), "--ffn-hidden-size", str(spec.intermediate), "--max-position-embeddings", str(seq),
            "--vocab-size", str(spec.vocab), "--tokenizer-type", "NullTokenizer", "--kv-channels", str(att.v_dim),
            "--position-embedding-type", "learned_absolute" if spec.positions else "rope"]
    args += [] if spec.positions else ["--no-rope-fusion"]  # its fused kernel needs Transformer Engine installed
    if att.kv_heads != att.heads and not att.latent:
        args += ["--group-query-attention", "--num-query-groups", str(att.kv_heads)]
    if att.latent:
        args += ["--multi-latent-attention", "--kv-lora-rank", str(att.kv_rank), "--qk-head-dim",
                 str(att.qk_dim - att.rope_dim), "--qk-pos-emb-head-dim", str(att.rope_dim), "--v-head-dim",
                 str(att.v_dim)] + (["--q-lora-rank", str(att.q_rank)] if att.q_rank else [])
    if spec.gated:
        args.append("--swiglu")
    ex = spec.experts
    if ex is not None:
        args += ["--num-experts", str(ex.count), "--moe-router-topk", str(ex.top_k), "--moe-ffn-hidden-size",
                 str(ex.intermediate)] + (["--moe-router-pre-softmax"] if ex.top_k == 1 else [])
        if spec.moe_layers and len(spec.moe_layers) != spec.layers:
            pattern = [1 if k in spec.moe_layers else 0 for k in range(spec.layers)]
            args += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
    if spec.mtp:
        args += ["--mtp-num-layers", str(spec.mtp)]
    return args


def cases(rows: list[dict], search: bool) -> list[dict]:
    """Each row's exported arguments (or why it is not exported)."""
    found = []
    for run in rows:
        plans = []
        try:
            plans.append(("published", _published(run, None)))
        except NoLayoutFits as refusal:
            found.append({"id": run["id"], "which": "published", "skip": f"does not fit: {refusal}"})
        if search:
            opts = {k: v for k, v in options(run).items() if not unwritten({k: v})}
            try:
                plans.append(("searched", plan_cluster(run_config(run), run_hardware(run), gpus=run["gpus"],
                                                       global_batch=run["global_batch"], seq=run["seq"],
                                                       dtype=run["dtype"], runs_on="megatron", **opts)))
            except Exception as error:  # a job Megatron-LM cannot run at all
                found.append({"id": run["id"], "which": "searched", "skip": str(error).splitlines()[0]})
        for which, result in plans:
            job, best = result.job, result.best
            why = unwritten({name: getattr(job, name) for name in job.__dataclass_fields__})
            why += [text for text, _ in megatron_problems(job, best.layout)]
            entry = {"id": run["id"], "which": which, "layout": str(best.layout)}
            if why:
                found.append({**entry, "skip": "; ".join(why)})
                continue
            args = [*model_args(run_config(run), job.spec, job.seq), *megatron_args(job, best.layout,
                                                                                     best.stage_layers)]
            arch = 10 if job.hw.name in ("b200", "gb200", "gb300") else 9
            found.append({**entry, "world": job.gpus, "arch": arch, "args": args, "dp": best.layout.dp})
    return found


def validate(source: Path, checked: list[dict]) -> list[dict]:
    """Megatron-LM's verdict on each case with arguments, run in ``source``."""
    with tempfile.TemporaryDirectory() as folder:
        stub = Path(folder, "stub")
        stub.mkdir()
        (stub / "six.py").write_text("")  # core 0.15's BERT tokenizer imports six at import time; nothing uses it
        Path(folder, "worker.py").write_text(_WORKER)
        Path(folder, "cases.json").write_text(json.dumps(checked))
        env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{stub}"}
        done = subprocess.run([sys.executable, str(Path(folder, "worker.py")), str(Path(folder, "cases.json"))],
                              cwd=source, env=env, capture_output=True, text=True, timeout=1800)
    line = next((text for text in done.stdout.splitlines() if text.startswith("RESULTS")), None)
    if line is None:
        raise SystemExit(f"{source}: the worker failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULTS"):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-src", nargs="+", type=Path, required=True, metavar="DIR")
    parser.add_argument("--search", action="store_true", help="also export the planner's choice for Megatron-LM")
    parser.add_argument("--only", default="", help="rows whose id holds this text")
    args = parser.parse_args(argv)
    rows = [run for run in load_runs() if args.only in run["id"]]
    found = cases(rows, args.search)
    checked = [case for case in found if "args" in case]
    verdicts = {str(source): validate(source, checked) for source in args.megatron_src}
    passed = {source: 0 for source in verdicts}
    for case in found:
        head = f"{case['id']} [{case['which']}] {case.get('layout', '')}"
        if "skip" in case:
            print(f"{head}: not exported: {case['skip']}")
            continue
        k = checked.index(case)
        for source, results in verdicts.items():
            result = results[k]
            if result["ok"] and result["dp"] != case["dp"]:
                result = {"ok": False, "error": f"Megatron's dp {result['dp']} is not the plan's {case['dp']}"}
            passed[source] += result["ok"]
            print(f"{head} @ {Path(source).name}: {'ok' if result['ok'] else 'REFUSED: ' + result['error']}")
    for source, count in passed.items():
        print(f"{Path(source).name}: {count} of {len(checked)} exported layouts accepted "
              f"({len(found) - len(checked)} not exported)")
    print("arguments of the first case:", " ".join(checked[0]["args"]) if checked else "-")


if __name__ == "__main__":
    main()
