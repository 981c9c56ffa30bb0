"""KV tensors of the two paged pools (full-attention layers and sliding layers).

Page ids are handed out by engine/kvcache (plain Python); this module only owns the memory.
KVPool: two separate pools; per group g: k[g], v[g]: [num_layers_g, num_pages * page_size, KVH_g, R_g],
R = the storage elements of a head row of D values (D for float types, D / 32 * 34 bytes for q8_0:
engine/attention/kv_format.py).
ArenaKVPool: both kinds carved from one buffer of blocks (the engine's layout, see arena_geometry).
"""

from __future__ import annotations

import torch

from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat, as_format, auto_type
from swaserve.engine.config import ModelConfig

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_kv_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a float KV type name (auto: the float type kv_format.auto_type names, fp16 on
    CPU, bf16 on CUDA); see kv_format.kv_format for every type."""
    if name == "auto":
        name = auto_type(device, "exact")
    if name not in _DTYPES:
        raise ValueError(f"unknown float kv cache dtype {name!r} (choose auto, bf16, fp16 or fp32)")
    return _DTYPES[name]


def bytes_per_token(cfg: ModelConfig, kv: KVFormat | torch.dtype) -> tuple[int, int]:
    """(full-pool bytes per token, SWA-pool bytes per token), K and V over all layers of a group."""
    fmt = as_format(kv)
    full = fmt.token_bytes(len(cfg.full_layers), cfg.num_kv_heads_full, cfg.head_dim_full)
    swa = fmt.token_bytes(len(cfg.swa_layers), cfg.num_kv_heads_swa, cfg.head_dim_swa)
    return full, swa


def _check(cfg: ModelConfig, fmt: KVFormat) -> None:
    groups = ((cfg.head_dim_full, cfg.full_layers), (cfg.head_dim_swa, cfg.swa_layers))
    fmt.check(tuple(d for d, layers in groups if layers))


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        full_pages: int,
        swa_pages: int,
        page_size: int,
        kv: KVFormat | torch.dtype,
        device: torch.device,
    ):
        self.kv_format = fmt = as_format(kv)
        _check(cfg, fmt)
        self.cfg = cfg
        self.page_size = page_size
        self.full_pages = full_pages
        self.swa_pages = swa_pages
        self.dtype = fmt.k.storage  # the K views' element dtype (uint8 for q8_0)
        self.device = device
        nf, ns = len(cfg.full_layers), len(cfg.swa_layers)

        def side(t: str, layers: int, slots: int, heads: int, dim: int) -> torch.Tensor:
            typ = getattr(fmt, t)
            return torch.zeros(layers, slots, heads, typ.row_elements(dim), dtype=typ.storage, device=device)

        self.full_k = side("k", nf, full_pages * page_size, cfg.num_kv_heads_full, cfg.head_dim_full)
        self.full_v = side("v", nf, full_pages * page_size, cfg.num_kv_heads_full, cfg.head_dim_full)
        self.swa_k = side("k", ns, swa_pages * page_size, cfg.num_kv_heads_swa, cfg.head_dim_swa)
        self.swa_v = side("v", ns, swa_pages * page_size, cfg.num_kv_heads_swa, cfg.head_dim_swa)
        self._kind = list(cfg.layer_types)
        self._gidx = [cfg.group_index(i) for i in range(cfg.num_layers)]

    def layer_kind(self, layer: int) -> str:
        return self._kind[layer]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [num_slots, KVH, R] views into the pool."""
        g = self._gidx[layer]
        if self._kind[layer] == "full":
            return self.full_k[g], self.full_v[g]
        return self.swa_k[g], self.swa_v[g]

    def tensors(self) -> list[torch.Tensor]:
        """The storage (to fill or make resident)."""
        return [self.full_k, self.full_v, self.swa_k, self.swa_v]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_per_token(self) -> tuple[int, int]:
        """(full, SWA) bytes of one token's K and V over its pool's layers (no padding)."""
        return bytes_per_token(self.cfg, self.kv_format)


