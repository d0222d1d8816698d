"""Train an unchanged Hugging Face ``transformers`` model with pipeloom: the same losses on one rank or many.

    python examples/train_hf.py --model gpt2 --steps 10
    torchrun --nproc-per-node 2 examples/train_hf.py --model gpt2 --schedule zbv --steps 10
    torchrun --nproc-per-node 4 examples/train_hf.py --model llama --dp 2 --pieces 2 --schedule 1f1b --meta

The model comes from a tiny random-init config (no downloads) and is cut at its transformer blocks by
module name (``transformer.h.2``, ``model.layers.2``...), traced with ``torch.export`` (``torch.fx``
cannot trace these models). Dropout stays on (``--dropout``): every piece's forward of every
micro-batch draws from a generator seeded by (seed, step, piece, micro-batch), so with the same
``--pieces`` every launch prints the same ``step k loss X`` lines, bit for bit. GPT-2, BERT and Qwen2
tie the LM head to the embedding; pipeloom keeps the tied weight on every rank that uses it. Gradients
are clipped by their global norm over all ranks (``engine.clip_grad_norm_``), as on one device.

``--dp N`` runs N pipelines side by side on a ``DeviceMesh``, each on its share of the batch (losses equal
to rounding). ``--meta`` builds the model on the meta device and lets each rank allocate and initialise
only its pieces: every module is initialised by the model's own ``_init_weights`` from a seed of its
name (:func:`init_module`), so ``--meta`` and a whole-model build hold the same weights.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeloom.runtime as rt
from pipeloom import load_schedule
from pipeloom.errors import PipeloomError
from pipeloom.runtime import Parallelism, Tracing, Weights

__all__ = ["BLOCKS", "build_model", "init_module", "lm_loss", "main", "synthetic_batch"]

BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer", "qwen2": "model.layers"}
"""Where each model keeps its transformer blocks: split points are ``{BLOCKS[model]}.{k}``."""

MASK_RATE = 0.15  # BERT: share of input tokens replaced by the mask token


def build_model(name: str, *, layers: int = 4, width: int = 64, vocab: int = 128, dropout: float = 0.1,
                seed: int = 0, meta: bool = False) -> torch.nn.Module:
    """A tiny random-init model of the family ``name``, the same on every rank (same arguments); with
    ``meta`` its tensors are on the meta device (the engine allocates and initialises each rank's pieces)."""
    with torch.device("meta" if meta else "cpu"):
        model = _construct(name, layers=layers, width=width, vocab=vocab, dropout=dropout)
    if not meta:
        init = init_module(model, seed)
        for module in model.modules():
            init(module)
    return model


def init_module(model: torch.nn.Module, seed: int) -> Callable[[torch.nn.Module], None]:
    """``init(module)``: the model's own ``_init_weights(module)`` under a seed of (``seed``, the module's
    name), so a module gets the same values whichever rank initialises it."""
    names = {id(module): name for name, module in model.named_modules()}

    @torch.no_grad()
    def init(module: torch.nn.Module) -> None:
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(names[id(module)].encode()))
        model._init_weights(module)

    return init


def _construct(name: str, *, layers: int, width: int, vocab: int, dropout: float) -> torch.nn.Module:
    """LLaMA and Qwen2 use eager attention: with SDPA, transformers skips the causal mask when the model
    runs untraced but builds it under tracing, so the untraced model would run another kernel."""
    import transformers as T

    common = dict(vocab_size=vocab, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=256,
                                              resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                              **common))
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                                intermediate_size=2 * width, num_attention_heads=4,
                                                num_key_value_heads=2, attention_dropout=dropout,
                                                attn_implementation="eager", **common))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=layers, hidden_size=width,
                                                intermediate_size=2 * width, num_attention_heads=4,
                                                num_key_value_heads=2, tie_word_embeddings=True,
                                                attention_dropout=dropout, attn_implementation="eager", **common))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(num_hidden_layers=layers, hidden_size=width,
                                              intermediate_size=2 * width, num_attention_heads=4,
                                              hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                              vocab_size=vocab, pad_token_id=0))
    raise SystemExit(f"train_hf: unknown --model {name!r}; choose one of {', '.join(BLOCKS)}")


