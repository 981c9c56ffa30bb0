"""KV tensors of the two paged pools (full-attention layers and sliding layers).

Page ids are handed out by engine/kvcache (plain Python); this module only owns the memory.
KVPool: two separate pools; per group g: k[g], v[g]: [num_layers_g, num_pages * page_size, KVH_g, D_g].
ArenaKVPool: both kinds carved from one buffer of blocks (the engine's layout, see arena_geometry).
"""

from __future__ import annotations

import torch

from swaserve.engine.config import ModelConfig

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_kv_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r} (choose auto, bf16, fp16 or fp32)")
    return _DTYPES[name]


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(full-pool bytes per token, SWA-pool bytes per token), K and V over all layers of a group."""
    el = torch.empty((), dtype=dtype).element_size()
    full = len(cfg.full_layers) * cfg.num_kv_heads_full * cfg.head_dim_full * 2 * el
    swa = len(cfg.swa_layers) * cfg.num_kv_heads_swa * cfg.head_dim_swa * 2 * el
    return full, swa


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        full_pages: int,
        swa_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.cfg = cfg
        self.page_size = page_size
        self.full_pages = full_pages
        self.swa_pages = swa_pages
        self.dtype = dtype
        self.device = device
        nf, ns = len(cfg.full_layers), len(cfg.swa_layers)
        self.full_k = torch.zeros(nf, full_pages * page_size, cfg.num_kv_heads_full, cfg.head_dim_full,
                                  dtype=dtype, device=device)
        self.full_v = torch.zeros_like(self.full_k)
        self.swa_k = torch.zeros(ns, swa_pages * page_size, cfg.num_kv_heads_swa, cfg.head_dim_swa,
                                 dtype=dtype, device=device)
        self.swa_v = torch.zeros_like(self.swa_k)
        self._kind = list(cfg.layer_types)
        self._gidx = [cfg.group_index(i) for i in range(cfg.num_layers)]

    def layer_kind(self, layer: int) -> str:
        return self._kind[layer]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [num_slots, KVH, D] views into the pool."""
        g = self._gidx[layer]
        if self._kind[layer] == "full":
            return self.full_k[g], self.full_v[g]
        return self.swa_k[g], self.swa_v[g]

    def tensors(self) -> list[torch.Tensor]:
        """The storage (to fill or make resident)."""
        return [self.full_k, self.full_v, self.swa_k, self.swa_v]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def arena_geometry(cfg: ModelConfig) -> tuple[int, int, int]:
    """(full pages per block, elements per full-pool token, elements per SWA-pool token) of an arena.

    A token of one kind is stored as one record: K then V of every layer of its group,
    [2, layers, KVH, D]. A block holds page_size SWA tokens or full_per_block * page_size full tokens,
    so full_per_block = SWA record / full record, rounded down, and the records are padded to make
    the block exact (no padding on Gemma 4: 102400 = 10 x 10240 elements per token)."""
    swa = 2 * len(cfg.swa_layers) * cfg.num_kv_heads_swa * cfg.head_dim_swa
    full = 2 * len(cfg.full_layers) * cfg.num_kv_heads_full * cfg.head_dim_full
    k = max(1, swa // full)
    full_rec = max(full, -(-swa // k))
    return k, full_rec, k * full_rec


class ArenaKVPool(KVPool):
    """Both kinds' KV in one buffer of num_blocks blocks (engine/kvcache/arena.py hands out the ids).

    SWA page s is block s; full page f is the f % k-th slice of block f // k. Every layer's K (or V) is
    a strided view [num_slots, KVH, D] with slot = page * page_size + offset, exactly as in the split
    layout, so the attention backends address it unchanged (row stride = the token record)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg = cfg
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = num_blocks
        self.full_per_block, self.full_record, self.swa_record = arena_geometry(cfg)
        self.full_pages = num_blocks * self.full_per_block
        self.swa_pages = num_blocks
        self.buffer = torch.zeros(num_blocks * page_size * self.swa_record, dtype=dtype, device=device)
        self._kind = list(cfg.layer_types)
        self._gidx = [cfg.group_index(i) for i in range(cfg.num_layers)]
        nf, ns = len(cfg.full_layers), len(cfg.swa_layers)
        self._full = [self._views(self.full_record, nf, cfg.num_kv_heads_full, cfg.head_dim_full,
                                  self.full_pages, g) for g in range(nf)]
        self._swa = [self._views(self.swa_record, ns, cfg.num_kv_heads_swa, cfg.head_dim_swa,
                                 self.swa_pages, g) for g in range(ns)]

    def _views(self, record: int, layers: int, heads: int, dim: int, pages: int, g: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        size, stride = (pages * self.page_size, heads, dim), (record, dim, 1)
        k = self.buffer.as_strided(size, stride, g * heads * dim)
        v = self.buffer.as_strided(size, stride, (layers + g) * heads * dim)
        return k, v

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer: [num_slots, KVH, D] strided views into the buffer."""
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
