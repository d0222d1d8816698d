"""Train a small GPT with pipeloom: the same script and the same losses on one rank or many.

    python examples/train_gpt.py --steps 20
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20 --schedule zbv
    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20 --dp 2 --meta

Both print ``step k loss X`` with X in full precision (``repr``), bit for bit the same: the engine's
gradients equal the single-device ones exactly (docs/design.md §5). Ranks use gloo on CPU, or NCCL with one
GPU per rank when CUDA is available. The tokens are synthetic and deterministic: each sequence
counts up from a random token in a random stride (``x[t+1] = x[t] + k mod vocab``), a pattern the
model learns within a few dozen steps, so the loss visibly falls from about ln(vocab).

``--dp N`` runs N pipelines side by side (a ``DeviceMesh`` of N replicas × world/N stages ranks), each
on its share of the batch; its losses equal the one-rank ones to rounding (the replicas' gradients are
summed in another order). ``--meta`` builds the model on the meta device: each rank allocates and
initialises only its own pieces. Every module is initialised from a seed of its own name
(:func:`init_module`), so ``--meta`` and a whole-model build hold the same weights.
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

import pipeloom.runtime as rt
from pipeloom import Schedule, build_schedule, load_schedule
from pipeloom.runtime import Parallelism, Weights
from pipeloom.schedules import REGISTRY

__all__ = ["GPT", "GPTConfig", "build_model", "init_module", "lm_loss", "main", "synthetic_batch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Sizes of the model."""

    vocab: int = 64  # token ids 0..vocab-1
    seq_len: int = 32  # tokens per sequence (the longest the model accepts)
    width: int = 64  # features of the residual stream
    heads: int = 4  # attention heads; width must be a multiple
    layers: int = 8  # transformer blocks; at least the number of pipeline stages

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}; change one of them")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t, written with plain ops."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.width = config.heads, config.width // config.heads, config.width
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.size(0), x.size(1)  # x: (batch, seq, width)
        q, k, v = self.qkv(x).split(self.width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (batch, heads, seq, seq)
        # built per call from the traced sizes (torch.fx cannot slice a buffer by a traced size)
        future = scores.new_ones(seq, seq, dtype=torch.bool).triu(diagonal=1)  # key position > query
        scores = scores.masked_fill(future, float("-inf"))
        mixed = scores.softmax(dim=-1) @ v  # (batch, heads, seq, head_dim)
        return self.proj(mixed.transpose(1, 2).reshape(batch, seq, self.width))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a 4x GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(nn.Linear(config.width, 4 * config.width), nn.GELU(),
                                 nn.Linear(4 * config.width, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token embedding + learned positions, ``layers`` blocks, final LayerNorm and an LM head.

    (batch, seq) token ids -> (batch, seq, vocab) logits. Split points are ``blocks.k``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab, config.width)
        self.position_embedding = nn.Parameter(0.02 * torch.randn(1, config.seq_len, config.width))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.position_embedding[:, : tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(*, layers: int = 8, width: int = 64, heads: int = 4, vocab: int = 64, seq_len: int = 32,
                seed: int = 0, meta: bool = False) -> GPT:
    """The example's model, the same on every rank that calls it with the same arguments. ``meta``: its
    tensors on the meta device (no values; the engine allocates and initialises each rank's pieces)."""
    with torch.device("meta" if meta else "cpu"):
        model = GPT(GPTConfig(vocab=vocab, seq_len=seq_len, width=width, heads=heads, layers=layers))
    if not meta:
        init = init_module(model, seed)
        for module in model.modules():
            init(module)
    return model


def init_module(model: nn.Module, seed: int) -> Callable[[nn.Module], None]:
    """``init(module)``: (re)initialise ``module``'s own tensors from a seed of (``seed``, its name in
    ``model``), so a module gets the same values whichever rank initialises it, and whenever."""
    names = {id(module): name for name, module in model.named_modules()}

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(names[id(module)].encode()))
        if isinstance(module, GPT):
            module.position_embedding.normal_(0.0, 0.02)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return init


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (batch, seq, vocab), targets (batch, seq)."""
    return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(step: int, *, batch: int, seq_len: int, vocab: int, seed: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, (batch, seq_len) each, the same for a given (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab  # (batch, seq_len + 1)
    return tokens[:, :-1], tokens[:, 1:]


def load_or_build(schedule: str, *, ranks: int, microbatches: int, options: dict) -> Schedule:
    """The schedule the engine will run: a built-in name, or a saved .json / .csv file.

    Exits with one line naming the problem when the schedule cannot be had for this launch.
    """
    try:
        if schedule.lower().endswith((".json", ".csv")):
            return load_schedule(schedule)
        return build_schedule(schedule, ranks, microbatches, **options)
    except ValueError as error:  # PipeloomError is a ValueError, and so are the generators' input checks
        raise SystemExit(f"train_gpt: schedule {schedule!r} on {ranks} rank(s): {error}") from None


def even_split_points(layers: int, stages: int) -> list[str]:
    """Split points ``blocks.k`` cutting ``layers`` blocks into ``stages`` nearly equal runs."""
    if stages > layers:
        raise SystemExit(f"train_gpt: the schedule needs {stages} stages but the model has {layers} blocks; "
                         f"pass --layers {stages} or more")
    return [f"blocks.{(s * layers) // stages}" for s in range(1, stages)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="built-in name, or a saved .json/.csv schedule")
    parser.add_argument("--stages-per-rank", type=int, default=2,
                        help="stages per rank for the looped schedules (interleaved-1f1b, interleaved-zb, looped-bfs)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=8,
                        help="micro-batches per step of each pipeline (a saved schedule's own count wins)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", metavar="DIR", help="write per-rank action timings to DIR")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (divides the ranks)")
    parser.add_argument("--meta", action="store_true",
                        help="build the model on the meta device; each rank allocates only its pieces")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same arithmetic on 1 rank and on N (and N ranks share the cores)
    group, device = rt.init_ranks()  # torchrun's group (gloo on CPU, NCCL per GPU), or one rank
    world = dist.get_world_size() if group is not None else 1
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"train_gpt: --dp {args.dp} does not divide the {world} rank(s)")
    ranks = world // args.dp  # of one pipeline
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, ranks), mesh_dim_names=("dp", "pp"))
    info = REGISTRY.get(args.schedule)
    options = {"stages_per_rank": args.stages_per_rank} if info and "stages_per_rank" in info.options else {}
    schedule = load_or_build(args.schedule, ranks=ranks, microbatches=args.microbatches, options=options)
    stages = rt.model_pieces(schedule)  # stages over replicas (dualpipe and chimera hold two)
    model = build_model(layers=args.layers, seed=args.seed, meta=args.meta)
    engine = rt.pipeline(  # the schedule built or loaded above, so it is not built twice
        model,
        schedule=schedule,
        loss_fn=lm_loss,
        split_points=even_split_points(args.layers, stages),
        device=device,
        record=args.trace,
        parallel=Parallelism(mesh=mesh),
        weights=Weights(init_weights=init_module(model, args.seed) if args.meta else None),
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=args.lr)
    for step in range(args.steps):
        inputs, targets = synthetic_batch(step, batch=args.batch, seq_len=model.position_embedding.size(1),
                                          vocab=model.head.out_features, seed=args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = engine.step(inputs.to(device), target=targets.to(device))
        optimizer.step()
        if group is None or dist.get_rank() == 0:
            print(f"step {step} loss {float(loss)!r}", flush=True)
    engine.close()  # ends the engine's helper threads before torch's teardown
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
