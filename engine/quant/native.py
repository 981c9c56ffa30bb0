"""The native Q4_0 x Q8_0 CPU kernels (native_q4.c): built on first use, called through ctypes.

Why plain C + ctypes (not torch's cpp_extension): the C file compiles with gcc in ~1-2 s (a torch
extension needs the torch headers: 1-9 minutes on the 2-core build machine), has no ABI tie to the
torch version, and ctypes releases the GIL for the whole call, so the server's threads run while a
kernel does. The shared library is cached under $SWASERVE_CACHE (default ~/.cache/swaserve)/native,
keyed by a hash of the source and the compiler flags; a fresh clone needs no build step.

`available()` is False (with one warning line saying why) when there is no compiler, the CPU lacks
AVX2/FMA/F16C, or the build fails: the callers then keep the exact path.

Tensors passed in are CPU, contiguous; shapes are in each wrapper's docstring. The interleaved weight
form is described in native_q4.c (rows in groups of 8, same bytes as the GGUF rows, reordered).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f)
           for f in ("native_q4.c", "native_q4_moe.c", "native_ops.c", "native_step.c")]
# included by SOURCES: part of the cache key
HEADERS = [Path(__file__).with_name(f) for f in ("native_avx.h", "native_moe.h", "native_q4.h")]
ABI = 5  # swa_q4_abi() of the source this wrapper was written for
CFLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
ROWS = 8  # weight rows per interleaved group
_GROUP_BLOCK_BYTES = 144  # one 32-block of each of the 8 rows: 8 x 16 nibble bytes + 8 fp16 scales

_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "swa_q4_abi": ([], ctypes.c_int),
    "swa_q4_vnni": ([], ctypes.c_int),
    "swa_q4_packed_bytes": ([_I, _I], ctypes.c_int64),
    "swa_q4_repack": ([_P, _I, _I, _P, ctypes.c_int], None),
    "swa_q4_unpack": ([_P, _I, _I, _P], None),
    "swa_q4_rows": ([_P, _I, _I, _P, _I, _P], None),
    "swa_q8_quant": ([_P, _I, _I, _P, _P, ctypes.c_int], None),
    "swa_q4_mm": ([_P, _I, _I, _P, _I, _P, ctypes.c_int], None),
    "swa_q4_moe": ([_P, _I, _I, _P, _P, _I, _I, _P, _P, _I, _P, ctypes.c_int], None),
    "swa_rms_norm": ([_P, _I, _I, _P, _F, _P, _P], None),
    "swa_norm_rope": ([_P, _I, _I, _I, _P, _F, _P, _P, _I, _I], None),
    "swa_ffn_tail": ([_P, _P, _P, _P, _P, _F, _F, _P, _I, _I], None),
    "swa_router": ([_P, _I, _I, _P, _F, _P, _I, _I, _P, _P, _P], None),
    "swa_decode_attn": ([_P, _P, _I, _I, _I, _I, _P, _I, _I, ctypes.c_int, _P, _I, _I, ctypes.c_int, _P, _I,
                         _P, _P, ctypes.c_int], None),
    "swa_kv_gather": ([_P, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "swa_kv_store_q8": ([_P, _I, _I, _I, _P, _I, _I, _P, ctypes.c_int], None),
    "swa_gelu_mul": ([_P, _P, _P, _I, _I], None),
    "swa_decode_step": ([_P, _I, _P], None),
    "swa_step_sizes": ([], ctypes.c_int64),
}


def _cache_dir() -> Path:
    root = os.environ.get("SWASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swaserve")
    return Path(root) / "native"


def _cpu_flags() -> str:
    """The first `flags` line of /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_ok() -> str:
    """'' when the CPU has the instructions the kernels use, else the reason."""
    if sys.platform != "linux":
        return f"platform {sys.platform} (the native kernels are built for Linux)"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma", "f16c") if f" {f}" not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else ""


