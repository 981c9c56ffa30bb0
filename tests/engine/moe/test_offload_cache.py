"""The offload cache's ordering (engine/moe/offload_cache.py) with a fake stream/event object: events
complete only when the test releases them, and every copy and table update is checked against what
the device would have seen:
- a copy into a slot is queued on the side stream after an event recorded when no table entry
  pointed at that slot any more (no kernel can still be reading its old occupant);
- a table entry is pointed at a slot only after the copy that filled it has completed;
- the outputs equal TorchMoE's throughout (held-back copies leave those experts read from host memory).
"""

from __future__ import annotations

import contextlib
import os
import random

import torch

from swaserve.engine.moe.offload_backend import OffloadMoE
from swaserve.engine.moe.torch_backend import TorchMoE
from tests.engine.moe.moe_cases import (
    OFFLOAD_DEV,
    OFFLOAD_EMULATE,
    make_cfg,
    make_layers,
    new_seed,
    on_offload_dev,
    rel_err,
    routing,
)

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py must set TRITON_INTERPRET=1"

E, HID, INTER, K, LAYERS = 8, 64, 32, 2, 2


class Ev:
    def __init__(self, referenced: set[int], side: bool):
        self.done, self.referenced, self.side = False, referenced, side


class FakeSync:
    """Sync's interface; copies land at once (so the data is right), ordering is checked instead."""

    device = torch.device(OFFLOAD_DEV)
    cuda = False
    side = None

    def __init__(self) -> None:
        self.cache = None
        self.events: list[Ev] = []
        self.in_side = False
        self.side_waited: Ev | None = None
        self.slot_filled_by: dict[int, tuple[int, int, Ev | None]] = {}  # slot -> (layer, expert, copy event)
        self.copies_in_side: list[tuple[int, int]] = []  # (slot, expert) of the open side block
        self.checked = {"copies": 0, "publishes": 0}

    def _slot_of(self, dst: torch.Tensor) -> tuple[int, int] | None:
        for j, s in enumerate(self.cache.slots):
            off = dst.data_ptr() - s.data.data_ptr()
            if 0 <= off < s.data.nbytes and dst.nbytes == self.cache.slot_bytes[j]:
                return j, off // self.cache.slot_bytes[j]
        return None

    def _referenced(self) -> set[int]:
        """Slots the device table points at now."""
        t, host = self.cache.table, self.cache.host_off
        refs = set()
        for li, j, e in (t != host).nonzero().tolist():
            refs.add(int(t[li, j, e]) // self.cache.slot_bytes[j])
        return refs

    def record(self, side: bool = False) -> Ev:
        ev = Ev(self._referenced(), side)
        if side:
            for slot, key in self.copies_in_side:
                self.slot_filled_by[slot] = (*key, ev)
        self.events.append(ev)
        return ev

    def side_wait(self, ev: Ev) -> None:
        assert self.in_side
        self.side_waited = ev

    def done(self, ev: Ev | None) -> bool:
        return ev is None or ev.done

    @contextlib.contextmanager
    def on_side(self):
        self.in_side, self.side_waited, self.copies_in_side = True, None, []
        yield
        self.in_side = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        hit = self._slot_of(dst)
        if hit is not None:  # a host -> slot copy: must be on the side stream, after a safe event
            j, slot = hit
            assert self.in_side and self.side_waited is not None, "slot copy not ordered by an event"
            assert slot not in self.side_waited.referenced, f"slot {slot} overwritten while in the table"
            src_layer = next(li for li in range(LAYERS)
                             for w in ((self.cache.gate_up, self.cache.down)[j][li],)
                             if 0 <= src.data_ptr() - w.data.data_ptr() < w.data.nbytes)
            e = (src.data_ptr() - (self.cache.gate_up, self.cache.down)[j][src_layer].data.data_ptr()) \
                // src.nbytes
            self.copies_in_side.append((slot, (src_layer, e)))
            self.checked["copies"] += 1
        dst.copy_(src)

    def stage(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        li = next(i for i in range(LAYERS) if dst.data_ptr() == self.cache.table[i].data_ptr())
        host = self.cache.host_off[li]
        for j, e in (src != host).nonzero().tolist():
            slot = int(src[j, e]) // self.cache.slot_bytes[j]
            layer, expert, ev = self.slot_filled_by[slot]
            assert (layer, expert) == (li, e), f"({li}, {e}) pointed at slot {slot} holding {layer, expert}"
            assert ev is not None and ev.done, f"({li}, {e}) published before its copy completed"
            self.checked["publishes"] += 1
        dst.copy_(src)

    def release(self, rng: random.Random, frac: float) -> None:
        for ev in self.events:
            if not ev.done and rng.random() < frac:
                ev.done = True


def test_cache_ordering_with_held_back_events() -> None:
    seed = new_seed()
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    layers = make_layers(g, "Q4_0", LAYERS, E, HID, INTER)
    cfg = make_cfg(E, K, HID, INTER, num_layers=LAYERS)
    ref = TorchMoE(cfg, layers, "cpu")
    moe = OffloadMoE(cfg, layers, OFFLOAD_DEV, cache_size=3, emulate_device=OFFLOAD_EMULATE,
                     stream_min_tokens=8)
    fake = FakeSync()
    fake.cache = moe._cache
    moe._cache.sync = fake
    for step in range(10):
        t = rng.choice([1, 2, 3])
        x = torch.randn(t, HID, generator=g)
        ids, w = routing(g, t, E, K)
        for li in range(LAYERS):
            y = moe.forward(li, *on_offload_dev(x, ids, w))
            assert rel_err(y, ref.forward(li, x, ids, w).double()) <= 1e-4, f"step {step} seed {seed}"
        fake.release(rng, 0.5)  # about half of the device's work "completes" between steps
    # then one routing repeated with every event completing between steps: its experts (K <= cache_size)
    # are copied after the first step and published after the second, so the third must hit
    x = torch.randn(1, HID, generator=g)
    ids, w = routing(g, 1, E, K)
    for _ in range(3):
        fake.release(rng, 1.0)
        for li in range(LAYERS):
            y = moe.forward(li, *on_offload_dev(x, ids, w))
            assert rel_err(y, ref.forward(li, x, ids, w).double()) <= 1e-4, f"seed {seed}"
    assert fake.checked["copies"] > 3 and fake.checked["publishes"] > 0, (fake.checked, seed)
    assert moe.stats["hits"] > 0 and moe.stats["misses"] > moe.cache_size, (moe.stats, seed)
