"""A cluster plan as the runtime's plan file (``pipeloom plan --model ... --save``): the chosen layout's pipeline,
data-parallel, FSDP and tensor-parallel sizes, the split points at the model's decoder layers (the planner's
cut), the schedule and its micro-batches, and expert-parallel size (a ``pipeloom.plan/2`` file), so that
``pipeline(model, plan=FILE)`` runs it. What the runtime does not run (context parallelism; ep with tp or fsdp) is
refused by name, and what it runs differently is said."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from pipeloom.errors import ArgumentError, PipeloomError
from pipeloom.plan.cluster.estimate import Estimator
from pipeloom.plan.cluster.job import Job
from pipeloom.plan.cluster.layout import PAIRED, Layout
from pipeloom.plan.cluster.model.spec import GDN_CHUNK
from pipeloom.plan.errors import PlanError
from pipeloom.plan.export import megatron, torchtitan
from pipeloom.plan.plan import Plan

if TYPE_CHECKING:
    from pipeloom.plan.cluster.api import ClusterPlan

__all__ = ["LAYER_PREFIX", "FINAL_NORM", "split_point", "RUNTIMES", "RUNTIME_NAMES", "for_runtime",
           "layout_problems", "pipeloom_memory", "runtime_job", "runtime_memory_note", "runtime_plan", "runtime_notes",
           "save_blockers"]

LAYER_PREFIX = {**dict.fromkeys(("gpt2", "falcon", "gptj"), "transformer.h"), "gpt_neox": "gpt_neox.layers"}
"""Where a ``transformers`` model of a family keeps its decoder layers (every other family: ``model.layers``)."""
FINAL_NORM = {**dict.fromkeys(("gpt2", "falcon", "gptj"), "transformer.ln_f"), "phi": "model.final_layernorm",
              "gpt_neox": "gpt_neox.final_layer_norm"}
"""Where a last stage that holds only the head begins: the final norm, where it is not ``model.norm``."""
_TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "smollm3")
"""Families whose attention and MLP projections are plain ``nn.Linear`` modules under the names below (the runtime's
tp tests run LLaMA, Qwen3, and Gemma 2 and 3, Granite and SmolLM3 from saved plans: Gemma's norms after each branch
see the whole hidden state, Gemma 3's per-head q/k norms are the recipe's ``head_norm``, Granite's multipliers and
SmolLM3's layers without rotary embedding act on whole tensors or on each head alike)."""
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_DENSE_EXPERTS = ("llama4_text",)
"""Families whose transformers experts module runs every expert on every token (no top-k interface, so the runtime's
expert parallelism has nothing to dispatch)."""
_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
"""Per-head norms after the split heads (``qk_norm``: Qwen3, Qwen3-MoE), their gradients summed over tp."""


def _starts(counts: Sequence[int]) -> list[int]:
    """The first layer of stages 1.. of a cut with ``counts[j]`` decoder layers in stage ``j`` (the embedding rides
    with the first stage, the head with the last, as the planner prices them; a last stage without a decoder layer
    starts after the last one)."""
    return list(accumulate(counts[:-1]))


def split_point(family: str, layer: int, layers: int) -> str:
    """The module where a stage starting at decoder ``layer`` of ``layers`` begins in ``family``'s transformers
    model: the layer, or the final norm for a stage that holds only the head."""
    if layer < layers:
        return f"{LAYER_PREFIX.get(family, 'model.layers')}.{layer}"
    return FINAL_NORM.get(family, "model.norm")


def save_blockers(result: ClusterPlan, *, export: str | None = None) -> str | None:
    """Why ``result``'s chosen layout cannot be saved as a plan the runtime runs (or exported to ``export``): every
    reason in one line, then the ``--layout`` keys that fix those a key fixes; None when nothing stops it."""
    layout = result.best.layout
    problems: list[tuple[str, dict[str, int | str]]] = []  # each with the layout keys that fix it ({}: none does)
    over = result.best.memory.total > result.memory_limit  # said first: leave keys to the search
    if over:
        held = f" as {RUNTIME_NAMES[result.runs_on]} holds its state" if result.runs_on else ""
        problems.append((f"it needs {result.best.memory.total / 2**30:.1f} GiB per GPU{held}, over the "
                         f"{result.memory_limit / 2**30:.1f} GiB limit, so a saved plan would not run (leave some "
                         "keys to the search, or raise --memory-limit)", {}))
    problems += layout_problems(result.job, layout, export=export)
    if not problems:
        return None
    fixes = {key: value for _, keys in problems for key, value in keys.items()}
    if fixes.get("schedule") == "dualpipev":
        fixes["vp"] = 2  # the V places two stages per rank
    tp, cp = int(fixes.get("tp", layout.tp)), int(fixes.get("cp", layout.cp))
    if (tp, cp) != (layout.tp, layout.cp) and result.job.gpus % (tp * layout.pp * cp) == 0:
        fixes["dp"] = result.job.gpus // (tp * layout.pp * cp)  # the GPUs the other keys free
    note = "" if over or not fixes else _fix_memory(result, fixes, export)  # a smaller mbs where the fix needs one
    keys = ",".join(f"{k}={v}" for k, v in fixes.items())  # a fully fixed layout: the whole one, to give in its place
    keys = f"{keys}: --layout {_fixed(layout, fixes)}" if result.candidates == 1 and not over else f"--layout {keys}"
    which = "the others" if any(not fixed for _, fixed in problems) else ("them" if len(problems) > 1 else "it")
    fix = f"; fix {which} with {keys}{note}" if fixes else ""
    what = f"for {RUNTIME_NAMES[export]}" if export else "as a plan the runtime runs"
    return (f"cannot save the chosen layout {what}: "
            + "; ".join(text for text, _ in problems) + fix)


def _fixed(layout: Layout, fixes: dict[str, int | str]) -> Layout:
    changes: dict[str, Any] = {key: bool(value) if key == "fsdp" else value for key, value in fixes.items()}
    return dataclasses.replace(layout, **changes)


def _fix_memory(result: ClusterPlan, fixes: dict[str, int | str], export: str | None) -> str:
    """What follows the suggested ``--layout`` fix: nothing where the fixed layout runs and fits the limit as the
    runtime holds it (with the largest smaller mbs added to ``fixes`` where the fix leaves too few micro-batches);
    else that it would not, so that the fix does not lead to another refusal unannounced."""
    estimator, mbs = Estimator(runtime_job(result.job, export or "pipeloom")), result.best.layout.mbs
    failed, over = None, None  # the first refusal; the first layout that runs, over the limit
    for attempt in [fixes] + ([{**fixes, "mbs": m} for m in range(mbs - 1, 0, -1)] if "mbs" not in fixes else []):
        try:
            needs = estimator.estimate(_fixed(result.best.layout, attempt)).memory.total
        except (PipeloomError, ValueError) as error:
            failed = failed or error
            continue
        if needs <= result.memory_limit:
            fixes.update(attempt)
            return ""
        over = over or (attempt, needs)
    retry = "give --layout fewer keys and let the search choose the others"
    if over is None:
        return f" (that layout cannot run: {failed}; {retry})"
    fixes.update(over[0])
    return (f" (that layout needs {over[1] / 2**30:.1f} GiB per GPU as {RUNTIME_NAMES[export or 'pipeloom']} holds "
            f"it, over the {result.memory_limit / 2**30:.1f} GiB limit: {retry})")


def layout_problems(job: Job, layout: Layout, *, export: str | None = None) -> list[tuple[str, dict[str, int | str]]]:
    """What stops ``layout`` of ``job`` running in pipeloom's runtime (or, with ``export``, in that framework) whatever
    its memory: each problem with the ``--layout`` keys that fix it (``{}`` where no key does)."""
    family = job.spec.family
    problems: list[tuple[str, dict[str, int | str]]] = []
    if export == "torchtitan":  # torchtitan runs context parallelism (all-gathering K/V): the export writes it
        return torchtitan.torchtitan_problems(job, layout)
    if export == "megatron":
        return megatron.megatron_problems(job, layout)
    if layout.cp > 1:
        problems.append((f"cp={layout.cp} (pipeloom's runtime does not run context parallelism yet)", {"cp": 1}))
    if layout.ep > 1 and (layout.tp > 1 or layout.fsdp):
        off: dict[str, int | str] = {key: value for key, value, now in (("tp", 1, layout.tp > 1),
                                                                       ("fsdp", 0, layout.fsdp)) if now}
        given = " and ".join(f"{key}={int(getattr(layout, key))}" for key in off)
        problems.append((f"ep={layout.ep} with {given} (the runtime runs ep with tp=1 and fsdp=0 only)", off))
    if layout.ep > 1 and family in _DENSE_EXPERTS:
        problems.append((f"ep={layout.ep} on {family} (transformers' model runs every expert on every token, with no "
                         "forward(hidden_states, top_k_index, top_k_weights) for the runtime's expert parallelism to "
                         "dispatch to)", {"ep": 1}))
    problems += _composition_problems(job, layout)
    if layout.tp > 1 and family not in _TP_FAMILIES:
        problems.append((f"tp={layout.tp} on {family} (the tensor-parallel recipe by module name is written for "
                         f"{', '.join(_TP_FAMILIES)}; or pass pipeline(..., parallel=Parallelism(tp_plan=...)) with a "
                         "plan of your own)", {"tp": 1}))
    if layout.recompute != "none":
        there = not [text for text, _ in torchtitan.torchtitan_problems(job, layout)]
        problems.append((f"recompute={layout.recompute} (pipeloom's runtime keeps every activation"
                         + ("; --export torchtitan recomputes as planned)" if there else ")"), {"recompute": "none"}))
    return problems


def _composition_problems(job: Job, layout: Layout) -> list[tuple[str, dict[str, int | str]]]:
    """What pipeloom's runtime refuses to compose (``pipeloom.runtime.build``: its FSDP shards over a "dp" of 2 or
    more, not with a tp plan, DualPipe's two copies or a parameter tied across pieces; DualPipe's copies exchange
    plain gradients, not tp's DTensors or ep's sharded experts), each with the keys that fix it."""
    problems: list[tuple[str, dict[str, int | str]]] = []
    if layout.fsdp:  # every conflict named: fsdp=0 fixes them all
        whys = [why for why, there in (
            ("dp=1 (its FSDP shards over dp replicas: none to shard over)", layout.dp == 1),
            (f"tp={layout.tp} (FSDP with a tp plan, 2-D sharding, is not built in the runtime)", layout.tp > 1),
            ("schedule=dualpipe (its two copies of each stage)", layout.copies == 2),
            ("the embedding tied to the head across stages (FSDP shards a parameter once)",
             job.spec.tied and layout.pp > 1)) if there]
        if whys:
            problems.append((f"fsdp=1 with {' and with '.join(whys)}", {"fsdp": 0}))
    if layout.copies == 2 and (layout.tp > 1 or layout.ep > 1):
        given = " and ".join(f"{key}={getattr(layout, key)}" for key in ("tp", "ep") if getattr(layout, key) > 1)
        problems.append((f"schedule=dualpipe with {given} (its two copies of each stage exchange plain gradients, "
                         "not sharded ones)", {"schedule": "dualpipev"}))
    return problems


RUNTIMES = ("pipeloom", "torchtitan", "megatron")
"""What a plan can be searched for (:func:`for_runtime`): pipeloom's runtime, or the torchtitan or Megatron-LM
export."""
RUNTIME_NAMES = {"pipeloom": "pipeloom's runtime", "torchtitan": "torchtitan", "megatron": "Megatron-LM"}
"""How messages name each of :data:`RUNTIMES`."""


def for_runtime(job: Job, runs_on: str | None) -> tuple[Job, Callable[[Layout], list[str]] | None]:
    """``job`` as ``runs_on`` (:data:`RUNTIMES`; None: as planned) holds and runs a layout, and the search's filter of
    the layouts it cannot run: a layout's problems, each beginning ``key=value`` (:func:`layout_problems`), none
    where it runs.
    pipeloom's runtime keeps every activation (a layout that recomputes is refused: its twin without recomputation is
    what the runtime would run, and is searched in its place) and exchanges experts with ``all_to_all_single``
    calls one after another (the plain all-to-all, exposed)."""
    if runs_on is None:
        return job, None
    if runs_on not in RUNTIMES:
        raise ArgumentError(f"runs_on must be one of {', '.join(RUNTIMES)}, got {runs_on!r}")
    export = None if runs_on == "pipeloom" else runs_on
    if export is not None:  # what no layout helps: said before the search, without a layout
        {"torchtitan": torchtitan.check_job, "megatron": megatron.check_job}[export](job)

    def blocked(layout: Layout) -> list[str]:
        return [text for text, _ in layout_problems(job, layout, export=export)]

    return runtime_job(job, runs_on), blocked


def runtime_job(job: Job, runs_on: str) -> Job:
    """``job`` priced as ``runs_on`` holds and runs a layout: a torch optimizer beside DDP holds Adam's state whole on
    every replica; pipeloom's FSDP keeps a stage whole from its first forward to the step's end, one stage too
    (:mod:`pipeloom.runtime.parallel.fsdp`), no gradient sharded, and its expert all-to-alls plain and exposed;
    torchtitan's context parallelism all-gathers K/V (``torchtitan/distributed/context_parallel`` at 0.3.0), its
    gradients are reduced in fp32 (``mixed_precision_reduce`` takes only ``"float32"`` in 0.2.2 and 0.3.0) and held
    whole under a pipeline until the step's end (torch's ``PipelineStage``), none sharded per micro-batch."""
    if runs_on == "pipeloom":
        return dataclasses.replace(job, distributed_optimizer=False, fsdp_per_layer=False, shard_gradients=False,
                                   moe_comm="plain", moe_overlap=False, blocking_1f1b=False)
    if runs_on == "megatron":  # the planner's defaults are Megatron-Core's; the export writes the job's choices
        return job
    return dataclasses.replace(job, distributed_optimizer=False, cp_rotate="allgather", grad_reduce="fp32",
                               shard_gradients=False, blocking_1f1b=False)


def pipeloom_memory(job: Job, layout: Layout) -> float:
    """Bytes per GPU pipeloom's runtime needs for ``layout`` of ``job`` (its twin without recomputation, priced as
    the runtime holds its state: :func:`runtime_job`)."""
    return Estimator(runtime_job(job, "pipeloom")).estimate(dataclasses.replace(layout, recompute="none")).memory.total


def runtime_plan(result: ClusterPlan, *, export: str | None = None) -> Plan:
    """``result``'s chosen layout as a plan (``pipeloom.plan/1``, ``/2`` with ep), to run with pipeloom's runtime or,
    with ``export``, with that framework; PlanError naming everything that cannot run it (:func:`save_blockers`)."""
    job, best = result.job, result.best
    layout = best.layout
    blockers = save_blockers(result, export=export)
    if blockers:
        raise PlanError(blockers)
    family = job.spec.family
    prefix = LAYER_PREFIX.get(family, "model.layers")
    split_points = tuple(split_point(family, layer, job.spec.layers) for layer in _starts(best.stage_layers))
    tp_plan = None
    if layout.tp > 1:
        tp_plan = {"recipe": "megatron", "column": [f"{prefix}.*.{name}" for name in _COLUMN],
                   "row": [f"{prefix}.*.{name}" for name in _ROW]}
        if job.spec.attention.qk_norm:
            tp_plan["head_norm"] = [f"{prefix}.*.{name}" for name in _HEAD_NORMS]
    samples = layout.dp * layout.mbs
    if job.global_batch % samples:
        raise PlanError(f"global batch {job.global_batch} is not a multiple of dp {layout.dp} x mbs {layout.mbs}")
    options = {"stages_per_rank": layout.vp} if layout.schedule == "interleaved-1f1b" else {}
    estimator = Estimator(job)  # one for the ranks' memory and the stages' times: they share its stage pricing
    return Plan(num_ranks=layout.pp, split_points=split_points, schedule=layout.schedule, schedule_options=options,
                microbatches=job.global_batch // samples, global_batch=job.global_batch,
                predicted_step_time=best.step_time,
                peak_memory=tuple(math.ceil(b) for b in estimator.rank_memory(layout)),  # whole bytes
                stage_times=_stage_times(estimator, layout),
                memory_limit=result.memory_limit, bubble_ratio=best.bubble, device=job.hw.name,
                data_parallel=layout.dp, sharding="fsdp" if layout.fsdp else "replicate",
                tensor_parallel=layout.tp, tp_plan=tp_plan, expert_parallel=layout.ep, context_parallel=layout.cp,
                sequence_length=job.seq, model={"model_type": job.spec.family, "num_hidden_layers": job.spec.layers,
                                                "hidden_size": job.spec.hidden})


def runtime_memory_note(result: ClusterPlan) -> tuple[str | None, bool]:
    """What pipeloom's runtime holds beyond what ``result`` was priced with, and the bytes per GPU it then needs
    (:func:`pipeloom_memory`, what its own search prices), in one note; None where it holds what the plan does (a plan
    priced for it). And whether pipeloom's runtime runs the layout as priced within the limit (not Llama 4's, whose
    transformers experts all run on every token). Without FSDP it keeps the optimizer it is given whole on every
    data-parallel replica (:mod:`pipeloom.runtime.parallel.dp`); its FSDP keeps a stage's parameters and gradients
    whole from its first forward to the step's end (:mod:`pipeloom.runtime.parallel.fsdp`); it keeps gradients whole,
    and every activation."""
    job, layout = result.job, result.best.layout
    replicas = layout.state_groups[0]
    why = []
    if layout.recompute != "none":
        why.append(f"keeps every activation, where the plan recomputes ({layout.recompute})")
    if not layout.fsdp and replicas > 1 and job.distributed_optimizer:
        why.append("keeps the optimizer it is given whole on every data-parallel replica, where the plan shards its "
                   f"state over the {replicas} replicas (a distributed optimizer; fsdp=1 shards it there too)")
    if job.reshards(layout):
        why.append("gathers each stage's FSDP parameters at its first forward and keeps them and their gradients "
                   "whole until the step ends (torch.distributed.pipelining's recipe), where the plan gathers a layer "
                   "at a time")
    elif job.zero2(layout):
        why.append("keeps the gradients whole until the step ends, where the plan reduce-scatters them after every "
                   "micro-batch (--shard-gradients)")
    stops = [text for text, _ in layout_problems(job, layout) if not text.startswith("recompute=")]
    if stops:  # what pipeloom's runtime cannot run at all, not what it would need
        return f"pipeloom's runtime does not run this layout: {'; '.join(stops)}", False
    runs = not (job.spec.family in _DENSE_EXPERTS and job.spec.experts)  # every expert on every token
    if not why:
        return None, runs
    need = pipeloom_memory(job, layout)
    over = need > result.memory_limit
    limit = f", over the {result.memory_limit / 2**30:.1f} GiB limit" if over else ""
    return (f"pipeloom's runtime {'; it '.join(why)}: it needs {need / 2**30:.1f} GiB per GPU there, "
            f"{result.best.memory.total / 2**30:.1f} GiB as planned{limit}"), runs and not over


def _stage_times(estimator: Estimator, layout: Layout) -> tuple[float, ...]:
    """Seconds per micro-batch of each model stage (F + I + W as the estimate priced them; one copy's under
    DualPipe)."""
    times = estimator.stages(layout)[0]
    return tuple(t.f + t.i + t.w for t in times[:layout.stages])


def runtime_notes(result: ClusterPlan, *, memory: tuple[str | None, bool] | None = None) -> list[str]:
    """What the runtime runs differently from the plan's prediction (said next to a saved plan); ``memory``:
    :func:`runtime_memory_note` where the caller has it already."""
    layout = result.best.layout
    notes = []
    state = (memory or runtime_memory_note(result))[0]
    if state is not None:
        notes.append(state)
    if result.job.dtype != "bf16":
        notes.append(f"the plan assumes {result.job.dtype} GEMMs; the runtime runs the model's own dtype")
    if result.job.adam_moments == "bf16":  # the runtime trains with the optimizer it is given
        fp32 = pipeloom_memory(dataclasses.replace(result.job, adam_moments="fp32"), layout)
        notes.append("the plan holds Adam's moments in bf16 (--adam-moments bf16): train it with an optimizer that "
                     f"keeps them so; torch's AdamW keeps them in fp32, {fp32 / 2**30:.1f} GiB per GPU in pipeloom's "
                     "runtime")
    if result.job.overlap_pairs(layout):
        notes.append("the plan assumes each forward beside another micro-batch's backward, hiding the expert "
                     "all-to-all (--moe-overlap); the runtime runs them one after the other, the all-to-all exposed")
    elif layout.schedule in PAIRED and layout.ep > 1:
        notes.append(f"the plan hides the expert all-to-all under {layout.schedule}'s overlapped pairs: run it with "
                     "pipeline(..., parallel=Parallelism(overlap_pairs=True)), which interleaves each pair's parts at "
                     "their all-to-alls (without, they run one after the other, the all-to-all exposed)")
    spec = result.job.spec
    if spec.family in _DENSE_EXPERTS and spec.experts is not None:
        ex = spec.experts
        notes.append(f"the plan prices each token's top {ex.top_k} of {ex.count} experts, as training frameworks run "
                     f"them; transformers' {spec.family} runs every expert on every token, {ex.count // ex.top_k}x "
                     "the routed experts' work and memory in pipeloom's runtime")
    if spec.linear is not None:
        chunks = -(-result.job.seq // GDN_CHUNK)
        notes.append(f"transformers' gated delta rule loops over the sequence's {GDN_CHUNK}-token chunks in Python: "
                     f"the runtime's trace holds for the chunk count of the batch it traces ({chunks} at "
                     f"{result.job.seq:,} tokens) and refuses other lengths (TracedSizeError); pad every batch to one "
                     "length")
    if spec.text_of:
        notes.append(f"the plan cuts the language model of the {spec.text_of} config at its decoder layers: run it on "
                     f"that language model alone (the {spec.family} model of its text_config); the {spec.text_of} "
                     "model names its layers otherwise, and its vision tower is not planned")
    return notes