def compile_cached(stem: str, sources: list[Path], headers: list[Path], flags: list[str], what: str,
                   key_extra: str = "") -> Path:
    """Compile `sources` with `flags` into $SWASERVE_CACHE/native/<stem>_<key>.so once and return its
    path; the key hashes the sources, the headers they include, the flags and `key_extra`. Shared by
    this module and native_k.py."""
    src = b"".join(p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(src + " ".join(flags).encode() + key_extra.encode()).hexdigest()[:16]
    out = _cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building %s (%s, once)", what, out.name)
    # built aside and renamed: concurrent builders never load half a file
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        res = subprocess.run([cc, *flags, "-o", str(part), *map(str, sources), "-lm"], capture_output=True,
                             text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip().splitlines()[-1] if res.stderr else '?'}")
        os.replace(part, out)
    return out


def bind(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """Set argtypes/restype of each named function of `lib`; returns `lib`."""
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the C sources into the cache (once per sources + flags + CPU), return the library path.
    The CPU's flags are part of the key: -march=native code (VNNI, AVX512) must not be loaded from a
    cache shared with a machine that lacks them."""
    return compile_cached("swaserve_q4", SOURCES, HEADERS, [*CFLAGS, *extra_flags], "the native Q4_0 kernels",
                          key_extra=_cpu_flags())


def _open(path: Path) -> ctypes.CDLL:
    lib = bind(ctypes.CDLL(str(path)), _SIGNATURES)
    if lib.swa_q4_abi() != ABI:
        raise RuntimeError(f"library ABI {lib.swa_q4_abi()} != {ABI}")
    return lib


def build_variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels built with extra compiler flags (e.g. ("-mno-avxvnni", "-mno-avx512vnni") for the
    maddubs path on a VNNI machine): the tests compare ISA paths, which must give the same bits."""
    return _open(_build(tuple(extra_flags)))


def vnni() -> bool:
    """Whether the loaded kernels compute the integer dots with VNNI (vpdpbusd)."""
    return bool(_lib_or_raise().swa_q4_vnni())


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None (logged once) when it cannot be had here."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    _tried = True
    _why_not = _cpu_ok()
    if not _why_not:
        try:
            # no OMP_WAIT_POLICY here: torch loaded libgomp first, which read the environment then (a
            # setdefault at this point never took effect; docs/benchmarks.md, threads on a busy machine)
            _lib = _open(_build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not = str(e)
    if _lib is None:
        log.warning("native Q4_0 kernels unavailable (%s); CPU Q4_0 linears use the exact path", _why_not)
    return _lib


def available() -> bool:
    return load() is not None


def why_unavailable() -> str:
    load()
    return _why_not


def _lib_or_raise() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"native Q4_0 kernels unavailable: {_why_not}")
    return lib


def _threads(threads: int | None) -> int:
    return threads if threads is not None else torch.get_num_threads()


def packed_bytes(n: int, k: int) -> int:
    """Bytes of the interleaved form of an [n, k] Q4_0 weight (== the GGUF bytes, rows padded to 8)."""
    return (n + ROWS - 1) // ROWS * (k // 32) * _GROUP_BLOCK_BYTES


def repack(data: torch.Tensor, n: int, k: int, threads: int | None = None) -> torch.Tensor:
    """GGUF Q4_0 rows uint8 [n, k/32 * 18] (or a stack [E, n, ...]) -> interleaved uint8 [E?, packed]."""
    lib = _lib_or_raise()
    assert data.dtype == torch.uint8 and data.is_contiguous() and k % 32 == 0, (data.dtype, k)
    lead = data.shape[:-2] if data.dim() == 3 else ()
    count = data.shape[0] if lead else 1
    size = packed_bytes(n, k)
    out = torch.empty(*lead, size, dtype=torch.uint8)
    src_stride = n * (k // 32) * 18
    for i in range(count):
        lib.swa_q4_repack(data.data_ptr() + i * src_stride, n, k, out.data_ptr() + i * size,
                          _threads(threads))
    return out


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `repack` for one weight: uint8 [n, k/32 * 18] in GGUF order."""
    out = torch.empty(n, k // 32 * 18, dtype=torch.uint8)
    _lib_or_raise().swa_q4_unpack(packed.data_ptr(), n, k, out.data_ptr())
    return out


def rows(packed: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [R] of an interleaved [n, k] weight, dequantized exactly: fp32 [R, k]."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"row ids out of range [0, {n})")
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    _lib_or_raise().swa_q4_rows(packed.data_ptr(), n, k, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


def q8_quant(x: torch.Tensor, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (int8 codes [M, K], fp32 scales [M, K/32]): ggml's Q8_0 (fp16-rounded scales)."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    _lib_or_raise().swa_q8_quant(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), _threads(threads))
    return q, d


def mm(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None, *,
       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ W^T -> fp32 [M, n] for an interleaved [n, K] weight (x quantized to Q8_0 inside)."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    assert packed.numel() == packed_bytes(n, k), (packed.numel(), n, k)
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        (lib or _lib_or_raise()).swa_q4_mm(x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(),
                                           _threads(threads))
    return y


def mm_packed(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`mm` without the checks, for a caller that guarantees them (the model's native path, once per
    linear): x fp32 [M, K] contiguous, `packed` the interleaved [n, K] weight, the kernels loaded."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    (_lib or _lib_or_raise()).swa_q4_mm(x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(),
                                        torch.get_num_threads())
    return y


def moe_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing arguments of the native MoE calls: int64 ids and fp32 weights [T, k], contiguous;
    IndexError for an expert id outside [0, experts) (the C code would read out of bounds)."""
    ids = topk_ids.to(torch.int64).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise IndexError(f"expert ids out of range [0, {experts})")
    return ids, w


def moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, inter: int, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor, threads: int | None = None, *,
        lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Routed MoE of one layer in one call: x fp32 [T, H]; gate_up uint8 [E, packed(2I, H)], down uint8
    [E, packed(H, I)] (interleaved, I = `inter`); topk_ids int64 [T, k], topk_weights fp32 [T, k]
    -> fp32 [T, H] = sum_j w_j * down_e(gelu_tanh(gate_e x) * up_e x). `lib`: another build (tests)."""
    x = x.to(torch.float32).contiguous()
    t, h = x.shape
    e = gate_up.shape[0]
    assert gate_up.shape[-1] == packed_bytes(2 * inter, h) and down.shape[-1] == packed_bytes(h, inter)
    ids, w = moe_routing(topk_ids, topk_weights, e)
    out = torch.empty(t, h, dtype=torch.float32)
    if t:
        (lib or _lib_or_raise()).swa_q4_moe(x.data_ptr(), t, h, gate_up.data_ptr(), down.data_ptr(), e, inter,
                                   ids.data_ptr(), w.data_ptr(), ids.shape[1], out.data_ptr(),
                                   _threads(threads))
    return out
