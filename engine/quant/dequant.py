"""Dequantization of QWeight (the numerical oracle for every quantized fast path).

Block types decode through the format registry (engine/quant/formats.py), exactly as
`gguf.quants.dequantize` does in fp32; float types are converted exactly.
"""

from __future__ import annotations

import torch

from swaserve.engine.quant.base import Q4_0_BLOCK_BYTES, QWeight
from swaserve.engine.quant.formats import FORMATS, dequantize_blocks
from swaserve.engine.quant.q4_repack import Q4_0_PAIRS, gguf_data, unpack_q4_0

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BLOCK_BYTES = {name: fmt.block_bytes for name, fmt in FORMATS.items()}  # every block type


def supported(qtype: str) -> bool:
    """Whether a QWeight may hold `qtype` (a float type or a registered block format)."""
    return qtype in FLOAT_TYPES or qtype in FORMATS


def _blocks(data: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 [..., nb * block_bytes] -> [..., nb, block_bytes]."""
    assert data.dtype == torch.uint8 and data.shape[-1] % block_bytes == 0, (data.dtype, data.shape)
    return data.reshape(*data.shape[:-1], data.shape[-1] // block_bytes, block_bytes)


def block_scales(data: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """fp16 block scale d of each Q4_0 / Q8_0 block, as fp32: uint8 [..., nb * block_bytes] -> [..., nb]."""
    b = _blocks(data, block_bytes)
    return b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()


def q4_0_codes(data: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes q in [0, 16) of Q4_0 rows: uint8 [..., nb * 18] -> uint8 [..., nb * 32]."""
    qs = _blocks(data, Q4_0_BLOCK_BYTES)[..., 2:]  # [..., nb, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., nb, 32]: element j low, j + 16 high
    return codes.reshape(*data.shape[:-1], -1)


def dequantize_data(qtype: str, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize raw stored rows of `qtype` to fp32 (last dim = elements for float types); into
    `out` (contiguous fp32 of the result's shape) when given."""
    if qtype in FLOAT_TYPES:
        return data.to(torch.float32) if out is None else out.copy_(data)
    if qtype in FORMATS:
        return dequantize_blocks(qtype, data, out)
    raise ValueError(f"unsupported QWeight type {qtype!r}")


def dequantize(w: QWeight) -> torch.Tensor:
    """The fp32 tensor of shape `w.shape` that `w` stores."""
    out = dequantize_data(w.qtype, gguf_data(w))
    return out.reshape(w.shape)


def dequantize_rows(w: QWeight, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows `ids` of a 2-D weight [N, K] (an embedding lookup): [T] -> [T, K]. Only the stored
    bytes of those rows are read and decoded."""
    assert len(w.shape) == 2, w.shape
    rows = w.data.index_select(0, ids.to(w.data.device))
    if w.layout == Q4_0_PAIRS:
        rows = unpack_q4_0(rows, w.shape[-1])
    return dequantize_data(w.qtype, rows)