def lm_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the ModelOutput's logits (batch, seq, vocab) against targets (batch, seq);
    positions marked -100 (BERT's unmasked tokens) do not count."""
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def synthetic_batch(model: str, step: int, *, batch: int, seq_len: int, vocab: int, seed: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (``x[t+1] = x[t] + k mod vocab``), the same for a given (seed, step).

    Causal models predict the next token; BERT recovers the tokens replaced by the mask token."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(1, vocab - 1, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = 1 + (start + stride * torch.arange(seq_len + 1)) % (vocab - 2)  # ids 1..vocab-2
    if model != "bert":
        return tokens[:, :-1], tokens[:, 1:]
    tokens = tokens[:, :-1]
    masked = torch.rand(tokens.shape, generator=generator) < MASK_RATE
    masked[:, 0] = True  # at least one position per sequence counts
    inputs = tokens.masked_fill(masked, vocab - 1)
    return inputs, tokens.masked_fill(~masked, -100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=sorted(BLOCKS))
    parser.add_argument("--schedule", default="interleaved-1f1b",
                        help="built-in name or a saved .json/.csv schedule; it must run --pieces pieces")
    parser.add_argument("--pieces", type=int, default=4,
                        help="model pieces (the same on every launch, so the random numbers are too)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (a multiple of --pieces)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of each pipeline")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (divides the ranks)")
    parser.add_argument("--meta", action="store_true",
                        help="build the model on the meta device; each rank allocates only its pieces")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pieces < 1 or args.layers % args.pieces:
        raise SystemExit(f"train_hf: --layers {args.layers} is not a multiple of --pieces {args.pieces}")
    torch.set_num_threads(1)  # the same arithmetic on 1 rank and on N (and N ranks share the cores)
    group, device = rt.init_ranks()  # torchrun's group (gloo on CPU, NCCL per GPU), or one rank
    world = dist.get_world_size() if group is not None else 1
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"train_hf: --dp {args.dp} does not divide the {world} rank(s)")
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "pp"))
    model = build_model(args.model, layers=args.layers, dropout=args.dropout, seed=args.seed, meta=args.meta)
    step_size = args.layers // args.pieces
    split_points = [f"{BLOCKS[args.model]}.{k}" for k in range(step_size, args.layers, step_size)]
    vocab = model.config.vocab_size
    batches = [synthetic_batch(args.model, step, batch=args.batch, seq_len=args.seq, vocab=vocab, seed=args.seed)
               for step in range(args.steps)]
    schedule = args.schedule
    if schedule.lower().endswith((".json", ".csv")):
        schedule = load_schedule(schedule)
    try:
        engine = rt.pipeline(
            model,
            schedule=schedule,
            split_points=split_points,
            loss_fn=lm_loss,
            microbatches=args.microbatches,
            device=device,
            seed=args.seed,
            tracing=Tracing(example_inputs=(batches[0][0],)),
            parallel=Parallelism(mesh=mesh),
            weights=Weights(init_weights=init_module(model, args.seed) if args.meta else None),
        )
    except PipeloomError as error:
        raise SystemExit(f"train_hf: {error}") from None
    optimizer = torch.optim.AdamW(engine.parameters(), lr=args.lr)
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = engine.step(inputs.to(device), target=targets.to(device))
        if args.clip > 0:
            engine.clip_grad_norm_(args.clip)
        optimizer.step()
        if group is None or dist.get_rank() == 0:
            print(f"step {step} loss {float(loss)!r}", flush=True)
    engine.close()  # ends the engine's helper threads before torch's teardown
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
