"""The flags of ``pipeloom plan``'s cluster mode (``--model CONFIG.json --hardware NAME``), the check that
keeps them apart from the cost-table mode's, and the framework choices and schedules they ask the planner to
price (:func:`framework_options`, :func:`check_export`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeloom.cli.argtypes import count, schedule_list, sequence_length
from pipeloom.cli.errors import UsageError
from pipeloom.cli.plan_cluster_report import token_count
from pipeloom.errors import PipeloomError

__all__ = ["add_cluster_arguments", "check_plan_mode", "check_export", "framework_options"]


def add_cluster_arguments(plan: argparse.ArgumentParser) -> None:
    """The arguments of the cluster mode (``--global-batch``, ``--memory-limit`` and ``--json`` are shared)."""
    group = plan.add_argument_group("planning from a model config (instead of --costs)")
    group.add_argument("--model", type=Path, metavar="CONFIG.json|DIR|ID",
                       help="a transformers config.json, a model folder holding one, or a Hugging Face model id "
                            "whose config is in the local cache (LLaMA, Mistral, Qwen2/3, Gemma 1-3, Granite, "
                            "Phi-1/1.5/2/3/4, OLMo 1/2/3, StarCoder2, GPT-2, GPT-J, GPT-NeoX, Mixtral, Qwen2/3-MoE, "
                            "DeepSeek-V2/V3, GLM-4.5, gpt-oss, and more: README lists them); see docs/cluster-plan.md")
    group.add_argument("--hardware", metavar="NAME|FILE.json",
                       help="GPU type: a100-40gb, a100-80gb, h100, h200, b200, gb200, gb300, mi300x, or a "
                            "pipeloom.hardware/1 JSON file")
    group.add_argument("--gpus", type=count, metavar="N", help="GPUs of the job")
    group.add_argument("--seq", type=sequence_length, metavar="S",
                       help="tokens per sequence: a count, or with a K suffix counting 1,024 (8k = 8192) or M (1M)")
    group.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="GEMM precision (default bf16)")
    group.add_argument("--tokens", type=token_count, metavar="N",
                       help="also say how long training N tokens takes with the chosen layout (steps, days, "
                            "GPU-hours); a count or with a K/M/B/T suffix, e.g. 15T")
    _add_framework_options(group)
    _add_gradient_options(group)
    group.add_argument("--layout", metavar="KEY=VALUE,...",
                       help="layout keys to hold fixed, e.g. tp=4,pp=8,vp=5,cp=1,ep=1,dp=2,mbs=1,fsdp=0,"
                            "recompute=selective,schedule=interleaved-1f1b; all of them: predict that layout")
    # the cost-table mode refuses these by name (check_plan_mode): they describe a cluster it does not plan
    # (--seq it shares: --try builds the model with it)
    plan.set_defaults(cluster_flags={action.dest: action.option_strings[0] for action in group._group_actions
                                     if action.dest not in ("model", "seq")})


def _add_framework_options(group) -> None:
    """What the training framework does (defaults: Megatron-Core's), each a choice the estimate prices."""
    group.add_argument("--framework", choices=("megatron-bridge", "torchtitan"),
                       help="set the choices below as that framework makes them (NVIDIA's Megatron-Bridge recipes, "
                            "or torchtitan's defaults: docs/cluster-plan.md); a flag given as well wins")
    group.add_argument("--kernels", choices=("fused", "eager"),
                       help="elementwise kernels: fused (Megatron, Transformer Engine, torch.compile; default) or "
                            "eager (PyTorch op by op)")
    group.add_argument("--attention", choices=("flash", "flash2", "materialized"),
                       help="attention core: flash (the GPU's best kernel; default), flash2 (FlashAttention-2, "
                            "PyTorch SDPA's default backend) or materialized s x s scores (Megatron-LM before "
                            "flash attention)")
    group.add_argument("--selective", metavar="POLICY",
                       help="what recompute=selective recomputes: Megatron-Core's recompute_modules, "
                            "comma-separated, from core_attn (the attention core; default), layernorm, moe_act, "
                            "mla_up_proj, mlp, moe, shared_experts, or search (the model's module sets, cheapest "
                            "first, each tried: the fastest plan kept); or op (torchtitan's op-level policy), layer "
                            "(every second layer whole) or deepseek (DeepSeek-V3's norms, MLA up-projections and "
                            "SwiGLU; FP8-cached inputs)")
    group.add_argument("--cp-rotate", choices=("ring", "allgather"),
                       help="how context parallelism exchanges K/V: ring (Megatron-Core's, beside the compute; "
                            "default) or allgather (PyTorch's context_parallel, as torchtitan runs it)")
    group.add_argument("--moe-comm", choices=("plain", "deepseek", "hybridep", "hybridep-sync-free"), default="plain",
                       help="the expert all-to-all: plain (default), deepseek (DeepSeek-V3's node-limited FP8 "
                            "dispatch with 20 SMs reserved for communication) or hybridep (NVIDIA's Hybrid-EP, "
                            "Megatron-Core's flex dispatcher: each token once per other node, in bf16; priced as "
                            "measured on H100, B200 and GB200), hybridep-sync-free without its calls' host "
                            "synchronization (Megatron-Core's moe_expert_rank_capacity_factor)")
    group.add_argument("--moe-overlap", action="store_true",
                       help="each backward runs with the forward of another micro-batch its rank runs next, their "
                            "expert all-to-alls hidden under each other's compute (Megatron-Core's "
                            "overlap_moe_expert_parallel_comm: pp 1 or interleaved-1f1b; DualPipe(V) pair always); "
                            "default: exposed")
    _add_exchange_options(group)
    group.add_argument("--fp8-cast", choices=("cached", "dynamic", "current", "mxfp8"),
                       help="with --dtype fp8, how the GEMMs' inputs are cast: cached (Transformer Engine's "
                            "delayed scaling, Megatron-Core's default: the amax in the cast kernel, FP8 weights "
                            "and activations reused; default), dynamic (torchao's per-tensor dynamic scaling, "
                            "torchtitan's Float8: both inputs of every GEMM, an amax pass first), current "
                            "(Transformer Engine's current scaling, Megatron-Bridge's FP8-CS: as cached, with an "
                            "amax pass first) or mxfp8 (Transformer Engine's MXFP8 block scaling on Blackwell, "
                            "Megatron-Bridge's MXFP8: as cached, a block-scaled copy per direction)")
    group.add_argument("--recompute-layers", type=_depth, default=0, metavar="N|search",
                       help="with recompute=full, recompute only the first N decoder layers of each stage (each "
                            "virtual stage under interleaving), the others keeping everything: Megatron-Core's "
                            "recompute_method block with recompute_num_layers N; default 0: every layer; search: "
                            "0, 1, 2, 4, ... each tried, the fastest plan kept")
    group.add_argument("--stage-cut", metavar="balanced|even|LAYOUT",
                       help="how the decoder layers are cut into pipeline stages: balanced (layers moved off the "
                            "busiest pipeline rank, the embedding and the head counted; default), even (as many "
                            "layers per stage as divide, the remainder to the middle stages) or the stages "
                            "themselves as Megatron-Core's --pipeline-model-parallel-layout writes them, e.g. "
                            "'Et*4|(t*4|)*14tmL' (E embedding, t decoder layer, m multi-token prediction, L loss, | "
                            "between stages; then only layouts with pp x vp of that many stages are searched)")


def _add_exchange_options(group) -> None:
    """How the tensor-parallel and pipeline exchanges run beside the compute (defaults: Megatron-Core's)."""
    group.add_argument("--no-blocking-1f1b", dest="blocking_1f1b", action="store_false", default=None,
                       help="1F1B without virtual stages sends beside the compute, as torch's pipelining does "
                            "(torchtitan; --framework torchtitan sets it); default: blocking, as Megatron-Core runs it "
                            "(it turns overlap_p2p_comm off without interleaving)")
    group.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                       help="with tp > 1, every tp rank runs the norms and residual adds on all the tokens and the "
                            "tp exchanges are all-reduces (Megatron-LM before sequence parallelism)")
    group.add_argument("--tp-overlap", action="store_true", default=None,
                       help="tensor-parallel all-gathers and reduce-scatters run beside the GEMMs next to them "
                            "(Transformer Engine's userbuffers: Megatron-Core / NeMo tp_comm_overlap; PyTorch's "
                            "async TP); default: between them, exposed")


