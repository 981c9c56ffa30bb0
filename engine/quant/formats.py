"""GGUF block formats by name: the registry every quantized path reads (dequantization, the CPU exact
matmul, the embedding lookup, the loader's list of kept types).

A block format turns stored blocks `uint8 [nb, block_bytes]` into fp32 weights `[nb, block_elems]`,
bit for bit what `gguf.quants.dequantize` returns (same fp32 operations in the same order: scale
products first, then `scale * q`, then the minimum or offset). Decoders live in
engine/quant/blocks_legacy.py (32-weight blocks), engine/quant/blocks_k.py (256-weight super-blocks)
and engine/quant/blocks_iq.py (the lattice-codebook IQ1/IQ2/IQ3 types); `dequantize_blocks` is the one
entry point, and it is
the per-type hook a faster kernel (an integer dot product, a compiled extension) can sit beside:
anything that needs the exact weights of some stored rows calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swaserve.engine.quant.blocks_iq import IQ_GRID_FORMATS
from swaserve.engine.quant.blocks_k import K_FORMATS
from swaserve.engine.quant.blocks_legacy import LEGACY_FORMATS

# stored blocks [nb, block_bytes] uint8, optional fp32 output [nb, block_elems] -> fp32 [nb, block_elems]
Decoder = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGUF type name, e.g. "Q4_K"
    block_elems: int  # weights per block (32, or 256 for the K / IQ4_XS super-blocks)
    block_bytes: int  # stored bytes per block
    decode: Decoder  # exact fp32 weights of a run of blocks


FORMATS: dict[str, BlockFormat] = {
    name: BlockFormat(name, elems, nbytes, fn)
    for name, (elems, nbytes, fn) in {**LEGACY_FORMATS, **K_FORMATS, **IQ_GRID_FORMATS}.items()
}


def register(fmt: BlockFormat) -> BlockFormat:
    """Add a block format (once per name)."""
    assert fmt.name not in FORMATS, f"block format {fmt.name} registered twice"
    FORMATS[fmt.name] = fmt
    return fmt


def block_format(qtype: str) -> BlockFormat:
    """The format of block type `qtype`; ValueError for a type without one."""
    fmt = FORMATS.get(qtype)
    if fmt is None:
        raise ValueError(f"unsupported GGUF block type {qtype!r} (supported: {', '.join(FORMATS)})")
    return fmt


def row_bytes(qtype: str, elems: int) -> int:
    """Stored bytes of a row of `elems` weights of block type `qtype` (elems: a multiple of its block)."""
    fmt = block_format(qtype)
    assert elems % fmt.block_elems == 0, f"{qtype}: a row of {elems} weights is not whole blocks"
    return elems // fmt.block_elems * fmt.block_bytes


def dequantize_blocks(qtype: str, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored rows uint8 [..., nb * block_bytes] of `qtype` -> exact fp32 [..., nb * block_elems]
    (written into `out`, a contiguous fp32 tensor of that shape, when given)."""
    fmt = block_format(qtype)
    assert data.dtype == torch.uint8 and data.shape[-1] % fmt.block_bytes == 0, (qtype, data.shape)
    nb = data.numel() // fmt.block_bytes
    blocks = data.reshape(nb, fmt.block_bytes)  # a view when the rows are contiguous
    shape = (*data.shape[:-1], data.shape[-1] // fmt.block_bytes * fmt.block_elems)
    if out is not None:
        assert out.dtype == torch.float32 and tuple(out.shape) == shape, (out.dtype, out.shape, shape)
        assert out.is_contiguous()
        fmt.decode(blocks, out.view(nb, fmt.block_elems))
        return out
    return fmt.decode(blocks, None).reshape(shape)


