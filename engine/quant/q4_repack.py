"""Q4_0 repacked for the GPU kernels: per row, the nibble codes in element-pair order, then the fp16
block scales, the row padded to 16 bytes (the layout named `Q4_0_PAIRS`).

GGUF's Q4_0 block is 18 bytes (fp16 d, then 16 bytes whose low nibbles hold elements 0..15 and high
nibbles 16..31), so a row's code bytes sit 2 bytes past every 18-byte boundary: a kernel can only
load them byte by byte. Repacked, row n of a [..., N, K] weight is

    bytes [0, K/2)            code byte p: low nibble = element 2p, high nibble = element 2p + 1
    bytes [K/2, K/2 + K/16)   the K/32 fp16 block scales d, in block order
    bytes up to the row size  zero padding to a multiple of 16 bytes

so a tile's code bytes are one contiguous, 16-byte-aligned run per row (vector loads) and its
scales one short run. Lossless: the same codes and scales as the file (`unpack_q4_0` gives the GGUF
bytes back exactly); 1-2% larger only when K/2 + K/16 is not a multiple of 16 (K = 704: 396 -> 400 B).
Done once at load on CUDA (engine/fused/weights.py, engine/moe/triton_backend.py) with torch ops,
in chunks of rows (any device).
"""

from __future__ import annotations

import torch

from swaserve.engine.quant.base import Q4_0_BLOCK_BYTES, WEIGHTS_PER_BLOCK, QWeight

Q4_0_PAIRS = "q4_0_pairs"  # QWeight.layout of a repacked Q4_0 weight
ROW_ALIGN = 16  # bytes
_CHUNK_BYTES = 64 << 20  # stored bytes repacked at once (bounds the temporaries)


def repacked_row_bytes(k: int) -> int:
    """Bytes of one repacked row of K weights (K a multiple of 32)."""
    if k % WEIGHTS_PER_BLOCK:
        raise ValueError(f"Q4_0 rows must hold a multiple of {WEIGHTS_PER_BLOCK} weights, got {k}")
    raw = k // 2 + k // WEIGHTS_PER_BLOCK * 2
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


def _repack_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [R, K/32 * 18] GGUF rows -> uint8 [R, repacked_row_bytes(K)]."""
    r, nb = rows.shape[0], k // WEIGHTS_PER_BLOCK
    blocks = rows.view(r, nb, Q4_0_BLOCK_BYTES)
    qs = blocks[:, :, 2:]  # [R, nb, 16]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=2).view(r, k // 2, 2)  # element order, pairs
    out = torch.zeros(r, repacked_row_bytes(k), dtype=torch.uint8, device=rows.device)
    out[:, : k // 2] = codes[:, :, 0] | (codes[:, :, 1] << 4)
    out[:, k // 2 : k // 2 + 2 * nb] = blocks[:, :, :2].reshape(r, 2 * nb)
    return out


def _unpack_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [R, repacked_row_bytes(K)] -> the GGUF rows uint8 [R, K/32 * 18]."""
    r, nb = rows.shape[0], k // WEIGHTS_PER_BLOCK
    pairs = rows[:, : k // 2]
    codes = torch.stack([pairs & 0xF, pairs >> 4], dim=2).view(r, nb, 2, 16)  # [R, nb, lo/hi half, 16]
    out = torch.empty(r, nb, Q4_0_BLOCK_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :, :2] = rows[:, k // 2 : k // 2 + 2 * nb].view(r, nb, 2)
    out[:, :, 2:] = codes[:, :, 0] | (codes[:, :, 1] << 4)
    return out.view(r, nb * Q4_0_BLOCK_BYTES)


def _map_rows(data: torch.Tensor, k: int, fn, out_row: int) -> torch.Tensor:
    lead = data.shape[:-1]
    flat = data.reshape(-1, data.shape[-1])
    out = torch.empty(flat.shape[0], out_row, dtype=torch.uint8, device=data.device)
    step = max(1, _CHUNK_BYTES // max(1, flat.shape[1]))
    for r0 in range(0, flat.shape[0], step):
        out[r0 : r0 + step] = fn(flat[r0 : r0 + step].contiguous(), k)
    return out.view(*lead, out_row)


def repack_q4_0(data: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q4_0 rows uint8 [..., N, K/32 * 18] -> the repacked rows [..., N, repacked_row_bytes(K)]."""
    if data.dtype != torch.uint8 or data.shape[-1] != k // WEIGHTS_PER_BLOCK * Q4_0_BLOCK_BYTES:
        raise ValueError(f"not Q4_0 rows of {k} weights: {tuple(data.shape)} {data.dtype}")
    return _map_rows(data, k, _repack_rows, repacked_row_bytes(k))


def unpack_q4_0(data: torch.Tensor, k: int) -> torch.Tensor:
    """Repacked rows [..., N, repacked_row_bytes(K)] -> the GGUF Q4_0 bytes [..., N, K/32 * 18]."""
    if data.dtype != torch.uint8 or data.shape[-1] != repacked_row_bytes(k):
        raise ValueError(f"not repacked Q4_0 rows of {k} weights: {tuple(data.shape)} {data.dtype}")
    return _map_rows(data, k, _unpack_rows, k // WEIGHTS_PER_BLOCK * Q4_0_BLOCK_BYTES)


def repack_weight(w: QWeight) -> QWeight:
    """The Q4_0_PAIRS form of a Q4_0 weight on its device (other weights, or one already repacked,
    are returned as they are)."""
    if w.qtype != "Q4_0" or w.layout == Q4_0_PAIRS or w.shape[-1] % WEIGHTS_PER_BLOCK:
        return w
    return QWeight(w.qtype, w.shape, repack_q4_0(w.data, w.shape[-1]), w.name, layout=Q4_0_PAIRS)


def gguf_data(w: QWeight) -> torch.Tensor:
    """`w`'s rows in GGUF block order (unpacked when repacked): for the paths that decode stored bytes."""
    if w.layout == Q4_0_PAIRS:
        return unpack_q4_0(w.data, w.shape[-1])
    return w.data