def _add_gradient_options(group) -> None:
    """How the data-parallel ranks exchange and hold the gradients (defaults: Megatron-Core's)."""
    group.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                       help="the data-parallel gradient all-reduce runs after the backward, exposed (Megatron-LM "
                            "before --overlap-grad-reduce)")
    group.add_argument("--grad-reduce", choices=("bf16", "fp32"),
                       help="the data type of the gradient reduce-scatter: bf16 (default) or fp32 (torchtitan's "
                            "default mixed_precision_reduce, Llama 3's)")
    group.add_argument("--adam-moments", choices=("fp32", "bf16"), default="fp32",
                       help="the data type of Adam's two moments: fp32 (default) or bf16 (Megatron-Core's "
                            "precision-aware optimizer with exp_avg_dtype and exp_avg_sq_dtype bf16, as "
                            "Megatron-Bridge's DeepSeek-V3 recipes run it: 8 bytes of optimizer state a parameter, "
                            "not 12)")
    group.add_argument("--shard-gradients", action="store_true",
                       help="ZeRO-2: gradients reduce-scattered after every micro-batch's backward and kept sharded "
                            "over the data-parallel ranks (DeepSpeed's stage 2, Llama 3's FSDP); default: whole "
                            "until the step's one reduce-scatter (the distributed optimizer; FSDP under a pipeline)")