def _v_offset(fmt: KVFormat, layers: int, heads: int, dim: int) -> int:
    """Byte offset of V in a token record: after every layer's K, rounded up to the V rows' alignment."""
    k_bytes = layers * heads * fmt.k.row_bytes(dim)
    return -(-k_bytes // fmt.v.align) * fmt.v.align


def _record_bytes(fmt: KVFormat, layers: int, heads: int, dim: int) -> int:
    return _v_offset(fmt, layers, heads, dim) + layers * heads * fmt.v.row_bytes(dim)


def arena_geometry(cfg: ModelConfig, kv: KVFormat | torch.dtype | None = None) -> tuple[int, int, int]:
    """(full pages per block, full-pool token record, SWA-pool token record), records in elements of the
    arena buffer (KVFormat.buffer_dtype: the values' dtype for float types, bytes for q8_0 or mixed K/V).

    A token of one kind is stored as one record: K of every layer of its group, then V (at an offset
    aligned for its rows), [2, layers, KVH, R]. A block holds page_size SWA tokens or full_per_block *
    page_size full tokens, so full_per_block = SWA record / full record, rounded down, and the records are
    padded to make the block exact (and to the alignment of the types' rows). No padding on Gemma 4:
    102400 = 10 x 10240 values per token, in any type (q8_0: 108800 = 10 x 10880 bytes). `kv` None: a
    float type (the answer is the same for all of them)."""
    fmt = as_format(kv) if kv is not None else KVFormat(KV_TYPES["fp32"], KV_TYPES["fp32"])
    unit = fmt.buffer_dtype.itemsize
    full_b = _record_bytes(fmt, len(cfg.full_layers), cfg.num_kv_heads_full, cfg.head_dim_full)
    swa_b = _record_bytes(fmt, len(cfg.swa_layers), cfg.num_kv_heads_swa, cfg.head_dim_swa)
    swa, full = -(-swa_b // unit), max(1, -(-full_b // unit))
    align = max(1, fmt.align // unit)
    k = max(1, swa // full)
    full_rec = -(-max(full, -(-swa // k)) // align) * align
    return k, full_rec, k * full_rec


class ArenaKVPool(KVPool):
    """Both kinds' KV in one buffer of num_blocks blocks (engine/kvcache/arena.py hands out the ids).

    SWA page s is block s; full page f is the f % k-th slice of block f // k. Every layer's K (or V) is
    a strided view [num_slots, KVH, R] with slot = page * page_size + offset, exactly as in the split
    layout, so the attention backends address it unchanged (row stride = the token record). The buffer
    is one dtype (KVFormat.buffer_dtype); a side of another type is a view of it as that type."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, page_size: int, kv: KVFormat | torch.dtype,
                 device: torch.device):
        self.kv_format = fmt = as_format(kv)
        _check(cfg, fmt)
        self.cfg = cfg
        self.page_size = page_size
        self.dtype = fmt.buffer_dtype  # of the buffer (the views' for float types)
        self.device = device
        self.num_blocks = num_blocks
        self.full_per_block, self.full_record, self.swa_record = arena_geometry(cfg, fmt)
        self.full_pages = num_blocks * self.full_per_block
        self.swa_pages = num_blocks
        self.buffer = torch.zeros(num_blocks * page_size * self.swa_record, dtype=self.dtype, device=device)
        self._kind = list(cfg.layer_types)
        self._gidx = [cfg.group_index(i) for i in range(cfg.num_layers)]
        nf, ns = len(cfg.full_layers), len(cfg.swa_layers)
        self._full = [self._views(self.full_record, nf, cfg.num_kv_heads_full, cfg.head_dim_full,
                                  self.full_pages, g) for g in range(nf)]
        self._swa = [self._views(self.swa_record, ns, cfg.num_kv_heads_swa, cfg.head_dim_swa,
                                 self.swa_pages, g) for g in range(ns)]

    def _views(self, record: int, layers: int, heads: int, dim: int, pages: int, g: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of group member g; byte offsets: K rows of the layers before g; V's after every K."""
        fmt, unit = self.kv_format, self.buffer.element_size()
        k_row, v_row = fmt.k.row_bytes(dim), fmt.v.row_bytes(dim)
        out = []
        for typ, row, start in ((fmt.k, k_row, g * heads * k_row),
                                (fmt.v, v_row, _v_offset(fmt, layers, heads, dim) + g * heads * v_row)):
            base = self.buffer if typ.storage == self.dtype else self.buffer.view(typ.storage)
            el = typ.storage.itemsize
            assert start % el == 0 and record * unit % el == 0, "rows must be aligned to their type"
            size = (pages * self.page_size, heads, row // el)
            out.append(base.as_strided(size, (record * unit // el, row // el, 1), start // el))
        return out[0], out[1]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [num_slots, KVH, R] strided views into the buffer."""
        g = self._gidx[layer]
        return self._full[g] if self._kind[layer] == "full" else self._swa[g]

    def page_tensor(self, kind: str) -> torch.Tensor:
        """Every page of one kind as a row of its raw elements: [num_pages, page_size * record] (a view)."""
        if kind == "full":
            return self.buffer.view(self.full_pages, self.page_size * self.full_record)
        return self.buffer.view(self.swa_pages, self.page_size * self.swa_record)

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffer]

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
