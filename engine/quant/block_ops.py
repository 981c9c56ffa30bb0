"""Bit-level helpers of the GGUF block decoders (engine/quant/blocks_legacy.py, blocks_k.py).

Every decoder works on a 2-D run of stored blocks `uint8 [nb, block_bytes]` and returns fp32
`[nb, block_elems]`; the fp32 arithmetic is done in `finish`, in gguf's order.
"""

from __future__ import annotations

import torch


def half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block, as fp32 [nb, 1] (exact)."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [nb, G * group] -> 4-bit codes [nb, G * 2 * group]: for each run of `group` bytes, their
    low nibbles, then their high nibbles (the order of every GGUF 4-bit layout)."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(nb, -1)


def bit_fields(x: torch.Tensor, group: int, width: int, count: int) -> torch.Tensor:
    """uint8 [nb, G * group] -> [nb, G * count * group]: for each run of `group` bytes, the `width`-bit
    field at bit width * t of each byte, for t = 0 .. count - 1."""
    nb = x.shape[0]
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=x.device).view(1, 1, count, 1)
    return ((x.reshape(nb, -1, 1, group) >> shifts) & ((1 << width) - 1)).reshape(nb, -1)


def finish(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, out: torch.Tensor | None,
           sign: int = 1) -> torch.Tensor:
    """fp32 scale * q (+ sign * offset), computed as gguf does it; q integer [nb, S, L] (S sub-blocks
    of L weights), scale / offset fp32 broadcastable to it. Returns [nb, S * L] (`out` when given)."""
    nb = q.shape[0]
    res = out if out is not None else torch.empty(q.shape, dtype=torch.float32, device=q.device)
    r = res.view(q.shape)
    r.copy_(q)  # small integers: exact in fp32
    r.mul_(scale)
    if offset is not None:
        if sign > 0:
            r.add_(offset)
        else:
            r.sub_(offset)
    return res.view(nb, -1)