def _depth(text: str) -> int | str:
    """``--recompute-layers``: a whole number of layers, or ``search``."""
    if text == "search":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of layers nor 'search'") from None


def check_plan_mode(args: argparse.Namespace) -> bool:
    """True for the cluster mode (--model), False for the cost-table mode (--costs); UsageError if both or
    neither, or a mode's required flags are missing."""
    if args.model is not None and args.costs:
        raise UsageError("give either --costs FILE (plan from a cost table) or --model CONFIG.json (plan from a "
                         "model config and --hardware), not both")
    if args.model is None and not args.costs:
        raise UsageError("give --costs FILE (plan from a cost table) or --model CONFIG.json --hardware NAME --gpus N "
                         "--global-batch B --seq S (plan for a cluster)")
    _check_memory_limit(args.memory_limit, "GPU" if args.model is not None else "rank")
    defaults = getattr(args, "plan_defaults", {})
    if args.model is None:
        given = [flag for dest, flag in getattr(args, "cluster_flags", {}).items()
                 if dest in defaults and getattr(args, dest, None) != defaults[dest]]
        if given:
            instead = {"--gpus": "give the cost table's ranks with --ranks P",
                       "--layout": "fix tp, the schedule or the micro-batches with --tp, --schedules or "
                                   "--microbatches"}.get(given[0], "leave it out")
            raise UsageError(f"{given[0]} belongs to planning for a cluster (--model CONFIG.json --hardware NAME); "
                             f"a cost table's costs were measured as the model ran: {instead}")
        missing = [flag for flag, value in (("--ranks P", args.ranks), ("--global-batch B", args.global_batch))
                   if value is None]
        if missing:
            raise UsageError(f"--costs needs {' and '.join(missing)}")
        return False
    missing = [flag for flag, value in (("--hardware", args.hardware), ("--gpus", args.gpus),
                                        ("--global-batch", args.global_batch), ("--seq", args.seq)) if value is None]
    if missing:
        raise UsageError(f"--model needs {', '.join(missing)}")
    for dest, (flag, instead) in _COST_TABLE_ONLY.items():
        if dest in defaults and getattr(args, dest, None) != defaults[dest]:
            raise UsageError(f"{flag} belongs to planning from a cost table (--costs); with --model {instead}")
    return True


