"""Writing and printing the cost table ``pipeloom profile`` measured: ``--save``, ``--json`` or a table per
piece, the shared parameters and the tensor-parallel profile."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipeloom.cli.outputs import report_console, target

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["print_tensor", "show"]


def show(table, args: argparse.Namespace) -> None:
    """Save the table (``--save``), then print it: its JSON (``--json``) or a table per piece."""
    from pipeloom.plan.costs.file import costs_to_json, save_costs

    if args.save:
        save_costs(table, target(args, args.save))
    console = report_console(stderr=args.json)
    if args.json:
        print(costs_to_json(table, indent=None))
    else:
        console.print(_pieces_table(table))
        _print_shared(table, console)
    if args.save:
        console.print(f"wrote cost table {args.save}", markup=False, soft_wrap=True)


def _pieces_table(table):
    from rich.table import Table

    from pipeloom.formatting import format_bytes

    view = Table(title=f"cost table: {table.device}, micro-batch of {table.microbatch_size}")
    view.add_column("piece", min_width=max(len(name) for name in table.names))
    for column in ("F (ms)", "I (ms)", "W (ms)", "saved", "params", "output"):
        view.add_column(column, justify="right", no_wrap=True)
    if not table.is_chain:  # say which pieces each one reads, when it is not simply the one before
        view.add_column("reads", overflow="fold")
    for piece in table.pieces:
        reads = [", ".join(piece.inputs or ()) or "(inputs)"] if not table.is_chain else []
        view.add_row(piece.name, f"{piece.f * 1e3:.3f}", f"{piece.i * 1e3:.3f}", f"{piece.w * 1e3:.3f}",
                     format_bytes(piece.activation_bytes), format_bytes(piece.param_bytes),
                     format_bytes(piece.output_bytes), *reads)
    return view


def _print_shared(table, console: Console) -> None:
    """One line per parameter several pieces use (counted once, in its first user's params)."""
    from pipeloom.formatting import format_bytes

    for entry in table.shared:
        console.print(f"shared: {entry.name or 'a parameter'} ({format_bytes(entry.bytes)}, counted once) used by "
                      f"{', '.join(entry.pieces)}", markup=False, soft_wrap=True)


def print_tensor(table, console: Console) -> None:
    """What the tensor-parallel profile measured: per size, the layer pieces' times and collectives; the fit."""
    info = table.tensor
    for profile in info.profiles:
        layers = [p for p in profile.pieces if p.name in info.layers]
        counted = sorted({f"{c.kind} {c.phase}" for p in layers for c in p.collectives})
        per_layer = {text: sum(f"{c.kind} {c.phase}" == text for c in layers[0].collectives) for text in counted} \
            if layers else {}
        console.print(f"tensor parallel (tp {profile.size}, measured): layers {', '.join(info.layers)}; per layer "
                      f"and micro-batch {', '.join(f'{n} {t}' for t, n in per_layer.items()) or 'no collective'}; "
                      f"F+B of the layers {sum(p.f + (p.full_backward or p.i + p.w) for p in layers) * 1e3:.2f} ms "
                      f"(tp 1: {sum(p.f + p.full_backward for p in table.pieces if p.name in info.layers) * 1e3:.2f} "
                      f"ms)", markup=False, soft_wrap=True)
    for kind, overhead in info.fit.overhead.items():
        bandwidth = info.fit.bandwidth.get(kind)
        console.print(f"fitted {kind}: {overhead * 1e6:.0f} us per collective, "
                      f"{'unlimited' if bandwidth is None else f'{bandwidth / 1e6:.1f} MB/s'}",
                      markup=False, soft_wrap=True)
