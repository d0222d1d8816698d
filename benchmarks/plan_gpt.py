"""Plan a 48-layer GPT for 8 ranks, then check predictions against the example GPT on 2 gloo ranks.

The planning half: how long the whole plan search takes, and how the chosen plan compares with the
runners-up and with an even split of the layers. The reality half: predicted against measured step
times of examples/train_gpt.py on 2 gloo ranks on this CPU.

Run ``python benchmarks/plan_gpt.py`` (``--help`` for sizes; ``--part planning`` or ``--part reality``
runs one half). The planning half's cost table is analytical (``analytical_gpt_costs``: a 48-layer,
4096-wide GPT with 2048-token sequences in bf16 on an H100-like device, 400 TFLOP/s achieved, 2 TB/s,
NVLink-like link of 10 µs and 150 GB/s), planned for 8 ranks of 80 GiB with a global batch of 512
sequences. Target: the search in <= 30 s.

Tables printed: the search time (best of ``--repeats``); the best plan of each schedule, as a ratio
of its predicted step time to the best plan's; and the chosen schedule and micro-batch count with
the partitioner's split versus the even split the example script uses (``blocks.{s*L/S}``).

The reality half (``gpt_reality.py``, which imports torch) profiles ``examples/train_gpt.py`` on two
spawned gloo ranks, plans it for them with a measured gloo link, runs the best plan of each schedule
with ``pipeloom.pipeline(model, plan=...)`` and prints predicted and measured step times side by side
(target: within 15 %), with the per-task profile against a traced run of the chosen plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from pipeloom.formatting import format_bytes
from pipeloom.plan import Link, analytical_gpt_costs, parse_bytes, plan_pipeline
from pipeloom.plan.partitioning.rules import Partition
from pipeloom.plan.partitioning.shape import library_schedule
from pipeloom.plan.recost import recost
from pipeloom.sim import simulate
from pipeloom.trace.analysis import task_durations

__all__ = ["gpt_table", "main", "planning_benchmark", "prediction_vs_reality", "print_reality", "short_split"]


def gpt_table(layers: int):
    """The benchmark's cost table: per micro-batch of one 2048-token sequence."""
    return analytical_gpt_costs(layers=layers, hidden=4096, heads=32, seq=2048, vocab=50304, microbatch_size=1,
                                flops_per_second=400e12, bytes_per_second=2e12,
                                link=Link(latency=10e-6, bandwidth=150e9))


