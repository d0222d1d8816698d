"""The text report of ``pipeloom plan --model``: the chosen layout, the framework choices it assumes, its step,
throughput, MFU, memory, bubble and the runners-up, and the time to train a number of tokens (``--tokens``, read
here with the suffixes the report writes)."""

from __future__ import annotations

import argparse
import math
from itertools import groupby

from pipeloom.formatting import format_bytes

__all__ = ["TOKEN_SUFFIXES", "report", "seconds_text", "token_count", "training_text"]

TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
"""The suffixes ``--tokens`` takes (``15T``) and the report writes token counts with."""


def _gib(nbytes: float) -> str:
    """Bytes in GiB to a tenth, or below a tenth in their own unit (GPT-2 weights sharded 64 ways had read 0.0 GiB)."""
    return format_bytes(nbytes) if 0 < nbytes < 2**30 / 10 else f"{nbytes / 2**30:.1f} GiB"


def _runs(counts) -> str:
    """``7, 8 x14, 7``: the stages' layer counts, repeats folded."""
    runs = ((count, len(list(run))) for count, run in groupby(counts))
    return ", ".join(f"{count} x{times}" if times > 1 else f"{count}" for count, times in runs)


def _copies(layout) -> str:
    """How DualPipe's ranks hold its two copies of the stages (nothing for one copy)."""
    if layout.copies == 1:
        return ""
    return f" (two copies: rank r holds stage r of one and stage {layout.pp - 1}-r of the other)"


def _experts(spec, layout) -> list[str]:
    """How the routed experts are laid out (nothing for a dense model): per GPU, and the expert mesh's groups."""
    if spec.experts is None:
        return []
    count, ep, replicas = spec.experts.count, layout.ep, layout.expert_replicas
    where = "tp x dp x cp" if layout.tp > 1 else "dp x cp"
    held = f"each held by {replicas} GPUs of a stage" if replicas > 1 else "each on one GPU of a stage"
    held += ", sharded by FSDP between uses" if layout.fsdp else ""
    if ep == 1:
        return [f"experts: all {count} on every GPU (no expert parallelism, ep 1; {held})"]
    return [f"experts: {count // ep} of {count} per GPU (ep {ep} consecutive GPUs within {where}; {held})"]


def _window(spec, seq: int) -> str:
    """The header's note of sliding-window, chunked or DeepSeek's sparse attention, or of Gated DeltaNet layers ('' for
    none)."""
    if spec.linear is not None:
        g = spec.linear
        return (f", Gated DeltaNet on {len(spec.linear_layers)} of {spec.layers} layers ({g.key_heads} key and "
                f"{g.value_heads} value heads of {g.key_dim} / {g.value_dim}), attention on the others")
    if spec.indexer is not None:
        ix, own = spec.indexer, len(spec.indexer_layers)
        reused = f", the other {spec.layers - own} reusing the last one's choice" if own < spec.layers else ""
        return (f", sparse attention to the {ix.topk:,} keys an indexer ({ix.heads} heads of {ix.dim}) picks per "
                f"query: an indexer on {own} of {spec.layers} layers{reused}")
    if not spec.window_layers:
        return ""
    local = (f"attention in chunks of {spec.window:,} tokens" if spec.chunked else
             f"sliding window {spec.window:,} tokens")
    moot = f" (no shorter than the {seq:,}-token sequence: full attention there)" if spec.window >= seq else ""
    return f", {local} on {len(spec.window_layers)} of {spec.layers} layers{moot}"


def _trained_with(spec) -> str:
    """The header's note of the dropouts the config trains with, whose masks are counted, and of the logits' softcap
    ('' without either)."""
    said = ([f"{spec.residual_dropouts} residual dropout{'s' if spec.residual_dropouts > 1 else ''} per layer"]
            if spec.residual_dropouts else []) + (["an embedding dropout"] if spec.embedding_dropout else [])
    capped = ", the logits softcapped (the config's final_logit_softcapping)" if spec.logit_softcap else ""
    return (f", {' and '.join(said)} (the config's: their masks kept)" if said else "") + capped


