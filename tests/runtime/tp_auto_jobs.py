"""What each spawned rank runs in the tests of ``tp_plan="auto"`` and of sequence parallelism: a transformer
whose attention and MLP are modules of their own and take the sequence length from their projections (so a
sequence-sharded residual stream works), pipelines over a (pp, tp) mesh next to the same plan run by torch
without pipelining, and collectives counted with torch's CommDebugMode (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeloom.runtime import Failures, Parallelism, Tracing

VOCAB = 32
HIDDEN = 16
SEQ = 8
MICROBATCHES = 4
STEPS = 2
SPLITS = ["layers.1"]


class Attention(nn.Module):
    """Heads inferred from the local width and the sequence length from q's output, not from the input:
    under sequence parallelism the input is sequence-sharded and q's output whole."""

    def __init__(self, hidden: int, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(h), self.k(h), self.v(h)  # (B, T, local width)
        b, t, _ = q.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1) @ v  # (B, heads, T, hd)
        return self.out(att.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, hidden), or (B, T/tp, hidden) with SP
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and a language-model head."""

    def __init__(self, layers: int = 4, hidden: int = HIDDEN, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(layers: int = 2) -> LM:
    torch.manual_seed(0)
    return LM(layers).double()


def batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
            torch.randint(0, VOCAB, (rows, SEQ), generator=generator))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def parallel_loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Vocabulary-sharded logits (a DTensor) into torch's loss_parallel cross-entropy."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _local(tensor) -> object:
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.detach().cpu().clone().numpy()


def train(params, steps: int, step_fn) -> dict:
    """``steps`` SGD steps: per step the loss, the local gradients by name, the parameters without one."""
    optimizer = torch.optim.SGD([p for _, p in params()], lr=0.1)
    out: dict = {"loss": [], "local": [], "missing": []}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out["loss"].append(float(step_fn(*batch(step))))
        named = list(params())
        out["missing"].append([name for name, p in named if p.grad is None])
        out["local"].append({name: _local(p.grad) for name, p in named if p.grad is not None})
        optimizer.step()
    return out


def alone(model: nn.Module, tp_mesh, plan: dict, steps: int, loss=loss_fn) -> dict:
    """The plan run by torch without pipelining: ``parallelize_module``, then every micro-batch's loss / M
    backward in order (under loss_parallel for a DTensor loss)."""
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    if plan:
        model = parallelize_module(model, tp_mesh, plan)

    def step_fn(x, y):
        total = 0.0
        for xm, ym in zip(torch.chunk(x, MICROBATCHES), torch.chunk(y, MICROBATCHES)):
            value = loss(model(xm), ym) / MICROBATCHES
            if hasattr(value, "full_tensor"):
                with loss_parallel():
                    value.backward()
                value = value.full_tensor()
            else:
                value.backward()
            total += float(value.detach())
        return total

    return train(model.named_parameters, steps, step_fn)


def piped(model: nn.Module, mesh, tp_plan, schedule: str, steps: int, loss=loss_fn,
          example_inputs=None) -> tuple[dict, object]:
    """``steps`` steps of ``pipeline(model, mesh=, tp_plan=)`` cut before ``layers.2``; (results, engine)."""
    from pipeloom.runtime import pipeline

    engine = pipeline(
        model,
        schedule=schedule,
        split_points=SPLITS,
        microbatches=MICROBATCHES,
        loss_fn=loss,
        tracing=Tracing(example_inputs=example_inputs),
        parallel=Parallelism(mesh=mesh, tp_plan=tp_plan),
        failures=Failures(timeout=30),
    )
    found = train(engine.named_parameters, steps, lambda x, y: engine.step(x, target=y))
    engine.close()
    return found, engine


def count(model: nn.Module, tp_mesh, plan: dict, rows: int, loss=loss_fn) -> dict:
    """Collectives of one forward (with the loss) and one backward of ``model`` under ``plan``: torch's
    CommDebugMode totals by kind and pipeloom's (kind, whole-tensor bytes) records."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from pipeloom.profile.collectives import CollectiveCounter

    model = parallelize_module(model, tp_mesh, plan)
    x, y = batch(0, rows)
    found = {}
    for phase in ("F", "B"):
        with CommDebugMode() as debug, CollectiveCounter() as counter:
            if phase == "F":
                value = loss(model(x), y)
            elif hasattr(value, "full_tensor"):
                with loss_parallel():
                    value.backward()
            else:
                value.backward()
        counts = {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()}
        found[phase] = {"torch": counts, "records": sorted(counter.records)}
    return found




def choices_plan(choice: dict) -> dict:
    """torch's plan for ``choice`` (region -> option) over LM's regions, as the search's recipe gives it."""
    from pipeloom.plan.tp.sharding import recipe_for
    from pipeloom.runtime.parallel.tp import recipe_styles
    from pipeloom.runtime.parallel.tp_auto import find_regions

    return recipe_styles(recipe_for(choice, find_regions(build()).modules))


