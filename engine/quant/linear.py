"""y = x @ W^T for a QWeight in its stored form (F32/F16/BF16 or any GGUF block type), CPU and CUDA.

CPU, Q4_0/Q8_0, two paths chosen by the input dtype:
- bf16 input, Q4_0 (N % 16 == 0): torch's int4 weight-only matmul (AVX512/AVX2 kernel). The 4-bit
  codes are repacked into it losslessly (group 32, zero point 8, zero 0: value (q - 8) * d); the
  kernel takes the block scales d in the activation dtype, so they are rounded to bf16, and
  activations and outputs are bf16: bf16 accuracy overall. The fast decode path.
- any other input dtype: fp32 and exact (= dequantize + matmul up to fp32 summation order). The
  weight's int8 codes (q - 8 for Q4_0, a view of the file for Q8_0) and fp32 block scales are
  cached; each call dequantizes cache-sized row chunks (codes * d, one pass) into a reused
  buffer and multiplies them (sgemm). About the speed of an fp32 dense matmul, at 1.1 B/weight.
  (torch's int4 kernel is exact with fp32 activations too, but has no vectorized fp32 path.)
  `linear(..., cpu_matmul="fast")` sends fp32 inputs through the bf16 kernel too: the caller passes
  EngineConfig.cpu_matmul (`--cpu-matmul`), which the model and the MoE backends keep from their
  construction, so the choice is per engine rather than a process-wide switch.
`cpu_matmul="native"` (the CPU default, EngineConfig.cpu_matmul): Q4_0 weights with fp32 inputs go
through the native Q4_0 x Q8_0 kernel (engine/quant/native.py: activations quantized per 32-block to 8
bits, integer dots; llama.cpp's numerics) on the weight's interleaved form, which `prepare_native`
builds once at load (lossless, same bytes as the file; the file pages are released). Q8_0, Q4_1,
Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K and IQ4_XS weights with fp32 inputs go through engine/quant/native_k
(integer dots on the stored rows read in place, activations quantized per call to 8 bits per 32- or
256-block; nothing cached). Without a kernel (no compiler, the IQ1/IQ2/IQ3 codebook types) native
means exact.
Caches are built lazily per weight on first use (never for the whole model at load) and live in
the QWeight's declared `cache`; once a Q4_0 weight is cached, its file pages are dropped from
memory (madvise).
Every other block type (Q4_1, Q5_0, Q5_1, the K types, IQ4_NL, IQ4_XS: engine/quant/formats.py) has
one exact CPU path (cpu_matmul="exact", or a non-fp32 input), for any input dtype: each call decodes
row chunks of the stored blocks with the type's registered decoder (`formats.dequantize_blocks`,
bit-exact to gguf) into a reused fp32 buffer and multiplies them (sgemm); nothing is cached, so the
weight stays at its stored size.
F32/F16/BF16: F.linear (on CPU, a weight whose dtype differs from the input's is converted in row
chunks). On CUDA every block type goes to the Triton kernels of engine.quant.triton_q4 when
importable, else dequantize + matmul.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from swaserve.engine.quant import native, native_k
from swaserve.engine.quant.base import WEIGHTS_PER_BLOCK, QWeight
from swaserve.engine.quant.dequant import (
    BLOCK_BYTES,
    FLOAT_TYPES,
    block_scales,
    dequantize,
    dequantize_rows,
    q4_0_codes,
    supported,
)
from swaserve.engine.quant.formats import dequantize_blocks
from swaserve.engine.quant.pages import release_pages
from swaserve.engine.quant.q4_repack import gguf_data

if TYPE_CHECKING:
    from swaserve.engine.config import CpuMatmul

log = logging.getLogger(__name__)

_CODES_TYPES = ("Q4_0", "Q8_0")  # block types with a cached int8-codes form on the exact path
_CHUNK_ELEMS = 1 << 20  # fp32 weight elements dequantized at once by the exact path (4 MiB)
_triton_module: Any = None  # engine.quant.triton_q4 once imported (None: not importable)
_triton_checked = False  # whether the import was tried


def expert_slice(w: QWeight, e: int) -> QWeight:
    """The 2-D QWeight of expert `e` of a stacked weight [E, N, K] (a view; cached with its repack)."""
    assert len(w.shape) == 3, f"{w.name}: expert_slice needs a stacked [E, N, K] weight, got {w.shape}"
    sub = w.cache.experts.get(e)
    if sub is None:
        sub = QWeight(w.qtype, tuple(w.shape[1:]), w.data[e], f"{w.name}[{e}]", mmapped=w.mmapped,
                      layout=w.layout)
        w.cache.experts[e] = sub
    return sub


def linear(x: torch.Tensor, w: QWeight, cpu_matmul: CpuMatmul = "exact") -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, for a 2-D QWeight [N, K]. `cpu_matmul` = "fast"
    also sends fp32/fp16 inputs of a CPU Q4_0 weight through the bf16 int4 kernel (bf16 accuracy)."""
    assert len(w.shape) == 2, f"{w.name}: linear needs a 2-D weight, got {w.shape} (use expert_slice)"
    n, k = w.shape
    assert x.shape[-1] == k, f"{w.name}: input has {x.shape[-1]} features, weight expects {k}"
    if w.qtype in FLOAT_TYPES and (w.data.dtype == x.dtype or x.is_cuda):
        return F.linear(x, w.data.to(x.dtype))
    if not supported(w.qtype):
        raise ValueError(f"{w.name}: unsupported QWeight type {w.qtype!r}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if w.layout and not x2.is_cuda:  # repacked for the GPU kernels: decode the GGUF bytes back
        w = QWeight(w.qtype, w.shape, gguf_data(w), w.name)
    if x2.is_cuda:
        y = _cuda_linear(x2, w)
    elif cpu_matmul == "native" and native_ok(w) and x2.dtype == torch.float32:
        y = native.mm(x2, interleaved(w), n)
    elif cpu_matmul == "native" and native_k_ok(w) and x2.dtype == torch.float32:
        y = native_k.mm(w.qtype, x2, w.data, n)
    elif w.qtype == "Q4_0" and n % 16 == 0 and (x2.dtype == torch.bfloat16 or cpu_matmul == "fast"):
        y = _int4_linear(x2.to(torch.bfloat16), w).to(x.dtype)
    else:
        y = _chunked_linear(x2, w)
    return y.reshape(*lead, n)


def native_ok(w: QWeight) -> bool:
    """Whether the native kernel computes this CPU weight (Q4_0, K a multiple of 32, kernels built)."""
    return (w.qtype == "Q4_0" and w.shape[-1] % WEIGHTS_PER_BLOCK == 0 and not w.data.is_cuda
            and native.available())


def native_k_ok(w: QWeight) -> bool:
    """Whether engine/quant/native_k computes this CPU weight (its type has a kernel there, whole blocks
    per row, rows contiguous: the stored bytes are read in place)."""
    return (native_k.supports(w.qtype, w.shape[-1]) and not w.data.is_cuda and w.data.is_contiguous()
            and native_k.available())


def interleaved(w: QWeight) -> torch.Tensor:
    """The cached interleaved form of a Q4_0 weight [..., N, K] (built now if `prepare_native` did not)."""
    form = w.cache.interleaved
    if form is None:
        n, k = w.shape[-2:]
        form = w.cache.interleaved = native.repack(w.data.contiguous(), n, k)
        _release(w)
    return form


def prepare_native(weights: list[QWeight], progress: bool | None = None) -> None:
    """Build the interleaved form of every weight the native kernel computes, once, at load: a progress
    bar over the bytes; each weight's file pages are released after its copy (resident ~1.0x file)."""
    todo = [w for w in weights if native_ok(w) and w.cache.interleaved is None]
    total = sum(w.data.numel() for w in todo)
    if not todo:
        return
    from tqdm import tqdm

    disable = None if progress is None else not progress  # None: a bar on a terminal only
    with tqdm(total=total, unit="B", unit_scale=True, desc="repacking Q4_0 weights", disable=disable,
              leave=False) as bar:
        for w in todo:
            interleaved(w)
            bar.update(w.data.numel())
    log.info("native Q4_0 kernels: %d weights repacked (%.2f GB)", len(todo), total / 1e9)


def _int4_pack(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached (packed int4 weight [N, K / 2], bf16 scales-and-zeros [K / 32, N, 2]) of a Q4_0 weight."""
    packed = w.cache.int4
    if packed is None:
        codes = q4_0_codes(w.data).to(torch.int32)  # [N, K] in [0, 16)
        wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # [N, K / 2] uint8
        d = block_scales(w.data, BLOCK_BYTES["Q4_0"]).t()  # [K / 32, N] fp32 (exact fp16 values)
        sz = torch.stack([d, torch.zeros_like(d)], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        packed = w.cache.int4 = (wp, sz)
        _release(w)
    return packed


def _int4_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    wp, sz = _int4_pack(w)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), wp, WEIGHTS_PER_BLOCK, sz)  # [M, N]


def _codes(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached (int8 codes [N, K / 32, 32], fp32 block scales [N, K / 32, 1]): weight = codes * d."""
    form = w.cache.codes
    if form is None:
        n, k = w.shape
        blocks = k // WEIGHTS_PER_BLOCK
        if w.qtype == "Q4_0":  # q - 8, in its own memory
            codes = q4_0_codes(w.data).view(torch.int8).sub_(8).view(n, blocks, WEIGHTS_PER_BLOCK)
        else:  # Q8_0: the int8 quants are used in place (a strided view of the stored blocks)
            codes = w.data.view(n, blocks, BLOCK_BYTES["Q8_0"])[..., 2:].view(torch.int8)
        d = block_scales(w.data, BLOCK_BYTES[w.qtype]).unsqueeze(-1)  # [N, K / 32, 1]
        form = w.cache.codes = (codes, d)
        if w.qtype == "Q4_0":
            _release(w)
    return form


def _chunked_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """Exact: dequantize row chunks of W into a reused buffer and multiply (fp32), -> [M, N]."""
    n, k = w.shape
    rows = min(n, max(16, _CHUNK_ELEMS // k))
    xf = x.to(torch.float32)
    yt = torch.empty(n, x.shape[0], dtype=torch.float32)  # [N, M]: chunks fill contiguous rows
    if w.qtype in FLOAT_TYPES:
        for r0 in range(0, n, rows):
            torch.mm(w.data[r0 : r0 + rows].to(torch.float32), xf.t(), out=yt[r0 : r0 + rows])
    elif w.qtype not in _CODES_TYPES:  # any other block type: decode the stored rows, chunk by chunk
        buf = torch.empty(rows, k, dtype=torch.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            b = dequantize_blocks(w.qtype, w.data[r0:r1], out=buf[: r1 - r0])  # [R, K] fp32, exact
            torch.mm(b, xf.t(), out=yt[r0:r1])
    else:
        codes, d = _codes(w)
        buf = torch.empty(rows, k // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK, dtype=torch.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            b = buf[: r1 - r0]
            b.copy_(codes[r0:r1]).mul_(d[r0:r1])  # [R, K/32, 32] fp32 = codes * d, exact
            torch.mm(b.view(r1 - r0, k), xf.t(), out=yt[r0:r1])
    return yt.t().to(x.dtype)


def _release(w: QWeight) -> None:
    if w.mmapped:
        release_pages(w.data)  # the cached form replaces the file pages in memory


def _triton() -> Any:
    global _triton_module, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        try:
            import swaserve.engine.quant.triton_q4 as module

            _triton_module = module
        except ImportError as e:  # pragma: no cover - depends on the install
            log.warning("the Triton quantized kernels are unavailable (%s); using dequantize + matmul", e)
    return _triton_module


def _cuda_linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    mod = _triton()
    if mod is not None and w.qtype in mod.WEIGHT_FORMATS:
        return mod.quant_linear(x, w)
    wd = w.cache.dequantized  # fallback: one dequantized copy in the compute dtype
    if wd is None or wd.dtype != x.dtype:
        wd = w.cache.dequantized = dequantize(w).to(x.dtype)
    return F.linear(x, wd)


def embedding(ids: torch.Tensor, w: QWeight) -> torch.Tensor:
    """Rows `ids` [T] of a 2-D weight [V, H] as fp32 [T, H] (dequantizes only those rows)."""
    assert len(w.shape) == 2, w.shape
    if w.cache.interleaved is not None and not ids.is_cuda:  # the file pages were released: read the copy
        return native.rows(w.cache.interleaved, w.shape[0], w.shape[1], ids)
    if w.qtype in FLOAT_TYPES:
        return w.data.index_select(0, ids.to(w.data.device)).to(torch.float32)
    return dequantize_rows(w, ids)