def _full(result) -> list[str]:
    """A note where a plan that fits fills more than 95 % of the limit: what the estimate does not hold (the
    allocator's fragmentation, buffers beyond those priced) may not fit there; where other layouts were searched,
    the fastest runner-up listed that keeps a tenth free, and the limit that does (whether one fits there is the
    plan's to say: a lower limit is searched again)."""
    total, limit = result.best.memory.total, result.memory_limit
    if not 0.95 * limit < total <= limit:
        return []
    from pipeloom.plan.cluster.step import gap_text  # the planner loads on use, not with the CLI

    roomy = next((est for est, _ in result.runners_up if est.memory.total <= 0.9 * limit), None)
    listed = (f"the runner-up {roomy.layout} holds {_gib(roomy.memory.total)}, "
              f"{gap_text(roomy.step_time / result.best.step_time - 1)} slower; " if roomy else "")
    free = ("fix fewer --layout keys to search layouts that hold less" if result.candidates == 1 else
            f"{listed}plan with --memory-limit {math.floor(0.9 * limit / 2**30 * 10) / 10:.1f}GiB to keep a tenth free"
            " (it searches again: a layout that holds less, or the least memory any needs)")
    return [f"note: the plan fills {total / limit:.0%} of the limit; the allocator's fragmentation and buffers beyond "
            f"the {_gib(result.best.memory.buffers)} priced may not fit in what is left: {free}"]


def _above(result) -> str:
    """The note of a memory limit above the GPU's memory ('' otherwise): whether the plan still fits the GPU."""
    have = result.job.hw.memory_bytes
    if result.memory_limit <= float(have):
        return ""
    if result.best.memory.total > have:
        return f"; over the {result.job.hw.name}'s {_gib(have)}: it cannot run on that GPU"
    return f"; the limit is above the {result.job.hw.name}'s {_gib(have)}"


def token_count(text: str) -> float:
    """``--tokens``: a positive count, with an optional K/M/B/T suffix (``15T`` = 15e12)."""
    suffix = text[-1:].upper()
    number, scale = (text[:-1], TOKEN_SUFFIXES[suffix]) if suffix in TOKEN_SUFFIXES else (text, 1.0)
    try:
        value = float(number) * scale
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf") or not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole token count; give e.g. 2000000, 2M or 15T")
    if value > 1e16:  # a thousand times the largest published runs' tokens: a typo's zeros, say
        raise argparse.ArgumentTypeError(f"{text!r} is more than 10,000T tokens; give e.g. 15T")
    return value


def training_text(training: dict, gpus: int) -> str:
    """The ``--tokens`` line: steps, the time they take and GPU-hours."""
    steps = training["steps"]
    return (f"training {_tokens_text(training['tokens'])} tokens: {steps:,} step{'s' if steps != 1 else ''}, "
            f"{_duration_text(training['seconds'])}, {_hours_text(training['gpu_hours'])} GPU-hours on {gpus:,} "
            f"GPU{'s' if gpus != 1 else ''} (at the predicted step time)")


def _tokens_text(tokens: float) -> str:
    """``1.5T``, ``2.5K``, ``10,000T`` (up to :func:`token_count`'s 10,000T: no exponent)."""
    suffix, scale = next(((k, v) for k, v in reversed(TOKEN_SUFFIXES.items()) if tokens >= v), ("", 1.0))
    amount = tokens / scale
    return f"{amount:,.0f}{suffix}" if amount >= 1000 else f"{amount:.4g}{suffix}"


def _duration_text(seconds: float) -> str:
    """Seconds in the largest unit they fill once rounded: ``2.7 s``, ``1.0 minutes``, ``2.50 hours``, ``1.0 days``."""
    for unit, name, digits in ((86400, "days", 1), (3600, "hours", 2), (60, "minutes", 1)):
        if round(seconds / unit, digits) >= 1:
            return f"{seconds / unit:,.{digits}f} {name}"
    return f"{seconds:.1f} s"


def _hours_text(hours: float) -> str:
    """GPU-hours: whole from 10, two decimals from 0.01, two digits from 0.0001 (``0.0029``), no exponent below."""
    if hours >= 0.01:
        return f"{hours:,.0f}" if hours >= 10 else f"{hours:.2f}"
    return f"{hours:.2g}" if hours >= 1e-4 else "under 0.0001"


