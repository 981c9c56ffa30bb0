"""Decoders of the 32-weight GGUF block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

Block layouts (bytes; d, m: fp16; 4-bit codes: byte j holds weight j in its low nibble and weight
j + 16 in its high nibble; qh: bit j of a little-endian uint32 is the 5th bit of weight j):
- Q4_0   18 B: d, 16 B codes               w = d * (q - 8)
- Q4_1   20 B: d, m, 16 B codes            w = d * q + m
- Q5_0   22 B: d, 4 B qh, 16 B codes       w = d * (q - 16)
- Q5_1   24 B: d, m, 4 B qh, 16 B codes    w = d * q + m
- Q8_0   34 B: d, 32 int8                  w = d * q
- IQ4_NL 18 B: d, 16 B codes               w = d * IQ4_VALUES[q]
Each takes stored blocks uint8 [nb, B] (and an optional fp32 output [nb, 32]) and returns the exact
fp32 weights [nb, 32], computed in gguf.quants' order.
"""

from __future__ import annotations

import torch

from swaserve.engine.quant.block_ops import bits_lsb_first, finish, half, nibbles

# the 16 non-linear levels of IQ4_NL / IQ4_XS (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_PAIRS: dict[torch.device, torch.Tensor] = {}


def iq4_levels(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Code bytes uint8 [nb, G * group] -> IQ4 levels int8 [nb, G * 2 * group], in the order of
    `nibbles` (low nibbles of each run of `group` bytes, then high). One gather per byte from a
    256-row table of (level of the low nibble, level of the high nibble)."""
    table = _IQ4_PAIRS.get(qs.device)
    if table is None:
        b = torch.arange(256)
        levels = torch.tensor(IQ4_VALUES, dtype=torch.int8)
        table = _IQ4_PAIRS[qs.device] = torch.stack([levels[b & 15], levels[b >> 4]], dim=1).to(qs.device)
    nb = qs.shape[0]
    pairs = table.index_select(0, qs.reshape(-1).to(torch.int32))  # [nb * G * group, 2]
    out = torch.empty(nb, 2 * qs.shape[1], dtype=torch.int8, device=qs.device)
    out.view(nb, -1, 2, group).copy_(pairs.view(nb, -1, group, 2).transpose(2, 3))
    return out


def _per_block(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 1, 1)  # [nb, 1] -> [nb, 1, 1]: broadcasts over [nb, 1, 32]


def _q5_codes(blocks: torch.Tensor, qh_at: int, qs_at: int) -> torch.Tensor:
    """5-bit codes uint8 [nb, 32]: 4 low bits from the nibbles, the 5th from the qh bit string."""
    q = nibbles(blocks[:, qs_at:qs_at + 16], 16)
    high = bits_lsb_first(blocks[:, qh_at:qh_at + 4])
    return q.bitwise_or_(high.bitwise_left_shift_(4))


def decode_q4_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = nibbles(blocks[:, 2:18], 16).view(torch.int8).sub_(8)  # [nb, 32] in -8..7
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_q4_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = nibbles(blocks[:, 4:20], 16)
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), _per_block(half(blocks, 2)), out)


def decode_q5_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = _q5_codes(blocks, 2, 6).view(torch.int8).sub_(16)  # -16..15
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_q5_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = _q5_codes(blocks, 4, 8)
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), _per_block(half(blocks, 2)), out)


def decode_q8_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = blocks[:, 2:34].view(torch.int8)  # a strided view: copied straight into the fp32 output
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_iq4_nl(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = iq4_levels(blocks[:, 2:18], 16)
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


# name -> (weights per block, bytes per block, decoder)
LEGACY_FORMATS = {
    "Q4_0": (32, 18, decode_q4_0),
    "Q4_1": (32, 20, decode_q4_1),
    "Q5_0": (32, 22, decode_q5_0),
    "Q5_1": (32, 24, decode_q5_1),
    "Q8_0": (32, 34, decode_q8_0),
    "IQ4_NL": (32, 18, decode_iq4_nl),
}
