"""Decoders of the 256-weight GGUF super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.

Layouts (bytes, in file order; d, dmin: fp16 super-block scales; sub-blocks of 16 or 32 weights
each have their own small integer scale, and the "minimum" types a small integer minimum):
- Q2_K   84 B: scales[16] (low 4 bits scale, high 4 bits min), qs[64] (2-bit), d, dmin
             w = (d * sc) * q - (dmin * m), 16 sub-blocks of 16
- Q3_K  110 B: hmask[32], qs[64] (2-bit), scales[12] (16 x 6-bit, minus 32), d
             w = (d * sc) * (q - 4 * !hbit), 16 sub-blocks of 16
- Q4_K  144 B: d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128] (4-bit)
             w = (d * sc) * q - (dmin * m), 8 sub-blocks of 32
- Q5_K  176 B: d, dmin, scales[12], qh[32] (5th bits), qs[128]   (as Q4_K with 5-bit q)
- Q6_K  210 B: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d
             w = (d * sc) * (q - 32), 16 sub-blocks of 16
- IQ4_XS 136 B: d, scales_h (uint16: 2 bits per sub-block), scales_l[4] (4 bits per sub-block),
             qs[128] (4-bit codes into the IQ4 levels); w = (d * (sc - 32)) * IQ4_VALUES[q], 8 of 32
Each takes stored blocks uint8 [nb, B] (and an optional fp32 output [nb, 256]) and returns the exact
fp32 weights [nb, 256], computed in gguf.quants' order (the sub-block scale product first).
"""

from __future__ import annotations

import torch

from swaserve.engine.quant.block_ops import bit_fields, finish, half, nibbles
from swaserve.engine.quant.blocks_legacy import iq4_levels

QK_K = 256  # weights per super-block


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K / Q5_K -> (6-bit scales, 6-bit mins), uint8 [nb, 8] each.
    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 and their high 2 bits from the top of bytes 0-3 / 4-7."""
    s = scales.reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]  # [nb, 4] each
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc, mn


def _sub_scale(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """fp32 d [nb, 1] * integer sub-block scales [nb, S] -> [nb, S, 1]."""
    return (d * sc.to(torch.float32)).unsqueeze(-1)


def decode_q2_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    scales = blocks[:, 0:16]
    dl = _sub_scale(half(blocks, 80), scales & 0x0F)  # [nb, 16, 1]
    ml = _sub_scale(half(blocks, 82), scales >> 4)
    q = bit_fields(blocks[:, 16:80], 32, 2, 4)  # [nb, 256] in 0..3
    return finish(q.view(-1, 16, 16), dl, ml, out, sign=-1)


def decode_q3_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    packed = blocks[:, 96:108]
    low = bit_fields(packed[:, 0:8], 8, 4, 2)  # [nb, 16]: low 4 bits of sub-block scales
    high = bit_fields(packed[:, 8:12], 4, 2, 4)  # [nb, 16]: their high 2 bits
    sc = low.bitwise_or_(high.bitwise_left_shift_(4)).to(torch.int16) - 32
    dl = _sub_scale(half(blocks, 108), sc)  # [nb, 16, 1]
    q = bit_fields(blocks[:, 32:96], 32, 2, 4)  # [nb, 256] in 0..3
    cleared = bit_fields(blocks[:, 0:32], 32, 1, 8).bitwise_xor_(1)  # 1 where the high bit is clear
    q.sub_(cleared.bitwise_left_shift_(2))  # ... subtracts 4: -4..3 (uint8 wraps; read as int8)
    return finish(q.view(torch.int8).view(-1, 16, 16), dl, None, out)


def decode_q4_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = _sub_scale(half(blocks, 0), sc)  # [nb, 8, 1]
    ml = _sub_scale(half(blocks, 2), mn)
    q = nibbles(blocks[:, 16:144], 32)  # [nb, 256]
    return finish(q.view(-1, 8, 32), dl, ml, out, sign=-1)


def decode_q5_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    sc, mn = k_scale_min(blocks[:, 4:16])
    dl = _sub_scale(half(blocks, 0), sc)
    ml = _sub_scale(half(blocks, 2), mn)
    q = nibbles(blocks[:, 48:176], 32)
    q.bitwise_or_(bit_fields(blocks[:, 16:48], 32, 1, 8).bitwise_left_shift_(4))  # the 5th bits
    return finish(q.view(-1, 8, 32), dl, ml, out, sign=-1)


def decode_q6_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    dl = _sub_scale(half(blocks, 208), blocks[:, 192:208].view(torch.int8))  # [nb, 16, 1]
    q = nibbles(blocks[:, 0:128], 64)  # [nb, 256]: low 4 bits
    q.bitwise_or_(bit_fields(blocks[:, 128:192], 32, 2, 4).bitwise_left_shift_(4)).sub_(32)  # -32..31
    return finish(q.view(torch.int8).view(-1, 16, 16), dl, None, out)


def decode_iq4_xs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    low = bit_fields(blocks[:, 4:8], 1, 4, 2)  # [nb, 8]: sub-block s from byte s // 2, nibble s % 2
    high = bit_fields(blocks[:, 2:4], 1, 2, 4)  # [nb, 8]: from the uint16 scales_h, bits 2s
    sc = low.bitwise_or_(high.bitwise_left_shift_(4)).to(torch.int16) - 32
    dl = _sub_scale(half(blocks, 0), sc)  # [nb, 8, 1]
    q = iq4_levels(blocks[:, 8:136], 16)  # [nb, 256]
    return finish(q.view(-1, 8, 32), dl, None, out)


# name -> (weights per block, bytes per block, decoder)
K_FORMATS = {
    "Q2_K": (QK_K, 84, decode_q2_k),
    "Q3_K": (QK_K, 110, decode_q3_k),
    "Q4_K": (QK_K, 144, decode_q4_k),
    "Q5_K": (QK_K, 176, decode_q5_k),
    "Q6_K": (QK_K, 210, decode_q6_k),
    "IQ4_XS": (QK_K, 136, decode_iq4_xs),
}
