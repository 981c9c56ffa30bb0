"""Decoders of the lattice-codebook GGUF types (256-weight super-blocks): IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, which llama.cpp's 1-3-bit mixes (and "dynamic" files) use.

Each group of 8 (IQ2, IQ1) or 4 (IQ3) weights is one row of a fixed codebook ("grid") picked by an
index of 8-11 bits, times a sub-block scale, with a sign per weight (IQ2/IQ3: from a sign byte, or from
a 7-bit index into the 128 even-parity sign patterns "ksigns") or a shared offset +-1/8 (IQ1). The
codebooks are llama.cpp's tables as the `gguf` package ships them (`gguf.quants.<TYPE>.grid`), read
once per device. Layouts (bytes; d: fp16):
- IQ2_XXS  66 B: d, 8 x (uint32 4 grid indices, uint32 4 x 7-bit sign index + 4-bit scale)
- IQ2_XS   74 B: d, 32 x uint16 (9-bit grid index, 7-bit sign index), 16 x 4-bit scales
- IQ2_S    82 B: d, 32 grid index bytes, 32 sign bytes, 8 bytes of 2 high index bits, 16 x 4-bit scales
- IQ3_XXS  98 B: d, 64 grid index bytes (4-weight rows), 8 x uint32 (4 x 7-bit sign index + 4-bit scale)
- IQ3_S   110 B: d, 64 grid index bytes, 8 bytes of 9th index bits, 32 sign bytes, 8 x 4-bit scales
- IQ1_S    50 B: d, 32 grid index bytes, 8 x uint16 (4 x 3 high index bits, 3-bit scale, delta sign)
- IQ1_M    56 B: 32 grid index bytes, 16 bytes (2 x (3 high index bits + delta sign)), 4 x uint16
              (4 x 3-bit scales; d is assembled from their top nibbles)
Weights come out exactly as `gguf.quants.dequantize` computes them in fp32, except IQ1_M's offset
signs, which follow llama.cpp (`qh & 0x08` per nibble); gguf-py 0.19 reads them with an operator
precedence slip (`qh & 0x08 == 0`) that makes every offset negative.
"""

from __future__ import annotations

import torch

from swaserve.engine.quant.block_ops import half

QK_K = 256
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _grid(name: str, device: torch.device) -> torch.Tensor:
    """Codebook of type `name` as fp32 [rows, 8 or 4] on `device` (from the gguf package, once)."""
    key = (name, device)
    table = _TABLES.get(key)
    if table is None:
        from gguf import quants

        cls = getattr(quants, name)
        cls.init_grid()
        table = _TABLES[key] = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(device)
    return table


def _ksigns(device: torch.device) -> torch.Tensor:
    """The 128 even-parity sign bytes (bit k set: weight k negative), uint8 [128]."""
    key = ("ksigns", device)
    table = _TABLES.get(key)
    if table is None:
        from gguf import quants

        raw = bytearray(quants.IQ2_XXS.ksigns)
        table = _TABLES[key] = torch.frombuffer(raw, dtype=torch.uint8).clone().to(device)
    return table