_FP8_CASTS = {"cached": "Transformer Engine's delayed scaling", "dynamic": "torchao's per-tensor dynamic scaling",
              "current": "Transformer Engine's current scaling", "mxfp8": "Transformer Engine's MXFP8 block scaling"}


def _how(choice: str, searched: tuple[str, ...], variants: int) -> str:
    """The flag that sets ``choice``, and how many plans its search compared when it was given as ``search``."""
    flag = "--" + choice.replace("_", "-")
    return f"{flag} search: the fastest of {variants} plans" if choice in searched else flag


def _assumes(job, layout, framework: str | None = None, searched: tuple[str, ...] = (), variants: int = 0) -> str:
    """The framework choices priced for ``layout`` (the ones that apply to it), each set by the flag named (or by
    ``framework``'s choices, where --framework was given; ``searched``: the choices given as ``search``, of which
    the plan is the fastest of ``variants``)."""
    said = [f"{job.kernels} elementwise kernels (--kernels)", f"{job.attention} attention (--attention)",
            f"gradients held and reduced in {job.grad_reduce} " + ("beside the backward" if job.overlap_grad_reduce
                                                                   else "after it") + " (--grad-reduce"
            + (": Megatron-LM keeps fp32 unless --grad-reduce-in-bf16" if job.grad_reduce == "bf16" else "")
            + ", --no-overlap-grad-reduce)"]
    if (job.distributed_optimizer or layout.fsdp) and layout.state_groups[0] > 1 and not job.reshards(layout):
        flag = " (FSDP's)" if layout.fsdp else " (Megatron-LM's --overlap-param-gather)"  # the distributed optimizer's
        said.append("the updated parameters all-gathered " + (f"beside the step's first forward{flag}"
                    if job.overlap_grad_reduce else "before the step's first forward"))
    if layout.tp > 1:
        said.append(("sequence parallel" if job.sequence_parallel else "no sequence parallelism") + ", tp exchanges "
                    + ("beside" if job.tp_overlap else "between") + " the GEMMs (--tp-overlap)")
    if layout.cp > 1:
        said.append("context parallelism by all-gather of the latent keys (DeepSeek's sparse attention)"
                    if job.spec.indexer is not None else f"context parallelism by {job.cp_rotate} (--cp-rotate)"
                    + (", Gated DeltaNet's by all-to-all between the sequence and the head split"
                       if job.spec.linear is not None else ""))
    if layout.ep > 1:
        said.append(f"{job.moe_comm} expert all-to-all (--moe-comm)" + (", overlapped by pairs (--moe-overlap)"
                                                                          if job.overlap_pairs(layout) else ""))
    if layout.recompute == "selective":
        said.append(f"selective recomputation: {job.selective} ({_how('selective', searched, variants)})")
    if layout.recompute == "full":
        which = (f"the first {job.recompute_layers} layers of each stage" if 0 < job.recompute_layers < job.spec.layers
                 else "every layer")  # a depth of the whole model or more recomputes every layer
        said.append(f"full recomputation of {which} ({_how('recompute_layers', searched, variants)})")
    if job.dtype == "fp8":
        said.append(f"FP8 casts: {_FP8_CASTS[job.fp8_cast]} (--fp8-cast)")
    from pipeloom.plan.cluster.layout import FRAMEWORK_SCHEDULES

    if framework and layout.pp > 1:
        said.append(f"the schedules {framework} runs ({', '.join(FRAMEWORK_SCHEDULES[framework])})")
    elif layout.pp > 1 and layout.schedule not in FRAMEWORK_SCHEDULES["megatron-bridge"]:
        runs = "pipeloom's runtime" + (" or torchtitan" if layout.schedule in FRAMEWORK_SCHEDULES["torchtitan"] else "")
        said.append(f"{layout.schedule}, which {runs} runs, not Megatron-Core (--framework megatron-bridge searches "
                    "its schedules alone)")
    if job.adam_moments != "fp32":
        said.append(f"Adam's moments in {job.adam_moments} (--adam-moments)")
    if job.zero2(layout):
        said.append("gradients sharded, reduce-scattered after every micro-batch (--shard-gradients)")
    if layout.fsdp:
        said.append("FSDP gathering each layer for every micro-batch" if job.reshards(layout) else
                    f"FSDP {'under the pipeline ' if layout.pp > 1 else ''}as torch.distributed.pipelining runs it: "
                    "parameters and gradients whole from a stage's first forward to the step's end (the distributed "
                    "optimizer's memory)")
    elif not job.distributed_optimizer and layout.state_groups[0] > 1:
        said.append("Adam's state whole on every data-parallel replica, beside DDP (no distributed optimizer)")
    if layout.stages > 1:
        said.append(f"{job.stage_cut} stage cut (--stage-cut)")
    return f"assumes{f' ({framework})' if framework else ''}: " + "; ".join(said)