def auto_job(rank: int, world: int, limit: float) -> dict:
    """pp 2 x tp 2: ``tp_plan="auto"`` without a memory limit, and ``AutoPlan(memory_limit=limit)``, each
    ``STEPS`` steps of 1f1b next to its chosen plan run by torch without pipelining; what each chose."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeloom.runtime.parallel.tp_auto import AutoPlan, auto_tp_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    example = (batch(0)[0],)
    out: dict = {}
    for name, option in (("free", "auto"), ("bound", AutoPlan(memory_limit=limit))):
        found, engine = piped(build(), mesh, option, "1f1b", STEPS, example_inputs=example)
        sharding = engine.tp_sharding
        predicted = auto_tp_plan(build(), mesh, microbatches=MICROBATCHES, example_inputs=example, options=option)
        out[name] = {"pipeline": found, "alone": alone(build(), mesh["tp"], sharding.plan, STEPS),
                     "choice": sharding.result.choice, "memory": sharding.predicted_memory,
                     "sharded": sorted(n for n, p in engine.named_parameters() if hasattr(p, "to_local")),
                     "time": sharding.predicted_step_time, "plan": sorted(sharding.plan),
                     "same_as_function": predicted.result.choice == sharding.result.choice
                     and predicted.predicted_memory == sharding.predicted_memory}
    return out


SP_CHOICE = {"embedding": "vocab", "attention": "megatron-sp", "mlp": "megatron-sp", "head": "vocab"}
LOSS_CHOICE = {"embedding": "vocab", "attention": "megatron-sp", "mlp": "megatron-sp", "head": "vocab-loss"}
MEGATRON_LOSS_CHOICE = {"embedding": "vocab", "attention": "megatron", "mlp": "megatron", "head": "vocab-loss"}


def sp_job(rank: int, world: int, count_rows: int) -> dict:
    """pp 2 x tp 2: the sequence-parallel recipe under 1f1b and zb-h1, the SP recipe with a loss-parallel head
    and the Megatron one with a loss-parallel head under 1f1b, each next to its plan run by torch without
    pipelining; and the collectives of one forward and backward of a one-block LM under each (tp group)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    cases = [("sp", SP_CHOICE, "1f1b", loss_fn), ("sp", SP_CHOICE, "zb-h1", loss_fn),
             ("loss", LOSS_CHOICE, "1f1b", parallel_loss_fn), ("megatron-loss", MEGATRON_LOSS_CHOICE, "1f1b",
                                                                 parallel_loss_fn)]
    out: dict = {"alone": {}, "counts": {}}
    for name, choice, schedule, loss in cases:
        if name not in out["alone"]:
            out["alone"][name] = alone(build(), mesh["tp"], choices_plan(choice), STEPS, loss)
            out["counts"][name] = count(build(1), mesh["tp"], choices_plan(choice), count_rows, loss)
        out[name, schedule] = piped(build(), mesh, choices_plan(choice), schedule, STEPS, loss)[0]
    return out


def llama_auto_job(rank: int, world: int, fraction: float) -> dict:
    """pp 1 x tp 2: tiny random-init LLaMA (float64, one stage per rank: the model itself) with
    ``AutoPlan(memory_limit=fraction x the memory of replicating it)``, 2 steps of 2 micro-batches, next to the
    chosen plan run by torch without pipelining."""
    from hf_models import build_hf, lm_loss, tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from pipeloom.runtime import pipeline
    from pipeloom.runtime.parallel.tp_auto import AutoPlan, auto_tp_plan

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    x, y = tokens()
    free = auto_tp_plan(build_hf("llama").double(), mesh, microbatches=2, example_inputs=(x,))
    whole = build_hf("llama").double()
    engine = pipeline(
        whole,
        stages=[whole],
        schedule="1f1b",
        microbatches=2,
        loss_fn=lm_loss,
        tracing=Tracing(example_inputs=(x,)),
        parallel=Parallelism(mesh=mesh, tp_plan=AutoPlan(memory_limit=fraction * free.predicted_memory)),
        failures=Failures(timeout=30),
    )
    sharding = engine.tp_sharding
    out = {"choice": sharding.result.choice, "free": free.result.choice, "plan": sorted(sharding.plan),
           "sharded": sorted(n for n, p in engine.named_parameters() if hasattr(p, "to_local"))}
    out["pipeline"] = train(engine.named_parameters, STEPS, lambda *_: engine.step(x, target=y))
    engine.close()
    model = parallelize_module(build_hf("llama").double(), mesh["tp"], sharding.plan)

    def step_fn(*_):
        total = 0.0
        for xm, ym in zip(torch.chunk(x, 2), torch.chunk(y, 2)):
            value = lm_loss(model(xm), ym) / 2
            value.backward()
            total += float(value.detach())
        return total

    out["alone"] = train(model.named_parameters, STEPS, step_fn)
    return out