def _words32(blocks: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Little-endian uint32 words of bytes [a, b) of each block, as int64 [nb, (b - a) / 4]."""
    return blocks[:, a:b].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _words16(blocks: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Little-endian uint16 words of bytes [a, b), as int64 [nb, (b - a) / 2]."""
    return blocks[:, a:b].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _sign_values(sign_bytes: torch.Tensor) -> torch.Tensor:
    """Sign bytes uint8 [...] -> fp32 [..., 8]: +1 where bit k is clear, -1 where it is set."""
    bits = torch.stack([(sign_bytes >> k) & 1 for k in range(8)], dim=-1)
    return 1.0 - 2.0 * bits.to(torch.float32)


def _lookup(grid: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` [...] of `grid` -> [..., row length]."""
    return grid.index_select(0, idx.reshape(-1).to(torch.int64)).view(*idx.shape, grid.shape[1])


def _nibble_scales(x: torch.Tensor) -> torch.Tensor:
    """Bytes [nb, n] of two 4-bit scales each (low first) -> fp32 [nb, 2n]."""
    return torch.stack([x & 0x0F, x >> 4], dim=2).reshape(x.shape[0], -1).to(torch.float32)


def _emit(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    res = values.reshape(values.shape[0], QK_K)
    if out is None:
        return res
    return out.copy_(res)


def decode_iq2_xxs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)  # [nb, 1]
    w = _words32(blocks, 2, 66).view(nb, 8, 2)  # per 32-weight sub-block: (grid indices, signs + scale)
    db = (d * (((w[..., 1] >> 28) & 15).to(torch.float32) + 0.5)) * 0.25  # [nb, 8]
    sign_idx = torch.stack([(w[..., 1] >> (7 * g)) & 127 for g in range(4)], dim=-1)  # [nb, 8, 4]
    signs = _sign_values(_ksigns(blocks.device)[sign_idx])  # [nb, 8, 4, 8]
    idx = blocks[:, 2:66].reshape(nb, 8, 2, 4)[:, :, 0]  # the 4 index bytes of each sub-block
    grid = _lookup(_grid("IQ2_XXS", blocks.device), idx)  # [nb, 8, 4, 8]
    return _emit(db.view(nb, 8, 1, 1) * grid * signs, out)


def decode_iq2_xs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)
    q = _words16(blocks, 2, 66)  # [nb, 32]
    db = (d * (_nibble_scales(blocks[:, 66:74]) + 0.5)) * 0.25  # [nb, 16]
    signs = _sign_values(_ksigns(blocks.device)[q >> 9])  # [nb, 32, 8]
    grid = _lookup(_grid("IQ2_XS", blocks.device), q & 511)  # [nb, 32, 8]
    return _emit(db.view(nb, 16, 1, 1) * grid.view(nb, 16, 2, 8) * signs.view(nb, 16, 2, 8), out)


def decode_iq2_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)
    db = (d * (_nibble_scales(blocks[:, 74:82]) + 0.5)) * 0.25  # [nb, 16]
    signs = _sign_values(blocks[:, 34:66])  # [nb, 32, 8]
    qh = blocks[:, 66:74]
    high = torch.stack([(qh >> (2 * t)) & 3 for t in range(4)], dim=2).reshape(nb, 32)  # index i * 4 + t
    idx = blocks[:, 2:34].to(torch.int64) | (high.to(torch.int64) << 8)
    grid = _lookup(_grid("IQ2_S", blocks.device), idx)  # [nb, 32, 8]
    return _emit(db.view(nb, 16, 1, 1) * grid.view(nb, 16, 2, 8) * signs.view(nb, 16, 2, 8), out)


def decode_iq3_xxs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)
    sc = _words32(blocks, 66, 98)  # [nb, 8]
    db = (d * (((sc >> 28) & 15).to(torch.float32) + 0.5)) * 0.5
    sign_idx = torch.stack([(sc >> (7 * g)) & 127 for g in range(4)], dim=-1)  # [nb, 8, 4]
    signs = _sign_values(_ksigns(blocks.device)[sign_idx])  # [nb, 8, 4, 8]
    grid = _lookup(_grid("IQ3_XXS", blocks.device), blocks[:, 2:66])  # [nb, 64, 4]
    return _emit(db.view(nb, 8, 1, 1) * grid.view(nb, 8, 4, 8) * signs, out)


def decode_iq3_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)
    scales = torch.stack([blocks[:, 106:110] & 0x0F, blocks[:, 106:110] >> 4], dim=2).reshape(nb, 8)
    db = d * (1 + 2 * scales.to(torch.int64)).to(torch.float32)  # [nb, 8]
    signs = _sign_values(blocks[:, 74:106])  # [nb, 32, 8]
    qh = blocks[:, 66:74]
    high = torch.stack([(qh >> k) & 1 for k in range(8)], dim=2).reshape(nb, 64)  # index i * 8 + k
    idx = blocks[:, 2:66].to(torch.int64) | (high.to(torch.int64) << 8)
    grid = _lookup(_grid("IQ3_S", blocks.device), idx)  # [nb, 64, 4]
    return _emit(db.view(nb, 8, 1, 1) * grid.view(nb, 8, 4, 8) * signs.view(nb, 8, 4, 8), out)


def decode_iq1_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    d = half(blocks, 0)
    qh = _words16(blocks, 34, 50)  # [nb, 8]
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)  # [nb, 8]
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).to(torch.float32)  # [nb, 8]
    high = torch.stack([(qh >> (3 * g)) & 7 for g in range(4)], dim=2).reshape(nb, 32)
    idx = blocks[:, 2:34].to(torch.int64) | (high << 8)
    grid = _lookup(_grid("IQ1_S", blocks.device), idx).view(nb, 8, 4, 8)
    return _emit(dl.view(nb, 8, 1, 1) * (grid + delta.view(nb, 8, 1, 1)), out)


def decode_iq1_m(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    nb = blocks.shape[0]
    sc = _words16(blocks, 48, 56)  # [nb, 4]
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32).view(nb, 1)
    scales = torch.stack([(sc >> (3 * t)) & 7 for t in range(4)], dim=2).reshape(nb, 16)  # index i * 4 + t
    dl = d * (2 * scales + 1).to(torch.float32)  # [nb, 16]: one per 16 weights
    qh = blocks[:, 32:48]
    nib = torch.stack([qh & 0x0F, qh >> 4], dim=2).reshape(nb, 32).to(torch.int64)  # one per 8 weights
    idx = blocks[:, 0:32].to(torch.int64) | ((nib & 7) << 8)
    delta = torch.where((nib & 8) == 0, 0.125, -0.125).to(torch.float32)  # llama.cpp: qh & 0x08 -> -delta
    grid = _lookup(_grid("IQ1_M", blocks.device), idx).view(nb, 16, 2, 8)
    return _emit(dl.view(nb, 16, 1, 1) * (grid + delta.view(nb, 16, 2, 1)), out)


# name -> (weights per block, bytes per block, decoder)
IQ_GRID_FORMATS = {
    "IQ2_XXS": (QK_K, 66, decode_iq2_xxs),
    "IQ2_XS": (QK_K, 74, decode_iq2_xs),
    "IQ2_S": (QK_K, 82, decode_iq2_s),
    "IQ3_XXS": (QK_K, 98, decode_iq3_xxs),
    "IQ3_S": (QK_K, 110, decode_iq3_s),
    "IQ1_S": (QK_K, 50, decode_iq1_s),
    "IQ1_M": (QK_K, 56, decode_iq1_m),
}