def even_split(table, result) -> tuple[float, float] | None:
    """``(step time, peak bytes)`` of the best plan's schedule and micro-batch count with the blocks
    cut evenly (embedding in the first stage, final norm and head in the last), or None if the
    plan has more stages than blocks."""
    plan = result.plan
    blocks = [k for k, name in enumerate(table.names) if name.startswith("blocks.")]
    stages = plan.num_stages
    if stages > len(blocks):
        return None
    starts = [0] + [blocks[(s * len(blocks)) // stages] for s in range(1, stages)]
    bounds = [*starts, len(table.pieces)]
    stage_of = tuple(j for j in range(stages) for _ in range(bounds[j], bounds[j + 1]))
    split = Partition(stage_of=stage_of, split_points=tuple(table.names[a] for a in starts[1:]),
                      stage_times=(0.0,) * stages, stage_memory=(0.0,) * stages, objective=0.0, weight=0.0)
    scaled = table.scaled(plan.microbatch_size)
    schedule = library_schedule(scaled, plan.schedule, plan.num_ranks, plan.microbatches,
                                memory_limit=plan.memory_limit, **plan.schedule_options)
    timeline = simulate(dataclasses.replace(schedule, problem=recost(schedule, scaled, split,
                                                                     memory_limit=plan.memory_limit)))
    return timeline.makespan, max(timeline.peak_memory)


TARGET = 1.15
"""Prediction vs reality: the measured step within 15 % of the predicted one (0.85 to 1.15 times it)."""


def prediction_vs_reality(args: argparse.Namespace) -> None:
    """Profile examples/train_gpt.py on this CPU, plan it for 2 gloo ranks, run the plans with the engine
    (``plan=plan.json``), and print the predicted and measured step times side by side."""
    from gpt_reality import RealityConfig, gpt_workload, run_reality, wait_until_quiet  # imports torch

    idle = wait_until_quiet()
    config = RealityConfig(out=args.reality_out or tempfile.mkdtemp(prefix="plan_gpt_reality_"),
                           workload=gpt_workload(args.gpt_layers), global_batch=args.gpt_batch, rounds=args.rounds,
                           steps=args.steps, repeats=args.profile_repeats, max_plans=args.max_plans,
                           profiler=args.profiler,
                           schedules=tuple(args.schedules.split(",")) if args.schedules else None)
    results = run_reality(config)
    print_reality(results, config, idle)
    plans = [record for record in results["plans"] if "rounds" in record]  # not those the runtime refused
    if plans and plans[0] is results["plans"][0]:
        _print_tasks(plans[0], config)
    split = next((r for r in plans[1:] if r["schedule"] == "zb-h1"), None)  # a split-backward plan too
    if split is not None:
        _print_tasks(split, config)


def print_reality(results: dict, config, idle: float) -> None:
    """The measuring setup (link, engine costs, profile, load) and the plans' predicted vs measured table
    of one :func:`gpt_reality.run_reality` document."""
    link, times = results["link"], results["link_times"]
    small, large = sorted(times, key=int)
    bandwidth = f"{link['bandwidth'] / 1e9:.2f} GB/s" if link["bandwidth"] else "unlimited"
    profile, plans = results["profile"], results["plans"]
    rounds = [entry for record in plans for entry in record.get("rounds", [])]
    print(f"\nprediction vs reality: {config.workload.name}, 2 gloo ranks on CPU "
          f"(1 thread each), global batch {config.global_batch}; files in {config.out}")
    print(f"link (gloo ping-pong, one way): {format_bytes(int(small))} {times[small] * 1e3:.3f} ms, "
          f"{format_bytes(int(large))} {times[large] * 1e3:.3f} ms -> latency {link['latency'] * 1e3:.3f} ms, "
          f"{bandwidth}")
    note = results["overhead"]
    if config.profiler == "engine":
        fits = ", ".join(f"b={f['size']} {f['latency'] * 1e3:.2f}/{f['step_overhead'] * 1e3:.2f}"
                         + ("" if f.get("replica_latency") is None else f"/{f['replica_latency'] * 1e3:.2f}")
                         + f" spread {f.get('time_spread', 0):.2f} skew {f.get('start_skew', 0) * 1e3:.2f} ms"
                         + f" action {f.get('action_cost', 0) * 1e6:.0f} us"
                         + f" message {f.get('message_cost', 0) * 1e6:.0f} us"
                         for f in profile["fits"])
        print(f"engine cost per action of a 4x4-linear pipeline that sends at every action (for reference): "
              f"{note['inside'] * 1e6:.0f} us and {note.get('message', 0) * 1e6:.0f} us per message; "
              f"latency under load / per-step cost / replica-exchange latency (ms), "
              f"time spread, start skew, cost per action and per message fitted at each size: {fits}; "
              f"medians used in every "
              f"prediction: {profile['latency'] * 1e3:.2f} ms latency, "
              f"{profile['step_overhead'] * 1e3:.2f} ms per step")
    else:
        runs = ", ".join(f"M={m} {r['measured'] * 1e3:.2f} ms measured vs {r['simulated'] * 1e3:.2f} simulated"
                         for m, r in note["runs"].items())
        print(f"engine overhead (trivial 1F1B pipeline: {runs}): {note['overhead'] * 1e6:.0f} us per action, "
              f"{note['fixed'] * 1e3:.2f} ms fixed per step (both in every prediction)")
    how = (f"traced inside the engine ({config.profile_steps} steps of each profiling run)"
           if config.profiler == "engine" else f"each piece alone, {config.repeats} repeats, both ranks at once")
    print(f"profile for the plan search: sizes {', '.join(map(str, config.sizes))}, {how}, "
          f"{profile['seconds']:.1f} s; plan search {profile['plan_seconds']:.2f} s")
    foreign = [n["foreign"] for n in profile["sizes"]] + [e["profile_foreign"] for e in rounds]
    ran = [e["foreign"] for e in rounds] or [0.0]
    again = sum(n["attempts"] - 1 for n in profile["sizes"]) + sum(e["profile_attempts"] - 1 for e in rounds)
    print(f"machine idle {idle:.0%} at the start; other processes used at most {max(foreign):.2f} cores while "
          f"profiling ({again} profiles measured again) and {max(ran):.2f} while a plan "
          f"ran ({sum(e['attempts'] - 1 for e in rounds)} measured again; limit {config.max_foreign} cores)")
    _print_plans(results, config)


def short_split(split_points: list[str]) -> str:
    """``blocks.2, blocks.4`` -> ``blocks 2,4`` (any one prefix of numbered modules); else comma-separated."""
    heads = {name.rpartition(".")[0] for name in split_points}
    if len(heads) == 1 and all(name.rpartition(".")[2].isdigit() for name in split_points) and "" not in heads:
        return f"{heads.pop()} " + ",".join(name.rpartition(".")[2] for name in split_points)
    return ",".join(split_points)


def _timed_steps(record: dict) -> list[int]:
    """The plan's timed steps over all rounds (the engine traced every step it ran)."""
    return [step for entry in record["rounds"] for step in entry["traced_steps"]]


def _traced(record: dict):
    """A plan's trace and its :class:`~pipeloom.trace.analysis.Comparison` over the timed steps."""
    from pipeloom.trace.analysis import compare_run
    from pipeloom.trace.reader import load_run_trace

    run = load_run_trace(record["trace"])
    return run, compare_run(run, steps=_timed_steps(record))


def _print_plans(results: dict, config) -> None:
    if config.profiler == "engine":
        how = (f"{config.cycles} times one profiling step of its micro-batch size then {config.steps // config.cycles} "
               f"timed steps of the plan (after {config.warmup_steps} warm-up steps); "
               "predict from those profiling steps")
    else:
        how = (f"profile its micro-batch size, re-predict, then {config.warmup_steps} + {config.steps} steps")
    print(f"\n{config.rounds} rounds; in each, for each plan: {how}. measured: median of the timed steps. "
          f"Target: measured / predicted within {TARGET - 1:.0%}. Times in ms.")
    uniform = results.get("uniform")
    rows = results["plans"] + ([uniform] if uniform is not None and not uniform["same"] else [])
    width = max(12, *(len(short_split(record["split_points"])) for record in rows))
    wide = max(22, *(len(record["label"]) + 6 for record in rows))
    print(f"{'schedule':{wide}} {'M x b':>6} {'split':{width}} {'planned':>7} {'predicted':>9} {'measured':>8} "
          f"{'ratio':>5} {'':3} {'ratio per round':16} {'tasks':>6} {'span':>6}")
    for k, record in enumerate(rows):
        label = record["label"] + (" own" if record["own_order"] and record is not uniform else "") + (
            " *" if k == 0 else "")
        shape = f"{record['microbatches']} x {record['microbatch_size']}"
        if "error" in record:
            print(f"{label:{wide}} {shape:>6} {short_split(record['split_points']):{width}} "
                  f"{record['predicted'] * 1e3:7.1f} refused by the runtime: {record['error']}")
            continue
        predicted = [entry["predicted"] for entry in record["rounds"]]
        measured = [statistics.median(entry["times"]) for entry in record["rounds"]]
        ratios = [m / p for m, p in zip(measured, predicted)]
        ratio = statistics.median(ratios)
        _, comparison = _traced(record)
        mark = "ok" if 1 / TARGET <= ratio <= TARGET else "--"
        print(f"{label:{wide}} {shape:>6} {short_split(record['split_points']):{width}} "
              f"{record['predicted'] * 1e3:7.1f} {statistics.median(predicted) * 1e3:9.1f} "
              f"{statistics.median(measured) * 1e3:8.1f} {ratio:5.2f} "
              f"{mark:3} {' '.join(f'{r:.2f}' for r in ratios):16} {comparison.predicted.makespan * 1e3:6.1f} "
              f"{comparison.measured_step_time * 1e3:6.1f}")
    print("* the plan the search chose. planned: the plan file's prediction (the search's profile). predicted, "
          "measured: medians over the rounds; ratio: median of the rounds' measured / predicted. own: the plan "
          "names the order the search simulated, saved as a schedule file, as the engine builds this name in "
          "another order. uniform: the chosen plan with the layers cut evenly. tasks: the simulator on the "
          "timed steps' own median task times (traced); span: their schedule span (pipeloom.viz.measured); "
          "measured - span is the step's time outside the schedule.")


def _print_tasks(record: dict, config) -> None:
    """Per task of a plan: its last round's profile against the traced run (run right after)."""
    from pipeloom.plan.partitioning.shape import schedule_shape

    run, comparison = _traced(record)
    costs = record["rounds"][-1]["stage_costs"]
    shape = schedule_shape(run.schedule)
    measured = task_durations(run, steps=_timed_steps(record))
    print(f"\n{record['label']}: per task, its last profile vs the traced run "
          "(median over micro-batches and steps), ms")
    print(f"{'stage':>5} {'rank':>4} {'model stage':>11} {'kind':>4} {'profiled':>9} {'measured':>9} {'ratio':>6}")
    for (stage, kind), seconds in sorted(measured.items()):
        part = costs[shape.model_stage[stage]]
        profiled = part.get("B", part["I"] + part["W"]) if kind == "B" else part[kind]
        print(f"{stage:5} {shape.rank[stage]:4} {shape.model_stage[stage]:11} {kind:>4} {profiled * 1e3:9.2f} "
              f"{seconds * 1e3:9.2f} {seconds / profiled if profiled else float('nan'):6.2f}")
    print(f"traced step span {comparison.measured_step_time * 1e3:.1f} ms; simulated from these task times "
          f"{comparison.predicted.makespan * 1e3:.1f} ms (ratio {comparison.ratio:.2f})")

def planning_benchmark(args: argparse.Namespace) -> None:
    """The 48-layer analytical GPT planned for 8 ranks: search time, runners-up, even split."""
    table = gpt_table(args.layers)
    limit = parse_bytes(args.memory_limit)
    seconds, result = [], None
    for _ in range(args.repeats):
        started = time.perf_counter()
        result = plan_pipeline(table, num_ranks=args.ranks, global_batch=args.global_batch, memory_limit=limit)
        seconds.append(time.perf_counter() - started)
    plan = result.plan
    fitting = [c for c in result.candidates if c.fits]
    print(f"GPT {args.layers} layers ({len(table.pieces)} pieces), {args.ranks} ranks, "
          f"{format_bytes(limit)} per rank, global batch {args.global_batch}")
    print(f"plan search: {min(seconds):.2f} s (best of {args.repeats}; target <= 30 s), "
          f"{len(result.candidates)} candidates, {len(fitting)} fit")
    print(f"best: {plan.schedule} {plan.schedule_options or ''} M={plan.microbatches} x {plan.microbatch_size}, "
          f"predicted {plan.predicted_step_time:.3f} s, bubble {plan.bubble_ratio:.1%}, "
          f"peak {format_bytes(max(plan.peak_memory))}")
    print(f"split points: {', '.join(plan.split_points)}")
    print(f"\n{'schedule':24} {'M x size':>10} {'step s':>9} {'vs best':>8} {'bubble':>7} {'peak':>10}")
    seen = set()
    for c in fitting:
        if c.label in seen:
            continue
        seen.add(c.label)
        print(f"{c.label:24} {f'{c.microbatches} x {c.microbatch_size}':>10} {c.step_time:9.3f} "
              f"{c.step_time / plan.predicted_step_time:8.3f} {c.bubble_ratio:7.1%} {format_bytes(c.peak_memory):>10}")
    for c in result.candidates:
        if not c.fits and c.label not in seen:
            seen.add(c.label)
            print(f"{c.label:24} {'-':>10} {'-':>9} {'-':>8} {'-':>7} {'-':>10}  {c.reason[:60]}")
    even = even_split(table, result)
    if even is not None:
        step, peak = even
        fits = "fits" if peak <= limit else f"over the limit ({format_bytes(peak)})"
        print(f"\n{plan.schedule} M={plan.microbatches}: partitioner {plan.predicted_step_time:.3f} s vs even split "
              f"{step:.3f} s (ratio {step / plan.predicted_step_time:.3f}, even split {fits})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("planning", "reality", "both"), default="both",
                        help="planning: the 48-layer search; reality: prediction vs reality on 2 gloo ranks")
    planning = parser.add_argument_group("planning (analytical 48-layer GPT)")
    planning.add_argument("--layers", type=int, default=48)
    planning.add_argument("--ranks", type=int, default=8)
    planning.add_argument("--memory-limit", default="80GiB")
    planning.add_argument("--global-batch", type=int, default=512)
    planning.add_argument("--repeats", type=int, default=3, help="timed runs of the search (best is shown)")
    reality = parser.add_argument_group("reality (examples/train_gpt.py on 2 gloo ranks)")
    reality.add_argument("--gpt-layers", type=int, default=8, help="blocks of the example GPT")
    reality.add_argument("--gpt-batch", type=int, default=16, help="sequences per step")
    reality.add_argument("--schedules", help="schedules the plan search tries, comma-separated (default: all)")
    reality.add_argument("--max-plans", type=int, default=10, help="plans run: the best of each schedule, best first")
    reality.add_argument("--profiler", choices=("engine", "alone"), default="engine",
                         help="engine: piece times traced inside the runtime; alone: each piece timed by itself")
    reality.add_argument("--profile-repeats", type=int, default=20, help="repeats per piece of the 'alone' profiler")
    reality.add_argument("--rounds", type=int, default=3, help="rounds over all plans")
    reality.add_argument("--steps", type=int, default=10, help="timed steps per plan and round")
    reality.add_argument("--reality-out", metavar="DIR", help="folder for costs, plans, traces (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.part in ("planning", "both"):
        planning_benchmark(args)
    if args.part in ("reality", "both"):
        prediction_vs_reality(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
