"""A weight in its GGUF stored form (every block type of engine/quant/formats.py, or a float tensor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WEIGHTS_PER_BLOCK = 32  # weights per Q4_0 / Q8_0 block
Q4_0_BLOCK_BYTES = 18  # fp16 d + 16 bytes: low nibble of byte j = element j, high = element j + 16
Q8_0_BLOCK_BYTES = 34  # fp16 d + 32 int8


@dataclass
class QWeightCache:
    """Forms derived from a QWeight's `data` by the compute paths, each built lazily on the first call
    that needs it (never for the whole model at load) and kept for the weight's lifetime."""

    # expert e -> the 2-D view of expert e of a stacked [E, N, K] weight (with its own cache);
    # filled by engine.quant.linear.expert_slice
    experts: dict[int, QWeight] = field(default_factory=dict)
    # CPU bf16 path, Q4_0: (packed int4 [N, K / 2] uint8, bf16 scales-and-zeros [K / 32, N, 2]);
    # filled by the first bf16 (or cpu_matmul="fast") linear on the weight
    int4: tuple[torch.Tensor, torch.Tensor] | None = None
    # CPU exact path, Q4_0/Q8_0: (int8 codes [N, K / 32, 32], fp32 block scales [N, K / 32, 1]), weight =
    # codes * scales; filled by the first exact linear on the weight
    codes: tuple[torch.Tensor, torch.Tensor] | None = None
    # CPU native path (cpu_matmul="native"), Q4_0: the row-interleaved form of engine/quant/native_q4.c,
    # uint8 [packed bytes] (or [E, packed bytes] for a stacked weight); built at load by
    # engine.quant.linear.prepare_native (lazily for a weight it did not see)
    interleaved: torch.Tensor | None = None
    # CUDA without the Triton kernels: the dequantized weight [N, K] in the last input dtype
    dequantized: torch.Tensor | None = None
    # Triton kernels: (the `data` they were made from, bytes, fp16 view of the same memory); rebuilt
    # when `data` is replaced. Filled by engine.quant.triton_q4 on the first call
    triton_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class QWeight:
    """A (possibly stacked) linear weight of torch shape [..., N, K] (y = x @ W^T).

    qtype "F32"/"F16"/"BF16": `data` is a float tensor of `shape`.
    any block type of engine/quant/formats.py (Q4_0, Q4_K, IQ4_XS, ...): `data` is uint8
    [..., N, K // block_elems * block_bytes], rows in GGUF block order (a view of the memory-mapped
    file where possible).
    """

    qtype: str
    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""
    # True when `data` is a view of the read-only GGUF file mapping (set by the loader, inherited by
    # expert slices): once a cached form replaces the stored one, its file pages may be released
    mmapped: bool = False
    # "" = the GGUF byte layout; engine.quant.q4_repack.Q4_0_PAIRS = Q4_0 repacked at load for the
    # GPU kernels (codes in pair order and scales in separate aligned runs per row; data
    # [..., N, repacked_row_bytes(K)])
    layout: str = ""
    cache: QWeightCache = field(default_factory=QWeightCache, repr=False, compare=False)
