"""MoE with the routed experts kept in host memory (stored form; Q4_0 repacked for the kernels).

Three paths, picked per call:
- host: experts computed on the CPU with engine.quant.linear (the only path on a CPU device);
- cache (decode-sized batches): the fused Triton MoE reads each expert from a device cache slot when
  resident, else straight from the registered host buffer (zero copy); the cache is filled one step
  behind from bitmaps of the used experts, with copies on a side stream, so the router ids are never
  read back in the step (engine/moe/offload_cache.py);
- stream: a prefill (or a step of many tokens) copies the layer's whole expert stack into one of two
  device buffers; after computing layer L the next layer is prefetched into the other buffer on a
  side stream, ordered by CUDA events.
`emulate_device=True` runs the cache and stream paths with CPU tensors (tests, via the Triton
interpreter); streams and events are then no-ops.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.nn.functional as F

from swaserve.engine.config import CpuMatmul, ModelConfig
from swaserve.engine.moe.base import ExpertWeights, MoEBackend
from swaserve.engine.moe.offload_cache import DeviceExpertCache, Sync
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import expert_slice, linear
from swaserve.engine.quant.q4_repack import repack_weight, repacked_row_bytes

log = logging.getLogger(__name__)

STREAM_MIN_TOKENS = 64  # batches with at least this many tokens stream whole layers
AUTO_CACHE_FRACTION = 0.3  # of free device memory, for cache_size=0 on CUDA


def expert_bytes(experts: list[ExpertWeights]) -> int:
    """Bytes of all routed expert weights (stored form) over the layers' `experts`."""
    return sum(t.data.numel() * t.data.element_size() for ew in experts for t in (ew.gate_up, ew.down))