def _mtp(spec) -> str:
    """The multi-token-prediction modules a config trains (priced beside the layers, not counted in the parameters
    named: DeepSeek-V3's 671 B are its main model's)."""
    return f" + {spec.mtp} multi-token-prediction module{'s' * (spec.mtp > 1)}" if spec.mtp else ""


def _count(n: int) -> str:
    """A parameter count as model cards write it: 70.55B, 124.4M, 5,120."""
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _defaulted(spec) -> list[str]:
    """The note naming the size fields the config left out and the defaults planned in their place."""
    if not spec.defaulted:
        return []
    fields = ", ".join(f"{key} {value}" for key, value in spec.defaulted)
    return [f"note: the config leaves out {', '.join(key for key, _ in spec.defaulted)}: transformers' {spec.family} "
            f"defaults were planned ({fields}); give them in the config if the model differs"]


def _past_context(job) -> list[str]:
    """The note of a sequence longer than the config's ``max_position_embeddings`` (a rotary model's)."""
    if not job.seq > job.spec.context > 0:
        return []
    return [f"note: --seq {job.seq:,} is past the config's max_position_embeddings {job.spec.context:,}, the length "
            "the model was trained to (rope_scaling extends it); the plan prices the longer sequence"]


def _batch_cap(job, dp: int) -> list[str]:
    """The note of a global batch that caps data parallelism where the chosen layout sits at the cap: dp divides
    both the global batch and the GPU count."""
    cap = math.gcd(job.global_batch, job.gpus)
    if dp != cap or cap >= min(job.global_batch, job.gpus):
        return []
    wider = -(-job.global_batch // job.gpus) * job.gpus
    steps: list[tuple[int, int]] = []  # the batches past the global batch where the cap rises
    for batch in range(job.global_batch + 1, wider + 1):
        if math.gcd(batch, job.gpus) > (steps[-1][1] if steps else cap):
            steps.append((batch, math.gcd(batch, job.gpus)))
    shown = steps if len(steps) <= 4 else [*steps[:3], steps[-1]]  # the nearest, and the GPU count's multiple
    said = [f"{batch:,} ({'dp up to ' if not k else ''}{reach:,})" for k, (batch, reach) in enumerate(shown)]
    return [f"note: dp divides both the global batch ({job.global_batch:,}) and the GPU count ({job.gpus:,}), so it "
            f"is at most {cap:,} here, where the chosen layout is; a larger global batch lets the search replicate "
            f"the model more: {', '.join(said[:-1]) + ' or ' if len(said) > 1 else ''}{said[-1]}"]


def _unpipelined(job, layout) -> list[str]:
    """The note of a layout of one pipeline stage chosen where --schedules named others: it runs no schedule."""
    if layout.pp > 1 or not job.schedules or layout.schedule in job.schedules:
        return []
    return [f"note: the chosen layout has one pipeline stage (pp=1), which runs no pipeline schedule; --schedules "
            f"({', '.join(job.schedules)}) chooses among the layouts of pp >= 2, slower here (fix pp=2 or more with "
            "--layout to plan one of them)"]


def seconds_text(seconds: float) -> str:
    """Seconds to the millisecond, or to three significant digits below 10 ms (a tiny model's step); none as 0."""
    return "0" if seconds == 0 else f"{seconds:.3f}" if seconds >= 0.01 else f"{seconds:.3g}"


def _work(best) -> list[str]:
    """The line that says what one micro-batch's work through the model is made of, largest first."""
    total = sum(seconds for _, seconds in best.work)
    if total <= 0:
        return []
    parts = sorted(best.work, key=lambda part: -part[1])
    return ["work per micro-batch (F + I + W, every stage): " + ", ".join(
        f"{name} {seconds / total * 100:.0f} %" for name, seconds in parts if seconds / total >= 0.005)]


def json_notes(result, *, framework: str | None = None) -> dict[str, list[str]]:
    """What the text report says beside its numbers, for ``--json``: ``assumes`` (the framework choices priced, as the
    report's ``assumes:`` line gives them) and ``notes`` (its other remarks: experts placed, the limit nearly full,
    defaulted fields, a sequence past the model's positions, ...)."""
    best, job = result.best, result.job
    said = _assumes(job, best.layout, framework, result.searched, result.variants).split(": ", 1)[1]
    notes = [*_experts(job.spec, best.layout), *_full(result), *_defaulted(job.spec), *_past_context(job),
             *_batch_cap(job, best.layout.dp), *_unpipelined(job, best.layout)]
    return {"assumes": said.split("; "), "notes": notes}


def report(result, *, framework: str | None = None) -> str:
    """The text report: the layout, the framework choices it assumes (``framework``: the --framework given), its
    step, throughput, MFU, memory, bubble and the runners-up."""
    from pipeloom.plan.cluster.counts import model_params  # the planner loads on use, not with the CLI

    best, job = result.best, result.job
    mem = best.memory
    fits = "fits" if mem.total <= result.memory_limit else "DOES NOT FIT"
    text_of = (f" (the language model of a {job.spec.text_of} config: its vision tower and image tokens are not "
               "planned)") if job.spec.text_of else ""
    lines = [
        f"{job.spec.family}{text_of} ({job.spec.layers} layers{_mtp(job.spec)}, {_count(model_params(job.spec))} "
        "parameters"
        f"{f', {_count(model_params(job.spec, active=True))} active' if job.spec.experts else ''}) on "
        f"{job.gpus} x {job.hw.name}, global batch {job.global_batch} x {job.seq} "
        f"tokens, {job.dtype}{_window(job.spec, job.seq)}{_trained_with(job.spec)}",
        f"layout: {best.layout}",
        _assumes(job, best.layout, framework, result.searched, result.variants),
        *([f"layers per stage: {_runs(best.stage_layers)}{_copies(best.layout)}"] if len(best.stage_layers) > 1
          else []),
        *_experts(job.spec, best.layout),
        f"step time: {seconds_text(best.step_time)} s (pipeline {seconds_text(best.pipeline_time)} s, exposed dp"
        f"{' x cp' * (best.layout.cp > 1)} {seconds_text(best.exposed_dp)} s, optimizer "
        f"{seconds_text(best.optimizer_time)} s)",
        f"tokens/s per GPU: {best.tokens_per_gpu_per_second:,.0f}   MFU: {best.mfu * 100:.1f} % (of the "
        f"{job.dtype} peak)   bubble: {best.bubble * 100:.1f} %",
        *_work(best),
        f"memory per GPU: {_gib(mem.total)} of {_gib(result.memory_limit)} ({fits}{_above(result)}): weights "
        f"{_gib(mem.weights)}, "
        f"gradients {_gib(mem.gradients)}, optimizer {_gib(mem.optimizer)}, activations {_gib(mem.activations)}, "
        f"buffers {_gib(mem.buffers)}",
        *_full(result),
        *_defaulted(job.spec),
        *_past_context(job),
        *_batch_cap(job, best.layout.dp),
        *_unpipelined(job, best.layout),
    ]
    if result.runners_up:
        lines.append("runners-up:")
        for est, why in result.runners_up:
            lines.append(f"  {est.layout}: {seconds_text(est.step_time)} s, {_gib(est.memory.total)}: {why}")
    if result.candidates == 1:  # a layout given whole, or the one the fixed keys leave
        lines.append(f"predicted the one layout the keys given leave (no other searched), planning took "
                     f"{result.seconds:.1f} s")
    else:
        plans = f"; {result.variants} plans for the searched choices" if result.variants > 1 else ""
        lines.append(f"searched {result.candidates} layouts ({result.priced} priced, {result.simulated} simulated"
                     f"{plans}) in {result.seconds:.1f} s")
    lines.append("times, throughput and MFU are the cost model's predictions: most published runs ran slower than "
                 "predicted, some by 2x or more (docs/cluster-plan.md, \"Validation against the published runs\")")
    return "\n".join(lines)
