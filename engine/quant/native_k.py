"""The native integer kernels for the GGUF block types other than Q4_0 (native_k.c): built on first use,
called through ctypes, as engine/quant/native.py does for Q4_0 (same cache directory and reasons).

Types: Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_0 (activations quantized per 32-block to 8 bits, ggml's Q8_0) and
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (activations per 256-block, Q8_K-like, with code sums per 16). The
lattice-codebook types (IQ1/IQ2/IQ3) have no kernel: callers keep the exact path for them.
The weights are the stored GGUF rows, read in place (no repacked copy: resident memory stays the file's).
Q4_0 is here for MoE layers that mix it with another type and for CPUs without AVX2; its main path is
native.py's interleaved kernel (engine/quant/linear.py tries that first).

Two builds of the one source: "simd" (AVX2/FMA/F16C, used when the CPU has them) and "scalar" (plain C,
the fallback on other x86-64 CPUs; the tests build both and compare). No compiler or a failed build ->
one warning line and `available()` False: callers keep the exact path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from swaserve.engine.quant.native import _cpu_ok, _threads, bind, compile_cached, moe_routing

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCES = (_DIR / "native_k.c", _DIR / "native_k_dots.h", _DIR / "native_k_multi.h", _DIR / "native_moe.h")
ABI = 1
_COMMON = ["-O3", "-fopenmp", "-fPIC", "-shared"]
CFLAGS = {"simd": [*_COMMON, "-march=native", "-mavx2", "-mfma", "-mf16c"], "scalar": _COMMON}
# type name -> (id in native_k.c's TYPES, weights per block, bytes per block, activation block)
TYPES = {
    "Q8_0": (0, 32, 34, 32), "Q4_1": (1, 32, 20, 32), "Q5_0": (2, 32, 22, 32), "Q5_1": (3, 32, 24, 32),
    "IQ4_NL": (4, 32, 18, 32), "Q4_K": (5, 256, 144, 256), "Q5_K": (6, 256, 176, 256),
    "Q6_K": (7, 256, 210, 256), "IQ4_XS": (8, 256, 136, 256), "Q4_0": (9, 32, 18, 32),
    "Q2_K": (10, 256, 84, 256), "Q3_K": (11, 256, 110, 256),
}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_SIGNATURES = {
    "swa_k_abi": ([], _C),
    "swa_k_simd": ([], _C),
    "swa_k_ntypes": ([], _C),
    "swa_k_quant": ([_C, _P, _I, _I, _P, _P, _P], None),
    "swa_k_mm": ([_C, _P, _I, _I, _P, _I, _P, _C], None),
    "swa_k_moe": ([_C, _C, _P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, _C], None),
}
_libs: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def _build(variant: str) -> Path:
    return compile_cached(f"swaserve_k_{variant}", [SOURCES[0]], list(SOURCES[1:]), CFLAGS[variant],
                          "the native kernels of the other GGUF types")


@functools.cache
def default_variant() -> str:
    """"simd" on a CPU with AVX2/FMA/F16C (Linux), else "scalar" (read once: every linear asks)."""
    return "scalar" if _cpu_ok() else "simd"


def load(variant: str | None = None) -> ctypes.CDLL | None:
    """The kernel library of `variant` (default: the CPU's), built on first use; None (logged once) when it
    cannot be had."""
    variant = variant or default_variant()
    if variant in _libs:
        return _libs[variant]
    lib = None
    try:
        cand = bind(ctypes.CDLL(str(_build(variant))), _SIGNATURES)
        if cand.swa_k_abi() != ABI or cand.swa_k_ntypes() != len(TYPES):
            raise RuntimeError(f"library ABI {cand.swa_k_abi()} / {cand.swa_k_ntypes()} types != {ABI}")
        lib = cand
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why[variant] = str(e)
        log.warning("native kernels for the other GGUF types unavailable (%s); those linears use the exact "
                    "path", e)
    _libs[variant] = lib
    return lib


def available(variant: str | None = None) -> bool:
    return load(variant) is not None


def why_unavailable(variant: str | None = None) -> str:
    load(variant)
    return _why.get(variant or default_variant(), "")


def _lib(variant: str | None) -> ctypes.CDLL:
    lib = load(variant)
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {why_unavailable(variant)}")
    return lib


def supports(qtype: str, k: int) -> bool:
    """Whether a kernel computes a `qtype` weight of `k` input features (whole blocks)."""
    return qtype in TYPES and k % TYPES[qtype][1] == 0


def _check(qtype: str, data: torch.Tensor, n: int, k: int) -> int:
    if not supports(qtype, k):
        raise ValueError(f"no native kernel for {qtype} with {k} input features")
    tid, elems, nbytes, _ = TYPES[qtype]
    assert data.dtype == torch.uint8 and data.is_contiguous() and not data.is_cuda, (data.dtype, data.device)
    assert data.shape[-1] == k // elems * nbytes, (qtype, data.shape, k)
    assert data.numel() % (n * data.shape[-1]) == 0, (qtype, data.shape, n)
    return tid


def quant(qtype: str, x: torch.Tensor, variant: str | None = None) -> tuple[torch.Tensor, ...]:
    """The activations a `qtype` kernel sees for x fp32 [M, K]: (int8 codes [M, K], fp32 scales
    [M, K / block], int16 code sums [M, K / 32 or K / 16])."""
    tid, _, _, act = TYPES[qtype]
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // act, dtype=torch.float32)
    s = torch.empty(m, k // 32 if act == 32 else k // 16, dtype=torch.int16)
    _lib(variant).swa_k_quant(tid, x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def mm(qtype: str, x: torch.Tensor, data: torch.Tensor, n: int, threads: int | None = None,
       variant: str | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ W^T -> fp32 [M, n], W the stored `qtype` rows uint8 [n, row bytes] (x quantized
    inside)."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    tid = _check(qtype, data, n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        _lib(variant).swa_k_mm(tid, x.data_ptr(), m, k, data.data_ptr(), n, y.data_ptr(), _threads(threads))
    return y


def moe(x: torch.Tensor, gu_type: str, gate_up: torch.Tensor, dn_type: str, down: torch.Tensor, inter: int,
        topk_ids: torch.Tensor, topk_weights: torch.Tensor, threads: int | None = None,
        variant: str | None = None) -> torch.Tensor:
    """Routed MoE of one layer in one call: x fp32 [T, H]; gate_up the stored rows uint8 [E, 2I, bytes(H)]
    of `gu_type`, down uint8 [E, H, bytes(I)] of `dn_type`; topk_ids int64 [T, k], topk_weights [T, k]
    -> fp32 [T, H] = sum_j w_j * down_e(gelu_tanh(gate_e x) * up_e x)."""
    x = x.to(torch.float32).contiguous()
    t, h = x.shape
    e = gate_up.shape[0]
    t1, t2 = _check(gu_type, gate_up, 2 * inter, h), _check(dn_type, down, h, inter)
    assert gate_up.shape[:2] == (e, 2 * inter) and down.shape[:2] == (e, h), (gate_up.shape, down.shape)
    ids, w = moe_routing(topk_ids, topk_weights, e)
    out = torch.empty(t, h, dtype=torch.float32)
    if t:
        _lib(variant).swa_k_moe(t1, t2, x.data_ptr(), t, h, gate_up.data_ptr(), down.data_ptr(), e, inter,
                                ids.data_ptr(), w.data_ptr(), ids.shape[1], out.data_ptr(), _threads(threads))
    return out
