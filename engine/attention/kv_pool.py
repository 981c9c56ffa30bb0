"""KV tensors of the two paged pools (full-attention layers and sliding layers).

Page ids are handed out by engine/kvcache (plain Python); this module only owns the memory.
Layout per group g: k[g], v[g]: [num_layers_g, num_pages * page_size, KVH_g, D_g].
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.swa_k, self.swa_v))
