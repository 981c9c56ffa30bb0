"""How the KV pools store K and V: one storage type per side (`--kv-cache-dtype`, `--kv-cache-dtype-k`,
`--kv-cache-dtype-v`).

Types: fp32, fp16, bf16 (plain elements); q8_0 (llama.cpp's block_q8_0: per 32 values of a head row,
one fp16 scale d = amax / 127 then 32 int8 q = round(x / d), 34 bytes, x = d * q; the pool's views of a
q8_0 side are uint8 [slots, KVH, D / 32 * 34], a head row is D / 32 whole blocks); fp8_e4m3 (torch's
float8_e4m3fn, per-tensor scale 1.0 as vLLM without calibrated scales, values clamped to +-448; CUDA
only, the triton backend). A KVFormat is the pair (K type, V type); engine/quant/kv_quant.py converts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.engine.config import CacheConfig

Q8_BLOCK = 32  # values per q8_0 block
Q8_BLOCK_BYTES = 34  # fp16 scale + 32 int8
FLAG = "--kv-cache-dtype"
# what `auto` stores per device type: q8_0 on CPU (the smallest type whose forced-sequence error stays
# within llama.cpp's own -ctk/-ctv f16 one, at fp16's decode speed: docs/benchmarks.md, KV accuracy),
# except fp16 under --cpu-matmul exact (the accuracy path); bf16 on CUDA
AUTO = {"cpu": "q8_0", "cuda": "bf16"}
AUTO_EXACT_CPU = "fp16"


def auto_type(device: torch.device, cpu_matmul: str = "native") -> str:
    """The KV type `--kv-cache-dtype auto` names on `device`: bf16 on CUDA; on CPU (and elsewhere) q8_0,
    fp16 with `--cpu-matmul exact`."""
    if device.type != "cuda" and cpu_matmul == "exact":
        return AUTO_EXACT_CPU
    return AUTO.get(device.type, AUTO["cpu"])


@dataclass(frozen=True)
class KVType:
    name: str
    storage: torch.dtype  # element dtype of the pool's views (uint8 for q8_0)
    block: int  # values per block (1: plain elements)
    block_bytes: int

    @property
    def quantized(self) -> bool:
        """Blocks with a scale (the views hold bytes, not values)."""
        return self.block > 1

    @property
    def align(self) -> int:
        """Byte alignment a row of this type needs (q8_0: its fp16 scales)."""
        return 2 if self.quantized else self.storage.itemsize

    def row_bytes(self, dim: int) -> int:
        """Bytes of one head row of `dim` values."""
        return dim // self.block * self.block_bytes

    def row_elements(self, dim: int) -> int:
        """Storage elements (the views' last dimension) of one head row of `dim` values."""
        return self.row_bytes(dim) // self.storage.itemsize


KV_TYPES: dict[str, KVType] = {
    "fp32": KVType("fp32", torch.float32, 1, 4),
    "fp16": KVType("fp16", torch.float16, 1, 2),
    "bf16": KVType("bf16", torch.bfloat16, 1, 2),
    "q8_0": KVType("q8_0", torch.uint8, Q8_BLOCK, Q8_BLOCK_BYTES),
    "fp8_e4m3": KVType("fp8_e4m3", torch.float8_e4m3fn, 1, 1),
}
_BY_DTYPE = {t.storage: t for t in KV_TYPES.values() if not t.quantized}


@dataclass(frozen=True)
class KVFormat:
    k: KVType
    v: KVType

    @property
    def name(self) -> str:
        """"q8_0" when both sides share a type, else "K q8_0 / V fp16"."""
        return self.k.name if self.k == self.v else f"K {self.k.name} / V {self.v.name}"

    @property
    def buffer_dtype(self) -> torch.dtype:
        """dtype of an arena buffer: the shared storage dtype, else bytes (each side viewed as its own)."""
        return self.k.storage if self.k.storage == self.v.storage else torch.uint8

    @property
    def align(self) -> int:
        return max(self.k.align, self.v.align)

    def token_bytes(self, layers: int, heads: int, dim: int) -> int:
        """Bytes of one token's K and V over `layers` layers of `heads` heads of `dim` values."""
        return layers * heads * (self.k.row_bytes(dim) + self.v.row_bytes(dim))

    def check(self, head_dims: tuple[int, ...]) -> None:
        """ValueError when a head dim is not a whole number of blocks of a side's type."""
        for side, t in (("K", self.k), ("V", self.v)):
            bad = [d for d in head_dims if d % t.block]
            if bad:
                raise ValueError(f"{FLAG} {t.name} (for {side}) stores blocks of {t.block} values; head_dim "
                                 f"{bad[0]} of this model is not a multiple of {t.block}: use fp16, bf16 or "
                                 f"fp32")


def as_format(kv: KVFormat | torch.dtype) -> KVFormat:
    """A KVFormat; a plain float dtype means that type for K and V."""
    if isinstance(kv, KVFormat):
        return kv
    if kv not in _BY_DTYPE:
        raise ValueError(f"no KV type stores {kv}")
    return KVFormat(_BY_DTYPE[kv], _BY_DTYPE[kv])


def kv_format(name: str, device: torch.device, k: str | None = None, v: str | None = None,
              cpu_matmul: str = "native") -> KVFormat:
    """The format `--kv-cache-dtype name` (auto: auto_type) with the optional per-side
    `--kv-cache-dtype-k` / `--kv-cache-dtype-v` overrides; ValueError naming the flag for a bad value."""
    base = auto_type(device, cpu_matmul) if name == "auto" else name
    sides = []
    for flag, side in ((FLAG, base), (FLAG + "-k", k or base), (FLAG + "-v", v or base)):
        if side not in KV_TYPES:
            raise ValueError(f"{flag} {side!r}: choose auto, {', '.join(KV_TYPES)}")
        if side == "fp8_e4m3" and device.type != "cuda":
            raise ValueError(f"{flag} fp8_e4m3 needs CUDA (the triton attention backend reads it); on "
                             f"{device.type} use q8_0 (8 bits with an fp16 scale per 32 values)")
        sides.append(KV_TYPES[side])
    return KVFormat(sides[1], sides[2])


def kv_format_of(cache: CacheConfig, device: torch.device, cpu_matmul: str = "native") -> KVFormat:
    """The format a CacheConfig asks for (kv_cache_dtype and its per-side overrides; `auto` as auto_type
    resolves it for the engine's --cpu-matmul)."""
    return kv_format(cache.kv_cache_dtype, device, cache.kv_cache_dtype_k, cache.kv_cache_dtype_v, cpu_matmul)