_SEARCHED = "(or leave it to the search)"
_FROM_CONFIG = "the model config says which layers are tensor-parallel"
_FROM_HARDWARE = "the links come from --hardware (a pipeloom.hardware/1 file for others)"
_NOTHING_TO_MEASURE = "there is nothing to measure here; plan, --save, then run the plan"
_COST_TABLE_ONLY = {
    "ranks": ("--ranks", "give the job's GPUs with --gpus N"),
    "data_parallel": ("--data-parallel", f"fix it with --layout dp=N {_SEARCHED}"),
    "tensor_parallel": ("--tp", f"fix it with --layout tp=N {_SEARCHED}"),
    "heads": ("--heads", "the heads come from the model config"),
    **{dest: (flag, _FROM_CONFIG) for dest, flag in (("tp_layers", "--tp-layers"), ("tp_column", "--tp-column"),
                                                     ("tp_row", "--tp-row"), ("tp_head_norm", "--tp-head-norm"))},
    "sharding": ("--sharding", f"fix it with --layout fsdp=0|1 {_SEARCHED}"),
    "dp_latency": ("--dp-latency", _FROM_HARDWARE),
    "dp_bandwidth": ("--dp-bandwidth", _FROM_HARDWARE),
    "stages_per_rank": ("--stages-per-rank", f"fix it with --layout vp=N {_SEARCHED}"),
    "microbatches": ("--microbatches", f"fix the sequences per micro-batch with --layout mbs=N {_SEARCHED}"),
    "search": ("--search", "the schedules are priced by the simulator; there is no CP-SAT pass"),
    "time_limit": ("--time-limit", "the search runs to the end (bounds prune it)"),
    "out": ("--out", "there is no timeline picture; --json prints the whole answer"),
    "server": ("--server", "plan here"),
    **{dest: (flag, _NOTHING_TO_MEASURE) for dest, flag in (
        ("try_k", "--try"), ("build", "--build"), ("loss", "--loss"), ("arg", "--arg"), ("try_spread", "--try-spread"),
        ("try_steps", "--try-steps"), ("try_seconds", "--try-seconds"))},
}
"""The cost-table mode's flags (argparse dest -> the flag, what --model offers instead)."""


def _check_memory_limit(limit: float | None, per: str) -> None:
    """UsageError for a limit above any GPU's memory (80TB for 80GB); one without its unit is refused as read."""
    if limit is not None and limit > 2**44:  # 80TB for 80GB had planned 119 GiB a GPU as fitting "74,506 GiB"
        raise UsageError(f"--memory-limit is {limit / 2**30:,.0f} GiB per {per}, more than any GPU holds (16 TiB); "
                         "check its unit (80GiB)")


def check_export(args: argparse.Namespace, options: dict) -> None:
    """UsageError where ``--export torchtitan`` would drop what the plan is priced with (the export writes none of
    these, and torchtitan runs its own: fp32 gradient reduces, PyTorch's SDPA, a torch optimizer's fp32 moments,
    gradients whole under a pipeline, sequence parallelism, reduces beside the backward; async tensor parallelism
    only compiled), or where it is priced as another framework runs it."""
    if not args.export:
        return
    if args.export == "megatron":
        _check_megatron_export(args, options)
        return
    if args.framework not in (None, "torchtitan"):
        raise UsageError(f"--export torchtitan prices the plan as torchtitan runs it, not as --framework "
                         f"{args.framework}; drop --framework (or use --framework torchtitan)")
    if options.get("tp_overlap") and options.get("kernels") != "fused":
        raise UsageError("torchtitan runs its async tensor parallelism (--tp-overlap) only under torch.compile: add "
                         "--kernels fused (the export then writes compile.enable), or drop --tp-overlap")
    unsaid = [(flag, what) for flag, what, on in (
        (f"--recompute-layers {options['recompute_layers']}", "recomputation depth", options["recompute_layers"]),
        ("--dtype fp8", "float8", options["dtype"] == "fp8"),
        ("--grad-reduce bf16", "bf16 gradient reduce (torchtitan reduces in fp32 only)",
         options.get("grad_reduce") == "bf16"),
        (f"--attention {options.get('attention')}", "attention kernel (torchtitan runs PyTorch's SDPA: flash2)",
         options.get("attention") not in (None, "flash2")),
        ("--adam-moments bf16", "optimizer moment dtype (torch's AdamW keeps fp32 moments)",
         options["adam_moments"] == "bf16"),
        ("--shard-gradients", "gradient sharding (torch's pipelining holds them whole to the step's end)",
         options["shard_gradients"]),
        ("--no-sequence-parallel", "tensor parallelism without sequence parallelism", not options["sequence_parallel"]),
        ("--no-overlap-grad-reduce", "exposed gradient reduce", not options["overlap_grad_reduce"])) if on]
    if unsaid:
        raise UsageError(f"cannot export for torchtitan a plan priced with {' and '.join(f for f, _ in unsaid)}: the "
                         f"export writes no {'; no '.join(w for _, w in unsaid)}; plan without "
                         f"{'it' if len(unsaid) == 1 else 'them'} for the export")


