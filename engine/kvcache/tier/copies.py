"""The copies between the KV pool and the tier's host frames (engine/kvcache/tier/host.py), per device.

CPU: memcpy, no events. CUDA: the frames are pinned host memory; an eviction's device-to-host copy runs on
a side stream that first waits for an event recorded on the compute stream (so it reads the page after the
kernels that wrote it), and the compute stream waits for the copy's event (so no later kernel can reuse the
freed page before the copy read it); the host thread never blocks. A promotion's host-to-device copy runs
on the compute stream, ahead of the kernels that read the page; its event tells the background thread when
the frame may be overwritten. Tests replace this object with a fake that holds copies back until their
events complete (tests/engine/kvcache/tier/test_host.py).
"""

from __future__ import annotations

from typing import Any

import torch

from swaserve.engine.kvcache.tier.file import copy_record


class HostCopies:
    """The copies between the KV pool and host frames. CUDA: pinned frames; device-to-host copies on a side
    stream ordered by events; host-to-device copies on the compute stream. CPU: memcpy, no events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        if not self.cuda:
            t.fill_(0)  # resident now (pinned memory is): no page faults in the step's copies
        return t

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """dst (host frame) <- src (pool page); the event the reader of dst waits for (None: done)."""
        if not self.cuda:
            copy_record(dst, src)
            return None
        cur = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event()
        before.record(cur)
        self.side.wait_event(before)  # after the kernels queued so far: the ones that wrote the page
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.side)
        cur.wait_event(done)  # later kernels, which may reuse the freed page, run after the copy read it
        return done

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """dst (pool page) <- src (host frame) on the compute stream; the event after which src may change."""
        if not self.cuda:
            copy_record(dst, src)
            return None
        dst.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, ev: Any) -> None:
        """Block this (background) thread until ev's copy is done."""
        if ev is not None:
            ev.synchronize()
