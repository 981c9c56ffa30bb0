"""A weight in its GGUF stored form (the compute form for F32/F16/BF16/Q4_0/Q8_0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # weights per Q4_0 / Q8_0 block
Q4_0_BLOCK_BYTES = 18  # fp16 d + 16 bytes: low nibble of byte j = element j, high = element j + 16
Q8_0_BLOCK_BYTES = 34  # fp16 d + 32 int8


@dataclass
class QWeight:
    """A (possibly stacked) linear weight of torch shape [..., N, K] (y = x @ W^T).

    qtype "F32"/"F16"/"BF16": `data` is a float tensor of `shape`.
    qtype "Q4_0"/"Q8_0": `data` is uint8 [..., N, K // 32 * block_bytes], rows in GGUF block order
    (a view of the memory-mapped file where possible). Other GGUF types are dequantized at load
    and arrive here as F32/F16.
    """

    qtype: str
    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""
