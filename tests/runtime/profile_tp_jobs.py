"""What each spawned rank runs in the tests of profiling tensor-parallel stages in the engine: a small GPT-like
model whose layers are Megatron column->row (a fused, head-major q/k/v projection, so a column shard holds whole
heads) profiled by ``profile_in_engine`` on a ("pp", "tp") mesh (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 16
HEAD_DIM = 4
HEADS = HIDDEN // HEAD_DIM
SEQ = 6
FEATURES = 8
CLASSES = 5
MICROBATCHES = 2
BATCH = 2 * MICROBATCHES  # 2 samples per micro-batch


class Attention(nn.Module):
    """Self-attention with one fused projection laid out head by head ((heads, 3, head_dim) columns): a
    column-parallel shard of it holds whole heads, their q, k and v, so heads come from the local width."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, HIDDEN) -> (B, T, HIDDEN)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, -1, 3, HEAD_DIM).permute(3, 0, 2, 1, 4)  # each (B, heads, T, HEAD_DIM)
        att = torch.softmax(q @ k.transpose(-2, -1) / HEAD_DIM ** 0.5, dim=-1) @ v
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    """Pre-norm transformer layer: attention and a 4x MLP, each around a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Input projection, ``layers`` layers, a classifier per position: pieces embed, layers.k, head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def megatron_plan() -> dict:
    """Megatron's column->row plan for GPT's layers, as torch's parallelize_module takes it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.attn.qkv": ColwiseParallel(), "layers.*.attn.proj": RowwiseParallel(),
            "layers.*.mlp.0": ColwiseParallel(), "layers.*.mlp.2": RowwiseParallel()}


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, CLASSES), target.reshape(-1))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, SEQ, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (BATCH, SEQ), generator=generator))


def profile_tp_job(rank: int, world: int) -> dict:
    """``profile_in_engine`` on a (pp world/2, tp 2) mesh: the table's JSON, and whether the user's model was
    left as it was (no DTensor parameter, no gradient)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.plan.costs.file import costs_to_json
    from pipeloom.profile.in_engine import profile_in_engine

    torch.manual_seed(0)
    model = GPT()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "tp"))
    x, y = batch()
    table = profile_in_engine(model, x, loss_fn=loss_fn, target=y, microbatches=MICROBATCHES, mesh=mesh,
                              tp_plan=megatron_plan(), heads=HEADS, warmup_steps=1, steps=2, exchange=False)
    return {"table": costs_to_json(table),
            "plain": all(type(p) is nn.Parameter for p in model.parameters()),
            "no_grads": all(p.grad is None for p in model.parameters())}


def refused_job(rank: int, world: int) -> list[str]:
    """The errors of tensor-parallel profiling requests that cannot run."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.plan.errors import PlanError
    from pipeloom.profile.in_engine import profile_in_engine

    model = GPT()
    x, y = batch()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    other = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    found = []
    for keywords in ({"mesh": mesh, "heads": HEADS}, {"mesh": mesh, "tp_plan": megatron_plan()},
                     {"mesh": other, "tp_plan": megatron_plan(), "heads": HEADS},
                     {"mesh": mesh, "tp_plan": megatron_plan(), "heads": 3}):
        try:
            profile_in_engine(model, x, loss_fn=loss_fn, target=y, microbatches=MICROBATCHES, **keywords)
        except PlanError as error:
            found.append(str(error))
    # every rank ends its refusals before any leaves: rank 0's process hosts the store that the other rank's
    # sub-groups of init_device_mesh still connect through (a fast rank 0 left it half-built once, under load)
    torch.distributed.barrier()
    return found


# ------------------------------------------------------------------ `pipeloom profile --in-engine --tp 2`

def build_model() -> GPT:
    """FUNCTION of the CLI test (seeded: every rank builds the same model)."""
    torch.manual_seed(0)
    return GPT()


def example_inputs(model: GPT, batch: int, seq: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(batch, SEQ, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (batch, SEQ), generator=generator))


def plan_of(model: GPT) -> dict:
    """``--tp-plan plan_of``."""
    return megatron_plan()


def profile_cli_job(rank: int, world: int, out: str) -> tuple[int, str]:
    """``pipeloom profile ... --in-engine --tp 2`` on every rank of an already started group: its exit code
    and what it printed."""
    import contextlib
    import io

    from pipeloom.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = main(["profile", f"{__file__}:build_model", "--batch", "2", "--loss", "loss_fn", "--in-engine",
                     "--microbatches", str(MICROBATCHES), "--warmup", "1", "--repeats", "2", "--tp", "2",
                     "--tp-plan", "plan_of", "--heads", str(HEADS), "--save", out])
    return code, printed.getvalue()
