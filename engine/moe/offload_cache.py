"""The offload backend's device expert cache, run without reading router ids back inside a step.

The fused MoE (engine/moe/triton_backend.py, INDIRECT) finds expert e of a layer at a byte offset
from the cache buffer's start, read from a device table [layers, 2, E] (gate_up, down): a cache slot
when the expert is resident, else the expert in the registered (mapped) host buffer, which the kernel
reads over the bus directly (zero copy). So a step's experts need no decision on the host: the
router ids never leave the device during the step.

The cache is filled one step behind, never waiting for the device:
- after a layer's MoE, a bitmap of the experts it used goes to pinned host memory (non-blocking
  copy + event);
- before the layer's MoE of a later step, if that event has completed (`Event.query`, no wait), each
  used expert not cached gets a slot (free, or the least recently used one), and its weights are
  copied host -> slot on a side stream; the evicted expert's table entry is first pointed back to
  host memory on the compute stream, and the side stream waits for an event recorded after that
  (so no kernel still reading the old occupant is overtaken by the copy);
- once a copy's event has completed, the expert's table entry is pointed at its slot (an update on
  the compute stream, after the copy by construction).
All table updates are staged host -> device copies on the compute stream. On a CPU (the emulation the
tests run through the Triton interpreter) events are always complete and copies run inline; a fake
`Sync` lets a test hold events back and check the ordering.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from swaserve.engine.quant.base import QWeight


class Sync:
    """The streams and events the cache uses. CUDA: a side stream for the copies, events recorded on
    the current or the side stream, `done` = `Event.query()`. CPU: no streams; every event is done."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def record(self, side: bool = False) -> object | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.side if side else torch.cuda.current_stream(self.device))
        return ev

    def side_wait(self, ev: object | None) -> None:
        if ev is not None and self.side is not None:
            self.side.wait_event(ev)

    def done(self, ev: object | None) -> bool:
        return ev is None or ev.query()

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        if self.side is None:
            yield
            return
        with torch.cuda.stream(self.side):
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def stage(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (device) <- src (host), queued on the current stream without waiting."""
        dst.copy_(src.pin_memory() if self.cuda else src, non_blocking=True)


def _host_list(bitmap: torch.Tensor) -> list[int]:
    """Indices set in a bitmap in host memory (pinned; its copy has completed): no device wait."""
    return bitmap.nonzero().flatten().tolist()


class DeviceExpertCache:
    """`size` expert slots on the device over per-layer host expert stacks gate_up [E, 2I, H] and
    down [E, H, I] (views of one registered host buffer on CUDA)."""

    def __init__(self, gate_up: list[QWeight], down: list[QWeight], size: int,
                 alloc: Callable[[QWeight, int], QWeight], sync: Sync, stats: dict[str, int]):
        self.gate_up, self.down, self.size, self.sync, self.stats = gate_up, down, size, sync, stats
        self.slots = (alloc(gate_up[0], size), alloc(down[0], size))  # device [size, ...] each
        L, E = len(gate_up), gate_up[0].shape[0]
        self.num_experts = E
        bases = [s.data.data_ptr() for s in self.slots]
        self.slot_bytes = [s.data[0].nbytes for s in self.slots]
        # byte offset of each layer's expert e in host memory, from the cache buffer's first byte
        self.host_off = torch.empty(L, 2, E, dtype=torch.int64)
        for li in range(L):
            for j, w in enumerate((gate_up[li], down[li])):
                first = w.data.data_ptr() - bases[j]
                self.host_off[li, j] = first + torch.arange(E, dtype=torch.int64) * w.data[0].nbytes
        self.mirror = self.host_off.clone()  # the table as last queued to the device
        self.table = self.mirror.clone().to(sync.device)  # [L, 2, E] int64 read by the kernels (never
        # the mirror itself, also on a CPU: updates reach it only through `stage`)
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # published (layer, e) -> slot
        self.pending: dict[tuple[int, int], tuple[int, object | None]] = {}  # copy in flight
        self.free = list(range(size))
        device_used = torch.zeros(L, E, dtype=torch.uint8)
        self.used_host = device_used.pin_memory() if sync.cuda else device_used  # [L, E]
        self.used_event: dict[int, object | None] = {}  # layer -> event of its last bitmap copy

    def offsets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) int64 [E] device offsets of the layer's experts, for fused_moe."""
        return self.table[layer, 0], self.table[layer, 1]

    # -- around a layer's MoE --------------------------------------------------------------
    def before(self, layer: int) -> None:
        """Publish completed copies, then turn the layer's last completed bitmap into copies."""
        dirty = set()
        for key, (slot, ev) in list(self.pending.items()):
            if self.sync.done(ev):
                del self.pending[key]
                li, e = key
                self.mirror[li, :, e] = torch.tensor([slot * n for n in self.slot_bytes])
                self.lru[key] = slot
                dirty.add(li)
        self._publish(dirty)
        if layer in self.used_event and self.sync.done(self.used_event[layer]):
            del self.used_event[layer]
            self._fill(layer, _host_list(self.used_host[layer]))

    def after(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Queue the bitmap of the experts this layer used to host memory (no wait)."""
        used = torch.zeros(self.num_experts, dtype=torch.uint8, device=topk_ids.device)
        used.index_fill_(0, topk_ids.reshape(-1), 1)
        self.sync.copy(self.used_host[layer], used)
        self.used_event[layer] = self.sync.record()

    # -- internals -------------------------------------------------------------------------
    def _publish(self, layers: set[int]) -> None:
        for li in sorted(layers):
            self.sync.stage(self.table[li], self.mirror[li])

    def _fill(self, layer: int, used: list[int]) -> None:
        copies, evicted = [], set()
        for e in used:
            key = (layer, e)
            if key in self.lru:
                self.lru.move_to_end(key)
                self.stats["hits"] += 1
                continue
            self.stats["misses"] += 1  # read from host memory in that step
            if key in self.pending:
                continue
            if self.free:
                slot = self.free.pop()
            elif self.lru:
                (vl, ve), slot = self.lru.popitem(last=False)
                self.mirror[vl, :, ve] = self.host_off[vl, :, ve]  # back to host memory first
                evicted.add(vl)
            else:  # every slot has a copy in flight
                continue
            copies.append((e, slot))
        if not copies:
            return
        self._publish(evicted)
        freed = self.sync.record()  # after the evictions' table updates and every earlier reader
        with self.sync.on_side():
            self.sync.side_wait(freed)
            for e, slot in copies:
                self.sync.copy(self.slots[0].data[slot], self.gate_up[layer].data[e])
                self.sync.copy(self.slots[1].data[slot], self.down[layer].data[e])
                self.stats["expert_copies"] += 1
            done = self.sync.record(side=True)
        for e, slot in copies:
            self.pending[(layer, e)] = (slot, done)
