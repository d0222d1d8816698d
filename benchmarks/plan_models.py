"""Prediction vs reality on held-out models: HF GPT-2 (tied head), HF LLaMA and a U-Net with long skips.

For each model, on two spawned gloo ranks of this CPU (``gpt_reality.py``, the machinery of
``plan_gpt.py --part reality``): profile it inside the engine at every micro-batch size, plan it for
the 2 ranks, run the best plan of each schedule with ``pipeloom.pipeline(model, plan=...)`` and,
right after the chosen plan in each round, the chosen plan with the layers cut evenly (the uniform
split: same schedule and micro-batches). Printed per model: predicted against measured step times of
every plan side by side, then the two targets, MET or NOT MET:

- the chosen plan's measured / predicted step time within 15 % in every round;
- the chosen plan never slower than the uniform split (its median step time, every round).

    python benchmarks/plan_models.py                      # all three, 3 rounds (best on a quiet machine)
    python benchmarks/plan_models.py --models unet --rounds 1 --steps 2 --batch 4   # a smoke run
    python benchmarks/plan_models.py --try 3              # and a third target: the plan chosen by measurement

With ``--try K`` the plan ``pipeloom.profile.trials.try_plans`` chooses among the K best predicted plans (its
own interleaved rounds and elimination, the library's default budget unless ``--try-steps``/``--try-seconds``)
runs with the others, and a third target is judged: its median step time within 5 % of the fastest measured
plan's, among every plan run. The reference is measured apart from the trials, after the rounds: ``--judge-rounds``
rounds in which every plan's engine runs one untimed and ``--judge-steps`` timed steps, the plans in an order
rotated by one per round, so the machine's drift hits them alike; a plan's time is then paired by round (its
round median over the round's median over the plans, the median over the rounds), the pooled median printed
beside it (``--judge-rounds 0``: the pooled median of the rounds' steps).

The models are tiny random-init configs (no downloads), 32 tokens or positions per sample:
``transformers``' GPT2LMHeadModel and LlamaForCausalLM as ``examples/train_hf.py`` builds them (vocabulary
256, dropout off, cut by the torch.export tracer at their blocks), and :class:`SkipNet`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpt_reality import RealityConfig, Workload, run_reality, wait_until_quiet
from pipeloom.cli.plan_try import trial_lines
from pipeloom.plan.race import TrialBudget
from plan_gpt import TARGET, print_reality

__all__ = ["SkipNet", "hf_workload", "main", "targets", "unet_workload"]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SEQ = 32  # tokens (positions) per sample
VOCAB = 256
FEATURES = 16  # SkipNet's input and output features per position
HF_BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def _train_hf():
    """examples/train_hf.py as a module (``build_model``, ``synthetic_batch``, ``lm_loss``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_hf

    return train_hf


def _hf_model(name: str, layers: int, width: int) -> nn.Module:
    return _train_hf().build_model(name, layers=layers, width=width, vocab=VOCAB, dropout=0.0, seed=0)


def _hf_batch(name: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _train_hf().synthetic_batch(name, step, batch=rows, seq_len=SEQ, vocab=VOCAB)


def _hf_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    return _train_hf().lm_loss(output, target)


def hf_workload(name: str, *, layers: int, width: int) -> Workload:
    """``transformers``' ``name`` (gpt2: tied head and embedding; llama: not tied) from a tiny config,
    cut by torch.export at its blocks."""
    return Workload(name=f"HF {name} ({layers} blocks, width {width}, vocabulary {VOCAB}, {SEQ} tokens)",
                    build=functools.partial(_hf_model, name, layers, width),
                    batch=functools.partial(_hf_batch, name), loss=_hf_loss, layers=(HF_BLOCKS[name],),
                    sample_bytes=4 * SEQ * width, tracer="export")


class _Block(nn.Module):
    """``x + W2 gelu(W1 norm(x))``: (..., width) -> (..., width)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class SkipNet(nn.Module):
    """A U-Net of MLP blocks on (batch, seq, FEATURES) inputs: ``depth`` down blocks, a middle block,
    ``depth`` up blocks; up block k takes the sum of the previous output and down block ``depth-1-k``'s
    output (long skips: the first stage's activations are used by the last)."""

    def __init__(self, *, depth: int = 4, width: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.down = nn.ModuleList(_Block(width) for _ in range(depth))
        self.mid = _Block(width)
        self.up = nn.ModuleList(_Block(width) for _ in range(depth))
        self.out = nn.Linear(width, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skips = []
        for block in self.down:
            h = block(h)
            skips.append(h)
        h = self.mid(h)
        for block in self.up:
            h = block(h + skips.pop())
        return self.out(h)


def _unet_model(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return SkipNet(depth=depth, width=width)


def _unet_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(rows, SEQ, FEATURES, generator=generator)
    return inputs, torch.tanh(inputs.flip(1))  # a target the model can learn: the sequence reversed


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def unet_workload(*, depth: int, width: int) -> Workload:
    """:class:`SkipNet` (torch.fx); its layers for the uniform split: ``down.k``, ``mid``, ``up.k``."""
    return Workload(name=f"U-Net of MLP blocks (2 x {depth} + 1 blocks, width {width}, {SEQ} positions)",
                    build=functools.partial(_unet_model, depth, width), batch=_unet_batch, loss=_mse,
                    layers=("down", "mid", "up"), sample_bytes=4 * SEQ * width)


def targets(results: dict) -> list[tuple[str, bool | None, str]]:
    """The two targets of one run: ``(what, met, detail)``; ``met`` None where it could not be judged."""
    chosen = results["plans"][0]
    what = f"chosen plan measured / predicted within {TARGET - 1:.0%} in every round"
    if "error" in chosen:
        return [(what, False, f"the runtime refused the chosen plan: {chosen['error']}")]
    ratios = [statistics.median(e["times"]) / e["predicted"] for e in chosen["rounds"]]
    rows = [(what, all(1 / TARGET <= r <= TARGET for r in ratios), " ".join(f"{r:.2f}" for r in ratios))]
    uniform = results.get("uniform")
    what = "chosen plan never slower than the uniform split"
    if uniform is not None and "error" in uniform:
        rows.append((what, None, f"the runtime refused the uniform split: {uniform['error']}"))
    elif uniform is None:
        rows.append((what, None, "the model has fewer layers than the plan has stages"))
    elif uniform["same"]:
        rows.append((what, True, f"the uniform split is the chosen one ({', '.join(uniform['split_points'])})"))
    else:
        pairs = [(statistics.median(a["times"]), statistics.median(b["times"]))
                 for a, b in zip(chosen["rounds"], uniform["rounds"])]
        rows.append((what, all(c <= u for c, u in pairs),
                     "chosen / uniform measured " + " ".join(f"{c / u:.2f}" for c, u in pairs)
                     + f"; predicted {chosen['predicted'] * 1e3:.1f} vs {uniform['predicted'] * 1e3:.1f} ms"))
    tried = next((record for record in results["plans"] if record.get("tried_choice")), None)
    if tried is not None:
        rows.append(tried_target(results["plans"], tried))
    return rows


TRY_TARGET = 1.05
"""With ``--try``: the plan chosen by measurement within 5 % of the fastest measured plan."""


def tried_target(plans: list[dict], tried: dict) -> tuple[str, bool | None, str]:
    """The ``--try`` target: the tried choice's time against the fastest plan's. With judging rounds
    (``record["judged"]``: every plan, interleaved, measured apart from the trials) a plan's time is paired by
    round: the median over the rounds of its round median over that round's median of every plan's round
    median, so a round the machine's load slowed slows every plan in it alike; the pooled median of every judged
    step is printed beside it. Without: the pooled median of every round's timed steps."""
    what = f"plan chosen by --try within {TRY_TARGET - 1:.0%} of the fastest measured"
    if "error" in tried:
        return (what, False, f"the runtime refused it: {tried['error']}")
    ran = [record for record in plans if "error" not in record and record.get("rounds")]
    if len(ran) < 2:  # nothing to compare with: the target would pass whatever was chosen
        return (what, None, f"only {len(ran)} plan ran; give --max-plans 2 or more")
    pooled = {record["label"]: statistics.median(_judged_steps(record)) for record in ran}
    paired = all(record.get("judged") for record in ran)
    score = _paired_by_round(ran) if paired else pooled
    fastest = min(score, key=score.__getitem__)
    ratio = score[tried["label"]] / score[fastest]
    among = "one of the plans tried" if any(_same(trial, fastest, plans) for trial in tried["trials"]) \
        else "not one of the plans tried"
    detail = (f"{tried['label']} {ratio:.3f} x the fastest ({fastest}; {among}) over {len(ran)} plans, "
              + _reference(tried))
    if paired:
        quickest = min(pooled, key=pooled.__getitem__)
        detail += (f"; pooled medians {pooled[tried['label']] * 1e3:.1f} ms vs {quickest} "
                   f"{pooled[quickest] * 1e3:.1f} ms ({pooled[tried['label']] / pooled[quickest]:.3f} x)")
    return (what, ratio <= TRY_TARGET, detail)


def _paired_by_round(ran: list[dict]) -> dict[str, float]:
    """Each plan's median over the judging rounds of (its round median / the round's median over the plans)."""
    rounds = min(len(record["judged"]) for record in ran)
    relative: dict[str, list[float]] = {record["label"]: [] for record in ran}
    for k in range(rounds):
        medians = {record["label"]: statistics.median(record["judged"][k]) for record in ran}
        middle = statistics.median(medians.values())
        for label, value in medians.items():
            relative[label].append(value / middle)
    return {label: statistics.median(values) for label, values in relative.items()}


def _reference(record: dict) -> str:
    if record.get("judged"):
        return f"paired by round over {len(record['judged'])} judging rounds of {len(record['judged'][0])} steps"
    return "pooled median of the rounds' steps"


def _judged_steps(record: dict) -> list[float]:
    if record.get("judged"):
        return [t for times in record["judged"] for t in times]
    return [t for e in record["rounds"] for t in e["times"]]


def _same(trial: dict, label: str, plans: list[dict]) -> bool:
    """Whether the trial record is the plan run under ``label`` (same schedule, micro-batches and split)."""
    record = next(record for record in plans if record["label"] == label)
    return (trial["schedule"], trial["microbatches"], list(trial["split_points"])) == \
        (record["schedule"], record["microbatches"], list(record["split_points"]))


def _mark(met: bool | None) -> str:
    return "MET" if met else ("NOT MET" if met is not None else "n/a")


def _workloads(args: argparse.Namespace) -> dict[str, Workload]:
    every = {"gpt2": lambda: hf_workload("gpt2", layers=args.layers, width=args.width),
             "llama": lambda: hf_workload("llama", layers=args.layers, width=args.width),
             "unet": lambda: unet_workload(depth=args.depth, width=args.unet_width)}
    names = args.models.split(",")
    unknown = [name for name in names if name not in every]
    if unknown:
        raise SystemExit(f"plan_models: unknown --models {', '.join(unknown)}; choose from {', '.join(every)}")
    return {name: every[name]() for name in names}


def _judge_again(folder: Path, names: list[str]) -> int:
    """The targets of an earlier run's saved results (the judging rule as it is now)."""
    for name in names:
        path = folder / name / "results.json"
        if not path.exists():
            print(f"{name:6} no results ({path})")
            continue
        rows = targets(json.loads(path.read_text()))
        print(f"{name:6} " + "; ".join(f"{_mark(met)} {what}: {detail}" for what, met, detail in rows))
    return 0


def _budget(args: argparse.Namespace) -> TrialBudget:
    default = TrialBudget()
    return TrialBudget(steps=args.try_steps or default.steps,
                       seconds=default.seconds if args.try_seconds is None else args.try_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,unet", help="comma-separated: gpt2, llama, unet")
    parser.add_argument("--layers", type=int, default=8, help="blocks of GPT-2 and LLaMA")
    parser.add_argument("--width", type=int, default=64, help="hidden size of GPT-2 and LLaMA")
    parser.add_argument("--depth", type=int, default=4, help="down (and up) blocks of the U-Net")
    parser.add_argument("--unet-width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="samples per step (the plan's global batch)")
    parser.add_argument("--schedules", help="schedules the plan search tries, comma-separated (default: all)")
    parser.add_argument("--max-plans", type=int, default=10, help="plans run: the best of each schedule, best first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all plans")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan and round")
    parser.add_argument("--retries", type=int, default=5,
                        help="extra attempts of a measurement while other processes load the machine")
    parser.add_argument("--try", dest="try_k", type=int, default=0, metavar="K",
                        help="also choose a plan by measurement among the K best predicted (try_plans) and judge it")
    parser.add_argument("--try-steps", type=int, help="with --try: the most timed steps per plan tried "
                                                      f"(default {TrialBudget().steps})")
    parser.add_argument("--try-seconds", type=float, help="with --try: seconds of trial steps after which no round "
                                                          f"starts (default {TrialBudget().seconds:g})")
    parser.add_argument("--judge-rounds", type=int, default=15, metavar="R",
                        help="with --try: rounds that time every plan again, interleaved, as the reference of the "
                             "--try target (default 15; 0: judge on the rounds' steps)")
    parser.add_argument("--judge-steps", type=int, default=3, metavar="N",
                        help="timed steps of each plan in each judging round (default 3)")
    parser.add_argument("--wait-quiet", type=float, default=120.0, metavar="S",
                        help="before each model, wait up to S seconds for the machine to go quiet (default 120)")
    parser.add_argument("--out", metavar="DIR", help="folder for each model's costs, plans, traces (default: temp)")
    parser.add_argument("--judge-only", metavar="DIR",
                        help="run nothing: judge the targets again from DIR/<model>/results.json of an earlier run")
    args = parser.parse_args(argv)
    if args.judge_only:
        return _judge_again(Path(args.judge_only), args.models.split(","))
    out = Path(args.out or tempfile.mkdtemp(prefix="plan_models_"))
    summary = []
    for name, workload in _workloads(args).items():
        idle = wait_until_quiet(limit=args.wait_quiet)
        config = RealityConfig(out=str(out / name), workload=workload, uniform=True, global_batch=args.batch,
                               rounds=args.rounds, steps=args.steps, max_plans=args.max_plans,
                               cycles=min(5, args.steps), retries=args.retries, try_plans=args.try_k,
                               try_budget=_budget(args), judge_rounds=args.judge_rounds if args.try_k else 0,
                               judge_steps=args.judge_steps,
                               schedules=tuple(args.schedules.split(",")) if args.schedules else None)
        started = time.perf_counter()
        try:
            results = run_reality(config)
        except Exception as error:  # a failed model is reported; the others still run
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            print(f"{workload.name}: {error}", file=sys.stderr, flush=True)  # a rank's traceback, for the log
            print(f"\n{workload.name}: FAILED: {reason}", flush=True)
            summary.append((name, [("run", False, reason)]))
            continue
        print_reality(results, config, idle)
        rows = targets(results)
        print(f"targets ({time.perf_counter() - started:.0f} s):")
        for what, met, detail in rows:
            print(f"  {_mark(met):7} {what}: {detail}")
        tried = next((record for record in results["plans"] if record.get("tried_choice")), None)
        if tried is not None:
            print("the trials of --try (their own steps, not the rounds above):")
            for line in trial_lines(types.SimpleNamespace(trials=tried["trials"])):
                print(f"  {line}")
        summary.append((name, rows))
    print(f"\nsummary ({args.rounds} rounds, {args.steps} timed steps per plan and round; files in {out})")
    for name, rows in summary:
        print(f"{name:6} " + "; ".join(f"{_mark(met)} {what}" for what, met, _ in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