def _check_megatron_export(args: argparse.Namespace, options: dict) -> None:
    """UsageError where ``--export megatron`` cannot carry what the plan would be priced with
    (:func:`pipeloom.plan.export.megatron.unwritten`), or where it is priced as torchtitan runs it."""
    from pipeloom.plan.export.megatron import unwritten

    if args.framework == "torchtitan":
        raise UsageError("--export megatron writes Megatron-LM's arguments, and --framework torchtitan prices the plan "
                         "as torchtitan runs it; drop --framework (or use --framework megatron-bridge)")
    unsaid = unwritten(options)
    if unsaid:
        raise UsageError(f"cannot export for Megatron-LM a plan priced with {' and '.join(unsaid)}; plan without "
                         f"{'it' if len(unsaid) == 1 else 'them'} for the export")


def framework_options(args: argparse.Namespace) -> dict:
    """The framework choices to price: each flag given, else --framework's, else the planner's default (the
    choices a preset sets are pipeloom.plan.cluster.api.FRAMEWORKS' keys; each has its flag of the same name), and
    with --framework only the schedules it runs (pipeloom.plan.cluster.layout.FRAMEWORK_SCHEDULES)."""
    from pipeloom.plan.cluster import api

    preset = api.framework_options(args.framework, dtype=args.dtype) if args.framework else {}
    keys = {key for choices in api.FRAMEWORKS.values() for key in choices}
    schedules = _schedules(args)
    return {key: getattr(args, key, None) if getattr(args, key, None) is not None else preset[key]
            for key in sorted(keys) if getattr(args, key, None) is not None or key in preset} | (
        {"schedules": schedules} if schedules else {})


def _schedules(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The schedules to search: ``--schedules`` (those the cluster planner prices and ``--framework`` runs), else
    ``--framework``'s but those searched only where named (``ON_REQUEST``, unless ``--layout`` fixes one); None:
    the planner's default."""
    from pipeloom.plan.cluster.api import parse_layout
    from pipeloom.plan.cluster.layout import FRAMEWORK_SCHEDULES, ON_REQUEST, SCHEDULES

    runs = FRAMEWORK_SCHEDULES[args.framework] if args.framework else tuple(SCHEDULES)
    if args.schedules is None:
        try:
            fixed = parse_layout(args.layout).get("schedule") if args.layout else None
        except PipeloomError:  # the plan says what is wrong with --layout
            fixed = None
        return tuple(name for name in runs if name not in ON_REQUEST or name == fixed) if args.framework else None
    names = schedule_list(args.schedules, f"the cluster planner prices {', '.join(SCHEDULES)}",
                          among=tuple(SCHEDULES))
    unpriced = [name for name in names if name not in SCHEDULES]
    if unpriced:
        raise UsageError(f"--schedules: the cluster planner does not price {', '.join(unpriced)} (it prices "
                         f"{', '.join(SCHEDULES)}); pipeloom plan --costs searches every built-in schedule")
    off = [name for name in names if name not in runs]
    if off:
        raise UsageError(f"--schedules: {args.framework} does not run {', '.join(off)} (it runs {', '.join(runs)}); "
                         "drop --framework or those schedules")
    return tuple(names)
