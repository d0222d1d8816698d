"""Cost tables without a device: FLOPs and bytes of a GPT-style model turned into seconds by a roofline.

Each phase (F, I, W) of a piece takes ``max(flops / flops_per_second, bytes / bytes_per_second)``.
"""

from __future__ import annotations

from pipeloom.plan.costs.parts import Link, Piece
from pipeloom.plan.costs.table import CostTable
from pipeloom.plan.errors import CostTableError

__all__ = ["analytical_gpt_costs", "gpt_block_flops"]

_FREE_LINK = Link()


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CostTableError(f"analytical_gpt_costs: {name} must be a positive number, got {value!r}")
    return float(value)


def gpt_block_flops(*, batch: int, seq: int, hidden: int, ffn: int = 4) -> tuple[float, float, float]:
    """``(F, I, W)`` FLOPs of one pre-norm transformer block on ``batch`` sequences of ``seq`` tokens.

    Linear layers (QKV 3h², projection h², MLP 2·ffn·h²) take ``2·b·s·h²·(4 + 2·ffn)`` forward
    (24·b·s·h² for ffn = 4); attention's two matmuls (QKᵀ and scores·V) ``4·b·s²·h``. The backward
    of a linear layer costs its forward once for the input gradient (I) and once for the weight
    gradient (W); attention has no weights, so both of its operands' gradients fall in I:
    I = linear + 2·attention, W = linear. Hence I ≈ W ≈ F when the linear layers dominate (s ≪ h).
    """
    linear = 2.0 * batch * seq * hidden * hidden * (4 + 2 * ffn)
    attention = 4.0 * batch * seq * seq * hidden
    return linear + attention, linear + 2 * attention, linear


def analytical_gpt_costs(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    microbatch_size: int,
    flops_per_second: float,
    bytes_per_second: float,
    bytes_per_element: int = 2,
    ffn: int = 4,
    optimizer_factor: float = 6.0,
    link: Link = _FREE_LINK,
    names: tuple[str, str, str, str] = ("token_embedding", "blocks", "ln_f", "head"),
) -> CostTable:
    """The cost table of a GPT (token + position embedding, ``layers`` pre-norm blocks, final norm,
    LM head), piece names as in ``examples/train_gpt.py``: ``token_embedding``, ``blocks.k``,
    ``ln_f``, ``head`` (``names`` renames them: embedding, block prefix, final norm, head).

    Times: a roofline per phase, FLOPs from :func:`gpt_block_flops` for blocks and ``2·b·s·h·V`` for
    each of the head's F, I and W; bytes moved = the piece's parameters plus the activations it
    saves. Activation bytes of a block follow Korthikanti et al. (2022, no recomputation):
    ``s·b·h·(34 + 5·a·s/h)`` for 2-byte elements (scaled by ``bytes_per_element / 2``); of them
    ``(3 + ffn)·s·b·h`` elements are inputs of linear layers, kept until W. The head saves its
    input and the logits (plus an fp32 copy for the loss). ``optimizer_factor`` 6 is mixed-precision
    Adam: fp32 master weights and two fp32 moments per 2-byte weight. ``flops_per_second`` should
    be an achieved rate (e.g. 40-60% of the device's peak), not the peak.
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq),
                        ("vocab", vocab), ("microbatch_size", microbatch_size), ("ffn", ffn),
                        ("bytes_per_element", bytes_per_element)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostTableError(f"analytical_gpt_costs: {name} must be a positive integer, got {value!r}")
    if hidden % heads:
        raise CostTableError(f"analytical_gpt_costs: hidden {hidden} is not a multiple of heads {heads}")
    flops_rate = _positive("flops_per_second", flops_per_second)
    bytes_rate = _positive("bytes_per_second", bytes_per_second)
    b, s, h, v, e = microbatch_size, seq, hidden, vocab, bytes_per_element

    def seconds(flops: float, nbytes: float) -> float:
        return max(flops / flops_rate, nbytes / bytes_rate)

    tokens = b * s
    stream = tokens * h * e  # one (b, s, h) tensor
    embedding, block, final_norm, head = names
    pieces = []
    params = (v * h + s * h) * e
    pieces.append(Piece(
        name=embedding, f=seconds(tokens * h, params / v + 2 * stream), i=0.0,
        w=seconds(tokens * h, params + stream), activation_bytes=tokens * 8.0, param_bytes=params,
        output_bytes=stream, inputs=(),
    ))
    f, i, w = gpt_block_flops(batch=b, seq=s, hidden=h, ffn=ffn)
    params = ((4 + 2 * ffn) * h * h + (9 + ffn) * h) * e
    saved = tokens * h * (34 + 5 * heads * s / h) * e / 2
    kept = (3 + ffn) * stream
    for k in range(layers):
        pieces.append(Piece(
            name=f"{block}.{k}", f=seconds(f, params + saved), i=seconds(i, params + saved),
            w=seconds(w, params + kept), activation_bytes=saved, w_activation_bytes=kept,
            param_bytes=params, output_bytes=stream,
        ))
    pieces.append(Piece(
        name=final_norm, f=seconds(8.0 * tokens * h, 2 * stream), i=seconds(8.0 * tokens * h, 3 * stream),
        w=seconds(4.0 * tokens * h, 2 * stream), activation_bytes=stream, param_bytes=2 * h * e,
        output_bytes=stream,
    ))
    logits = tokens * v * e
    matmul = 2.0 * tokens * h * v
    params = v * h * e
    pieces.append(Piece(
        name=head, f=seconds(matmul, params + logits), i=seconds(matmul, params + logits),
        w=seconds(matmul, params + stream), activation_bytes=stream + logits + tokens * v * 4.0,
        w_activation_bytes=stream, param_bytes=params, output_bytes=logits,
    ))
    return CostTable(pieces=tuple(pieces), microbatch_size=b, device="analytical", link=link,
                     optimizer_factor=optimizer_factor, source="analytical")
