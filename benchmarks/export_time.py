"""How long pipeloom's torch.export takes with the settings it exports under (``export_env.EXPORT_SETTINGS``) against
torch's defaults, side by side in one run, and whether both give the same graph.

For each model (the tiny transformers models of the test suite, or any ``--models`` of ``tests/runtime/hf_models``
and ``tests/runtime/ep_jobs``) it exports ``--repeats`` times with each setting, alternating (one warm-up export
first), every input dimension ``Dim.AUTO`` as the runtime exports, and prints the mean seconds of each, their ratio
and whether the two graphs hold the same operations on the same arguments (node names aside).

Run: ``python benchmarks/export_time.py [--models gpt2 llama qwen3_moe deepseek_v3] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime")]

import torch  # noqa: E402
from torch.export import Dim  # noqa: E402

from pipeloom.runtime.model.export_env import export_settings  # noqa: E402

MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss")


def _model(name: str) -> torch.nn.Module:
    if name in MOE:
        from ep_jobs import build_moe
        return build_moe(name)
    from hf_models import build_hf
    return build_hf(name)


def _export(model: torch.nn.Module, tokens: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(model, (tokens,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},), strict=False)


def _structure(exported: torch.export.ExportedProgram) -> list[tuple]:
    """The graph's operations in order, each with its arguments (other nodes by position): names left out."""
    index: dict[torch.fx.Node, int] = {}

    def arg(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            return ("node", index[value])
        if isinstance(value, (list, tuple)):
            return tuple(arg(v) for v in value)
        return repr(value)

    found = []
    for position, node in enumerate(exported.graph.nodes):
        index[node] = position
        found.append((node.op, str(node.target), arg(node.args), tuple(sorted((k, arg(v)) for k, v in
                                                                            node.kwargs.items()))))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokens = torch.randint(1, 96, (8, 12), generator=torch.Generator().manual_seed(1))
    print(f"torch {torch.__version__}; {args.repeats} exports each, alternating, after one warm-up")
    print(f"{'model':<12} {'torch defaults s':>17} {'pipeloom s':>11} {'ratio':>6}  same graph")
    for name in args.models:
        torch.manual_seed(0)
        model = _model(name)
        _export(model, tokens)
        plain: list[float] = []
        ours: list[float] = []
        graphs = {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            graphs["plain"] = _export(model, tokens)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            with export_settings():
                graphs["ours"] = _export(model, tokens)
            ours.append(time.perf_counter() - start)
        same = _structure(graphs["plain"]) == _structure(graphs["ours"])
        a, b = statistics.mean(plain), statistics.mean(ours)
        print(f"{name:<12} {a:>17.2f} {b:>11.2f} {b / a:>6.2f}  {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
