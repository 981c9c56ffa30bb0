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

from swaserve.engine.quant.block_ops import bit_fields, finish, half, nibbles

# the 16 non-linear levels of IQ4_NL / IQ4_XS (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_TABLE: dict[torch.device, torch.Tensor] = {}


def iq4_levels(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype) -> their IQ4 levels as int16, same shape."""
    table = _IQ4_TABLE.get(codes.device)
    if table is None:
        table = _IQ4_TABLE[codes.device] = torch.tensor(IQ4_VALUES, dtype=torch.int16, device=codes.device)
    return table[codes.long()]


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 4] (a little-endian uint32) -> bit j of it for j < 32, as uint8 [nb, 32]."""
    return bit_fields(qh, 4, 1, 8).view(-1, 8, 4).transpose(1, 2).reshape(-1, 32)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 1, 1)  # [nb, 1] -> [nb, 1, 1]: broadcasts over [nb, 1, 32]


def decode_q4_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = nibbles(blocks[:, 2:18], 16).view(torch.int8) - 8  # [nb, 32]
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_q4_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = nibbles(blocks[:, 4:20], 16)
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), _per_block(half(blocks, 2)), out)


def decode_q5_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = (nibbles(blocks[:, 6:22], 16) | (_q5_high(blocks[:, 2:6]) << 4)).view(torch.int8) - 16
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_q5_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = nibbles(blocks[:, 8:24], 16) | (_q5_high(blocks[:, 4:8]) << 4)
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), _per_block(half(blocks, 2)), out)


def decode_q8_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = blocks[:, 2:34].view(torch.int8)  # a strided view: copied straight into the fp32 output
    return finish(q.view(-1, 1, 32), _per_block(half(blocks, 0)), None, out)


def decode_iq4_nl(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    q = iq4_levels(nibbles(blocks[:, 2:18], 16))
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