def experts_fit(experts: list[ExpertWeights], device: torch.device, fraction: float = 0.7) -> bool:
    """Whether every routed expert fits in `fraction` of the device's free memory (for 'auto')."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return expert_bytes(experts) <= fraction * free


HOST_ALIGN = 64  # bytes: each weight's slice of the host buffer starts on this boundary
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: kernels may read the buffer (UVA: same address)


def host_buffer(weights: list[QWeight], pin: bool, repack: bool = False
                ) -> tuple[list[QWeight], torch.Tensor, bool]:
    """All `weights` copied into one exact-size host buffer (each slice HOST_ALIGN-aligned), returned
    as views of it, the buffer, and whether it was registered. With `repack` Q4_0 weights are stored
    in the kernels' aligned layout (engine/quant/q4_repack.py). With `pin` the buffer is page-locked
    and mapped in place with cudaHostRegister: its exact size, where `Tensor.pin_memory()` per weight
    rounds every block up to a power of two (~22.5 GiB pinned for 12 GiB of experts); kernels can
    read it directly (the cache path's zero-copy misses). Registration failure is logged; the copies
    are then pageable (synchronous) and the cache path is off."""
    def packs(w: QWeight) -> bool:
        return repack and w.qtype == "Q4_0" and w.shape[-1] % 32 == 0 and not w.layout

    def stored_shape(w: QWeight) -> tuple[int, ...]:  # of the bytes kept in the buffer
        return (*w.data.shape[:-1], repacked_row_bytes(w.shape[-1])) if packs(w) else tuple(w.data.shape)

    sizes = [math.prod(stored_shape(w)) * w.data.element_size() for w in weights]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // HOST_ALIGN) * HOST_ALIGN
    buf = torch.empty(total, dtype=torch.uint8)
    out = []
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="copying offloaded experts to one host buffer",
              disable=None, leave=False) as bar:  # a bar on a terminal only
        for w, off, n in zip(weights, offsets, sizes):
            src = repack_weight(w) if packs(w) else w  # one weight's repacked copy at a time
            view = buf[off:off + n].view(src.data.dtype).view(src.data.shape)
            view.copy_(src.data)
            out.append(QWeight(src.qtype, src.shape, view, src.name, layout=src.layout))
            bar.update(n)
    registered = False
    if pin and total:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), total, HOST_REGISTER_MAPPED)
        if int(err) != 0:
            log.warning("could not page-lock the %.1f GiB expert buffer (cudaHostRegister error %s); "
                        "copies will be synchronous and decode streams whole layers", total / 2**30, err)
        else:
            registered = True
            weakref.finalize(buf, torch.cuda.cudart().cudaHostUnregister, buf.data_ptr())
    return out, buf, registered


class OffloadMoE(MoEBackend):
    def __init__(self, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device | str = "cpu",
                 cache_size: int = 0, emulate_device: bool = False,
                 stream_min_tokens: int = STREAM_MIN_TOKENS, cpu_matmul: CpuMatmul = "exact"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.on_device = self.cuda or emulate_device  # cache and stream paths available
        self.intermediate_size = cfg.moe_intermediate_size
        self.stream_min_tokens = stream_min_tokens
        self.cpu_matmul = cpu_matmul  # numerics of the host path's Q4_0 linears (EngineConfig.cpu_matmul)
        if cache_size < 0:
            raise ValueError(f"--moe-cache-size must be >= 0, got {cache_size}")
        self.logical_bytes = expert_bytes(experts)
        self.mapped = emulate_device  # kernels can read the host stacks (CUDA: once registered)
        if self.on_device:  # one buffer (CUDA: registered), Q4_0 in the kernels' layout
            flat = [t for ew in experts for t in (ew.gate_up, ew.down)]
            stacked, self._host_buffer, registered = host_buffer(flat, pin=self.cuda, repack=True)
            self.mapped = self.mapped or registered
            self.gate_up, self.down = stacked[0::2], stacked[1::2]  # [E, 2I, H], [E, H, I] per layer
            self.host_bytes = self._host_buffer.numel()
        else:  # CPU: the stored weights in place, no copy
            self.gate_up = [ew.gate_up for ew in experts]
            self.down = [ew.down for ew in experts]
            self.host_bytes = 0
        self.num_layers = len(experts)
        self.stats = {"host": 0, "cache": 0, "stream": 0, "hits": 0, "misses": 0, "layer_copies": 0,
                      "expert_copies": 0}
        if not self.on_device:
            self.cache_size = 0
            return
        from swaserve.engine.moe.triton_backend import fused_moe, stacked_views

        self._fused_moe = fused_moe
        self._stacked_views = stacked_views
        E = cfg.num_experts
        per_expert = (self.gate_up[0].data[0].nbytes + self.down[0].data[0].nbytes) if experts else 0
        if cache_size == 0 and self.cuda and per_expert:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = AUTO_CACHE_FRACTION * free - 2 * E * per_expert  # the stream buffers come first
            cache_size = max(0, min(int(budget // per_expert), E * self.num_layers))
            log.info("offload MoE: caching %d of %d experts on %s (%.1f GiB)", cache_size,
                     E * self.num_layers, self.device, cache_size * per_expert / 2**30)
        self.cache_size = min(cache_size, E * self.num_layers)
        self._sync = Sync(self.device)
        self._cache: DeviceExpertCache | None = None
        if self.mapped and experts:  # zero-copy reads of what is not cached: 1 slot at least
            self._cache = DeviceExpertCache(self.gate_up, self.down, self.cache_size, self._alloc_like,
                                            self._sync, self.stats)
        if experts:
            self._stream_buffers = [(self._alloc_like(self.gate_up[0], E), self._alloc_like(self.down[0], E))
                                    for _ in range(2)]
        self._stream_buffer_layer = [-1, -1]  # layer whose experts each stream buffer holds (or receives)
        self._next_stream_buffer = 0
        self._copy_stream = self._sync.side  # prefetches run here
        self._copy_done: list[torch.cuda.Event | None] = [None, None]
        self._compute_done: list[torch.cuda.Event | None] = [None, None]

    @classmethod
    def create(cls, cfg: ModelConfig, experts: list[ExpertWeights], device: torch.device, *,
               cache_size: int, cpu_matmul: CpuMatmul) -> OffloadMoE:
        return cls(cfg, experts, device, cache_size=cache_size, cpu_matmul=cpu_matmul)

    def _alloc_like(self, w: QWeight, n: int) -> QWeight:
        """A device QWeight of n stacked experts shaped like w's (contents undefined)."""
        data = torch.empty((max(n, 1), *w.data.shape[1:]), dtype=w.data.dtype, device=self.device)
        return QWeight(w.qtype, (max(n, 1), *w.shape[1:]), data, f"{w.name}[device]", layout=w.layout)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        if not self.on_device or T == 0:
            return self._host(layer, x, topk_ids, topk_weights)
        if T < self.stream_min_tokens and self._cache is not None:
            return self._cached(layer, x, topk_ids, topk_weights)
        return self._streamed(layer, x, topk_ids, topk_weights)

    # -- host path ---------------------------------------------------------------------------
    def _host(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        self.stats["host"] += 1
        xh = x.cpu()  # [T, H]
        ids = topk_ids.cpu()
        w = topk_weights.cpu().to(xh.dtype)
        out = torch.zeros_like(xh)  # [T, H]
        gu, dn = self.gate_up[layer], self.down[layer]
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)  # assignments routed to e
            h = linear(xh[tok], expert_slice(gu, e), self.cpu_matmul)  # [n, 2I]
            inter = self.intermediate_size
            h = F.gelu(h[:, :inter], approximate="tanh") * h[:, inter:]  # [n, I]
            y = linear(h, expert_slice(dn, e), self.cpu_matmul)  # [n, H]
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out.to(x.device, non_blocking=True)

    # -- device cache + zero-copy host reads -----------------------------------------------
    def _cached(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """No host read of the ids: experts come from their slot or from mapped host memory."""
        self.stats["cache"] += 1
        cache = self._cache
        cache.before(layer)
        gu, dn = cache.slots
        y = self._fused_moe(x, self._stacked_views(gu, self.device), self._stacked_views(dn, self.device),
                            topk_ids, topk_weights, self.intermediate_size,
                            expert_offsets=cache.offsets(layer))
        cache.after(layer, topk_ids)
        return y

    # -- whole-layer streaming through a double buffer --------------------------------------
    def _streamed(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        self.stats["stream"] += 1
        b = self._acquire(layer)
        gu, dn = self._stream_buffers[b]
        y = self._fused_moe(x, self._stacked_views(gu, self.device), self._stacked_views(dn, self.device),
                            topk_ids, topk_weights, self.intermediate_size)
        self._compute_done[b] = self._record(None)
        nxt = (layer + 1) % self.num_layers
        if nxt != layer:
            self._prefetch(nxt, 1 - b)
        return y

    def _acquire(self, layer: int) -> int:
        """Index of a stream buffer holding `layer`'s experts, usable by the current stream."""
        for b in (0, 1):
            if self._stream_buffer_layer[b] == layer:
                self._wait(self._copy_done[b])  # a prefetch may still be in flight
                self._next_stream_buffer = 1 - b
                return b
        b = self._next_stream_buffer
        self._next_stream_buffer = 1 - b
        self._wait(self._copy_done[b])  # never overwrite a buffer a prefetch still writes
        self._fill(b, layer)  # on the current stream: after earlier readers of b
        self._copy_done[b] = None
        return b

    def _prefetch(self, layer: int, b: int) -> None:
        if self._stream_buffer_layer[b] == layer:
            return
        if self._copy_stream is None:
            self._fill(b, layer)
            return
        # b's last readers (and any fill of b on the current stream before them) are done
        # when compute_done[b] fires; a fill is always followed by a compute on b.
        if self._compute_done[b] is not None:
            self._copy_stream.wait_event(self._compute_done[b])
        with torch.cuda.stream(self._copy_stream):
            self._fill(b, layer)
            self._copy_done[b] = self._record(self._copy_stream)

    def _fill(self, b: int, layer: int) -> None:
        gu, dn = self._stream_buffers[b]
        gu.data.copy_(self.gate_up[layer].data, non_blocking=True)
        dn.data.copy_(self.down[layer].data, non_blocking=True)
        self._stream_buffer_layer[b] = layer
        self.stats["layer_copies"] += 1

    def _record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        return self._sync.record(side=stream is not None)

    def _wait(self, ev: torch.cuda.Event | None) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
