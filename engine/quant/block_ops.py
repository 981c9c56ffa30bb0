"""Bit-level helpers of the GGUF block decoders (engine/quant/blocks_legacy.py, blocks_k.py).

Every decoder works on a 2-D run of stored blocks `uint8 [nb, block_bytes]` and returns fp32
`[nb, block_elems]`. Integer codes are unpacked with scalar shifts and masks into fresh tensors
that one `stack` interleaves (no gathers, no shifts by a tensor, no `out=` into strided views:
each of those is 5-50x slower in torch's CPU kernels); `finish` then converts the codes to fp32 in
one pass and applies the scales in gguf's order.
"""

from __future__ import annotations

import torch


def half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block, as fp32 [nb, 1] (exact)."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [nb, G * group] -> 4-bit codes uint8 [nb, G * 2 * group]: for each run of `group` bytes,
    their low nibbles, then their high nibbles (every GGUF 4-bit layout)."""
    nb = qs.shape[0]
    q = qs.view(nb, -1, group)  # [nb, G, group]: a view of the stored bytes
    return torch.stack([q & 0x0F, q >> 4], dim=2).view(nb, -1)


def bit_fields(x: torch.Tensor, group: int, width: int, count: int) -> torch.Tensor:
    """uint8 [nb, G * group] -> uint8 [nb, G * count * group]: for each run of `group` bytes, the
    `width`-bit field at bit width * t of each byte, for t = 0 .. count - 1."""
    nb = x.shape[0]
    xv = x.view(nb, -1, group)  # [nb, G, group]
    mask = (1 << width) - 1
    return torch.stack([(xv >> (width * t)) & mask for t in range(count)], dim=2).view(nb, -1)


def bits_lsb_first(x: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, n] (a little-endian bit string) -> its 8n bits uint8 [nb, 8n], bit j = bit j % 8
    of byte j // 8 (the qh of Q5_0 / Q5_1)."""
    nb = x.shape[0]
    return torch.stack([(x >> t) & 1 for t in range(8)], dim=2).view(nb, -1)


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
