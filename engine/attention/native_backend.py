"""The CPU attention backend of the native path: the torch backend, with decode rows computed by one
native call straight from the paged pool (engine/quant/native_ops.py: no gathered K/V copy, no padded
SDPA; fp32 / fp16 / bf16 / q8_0 K and V, each side its own type, read as fp32). Prefill chunks are the
torch backend's, except that q8_0 rows are gathered and dequantized by one native call too.

Chosen by the engine for `--attention-backend auto` on CPU when `--cpu-matmul native` and the kernels
are built (`native` by name otherwise); the exact path keeps the torch backend as its oracle.
"""

from __future__ import annotations

import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend, _Plan
from swaserve.engine.quant import native_ops
from swaserve.engine.quant.kv_quant import head_dim


class NativeAttentionBackend(TorchAttentionBackend):
    def __init__(self) -> None:
        super().__init__()
        if not native_ops.available():
            raise ValueError("--attention-backend native needs the native CPU kernels (see the log line)")

    def _decode(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, plan: _Plan,
                out: torch.Tensor) -> None:
        D = q.shape[-1]
        if not (native_ops.fits(q, out) and native_ops.kv_view_ok(K, D) and native_ops.kv_view_ok(V, D)):
            return super()._decode(q, K, V, plan, out)
        rows, slots, counts = plan.decode_rows, plan.decode_slots, plan.decode_counts
        assert rows is not None and slots is not None and counts is not None
        native_ops.decode_attn(q, rows, K, V, slots, counts, out)

    def _gather(self, tag: str, src: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = head_dim(src)
        if src.dtype != torch.uint8 or dtype != torch.float32 or not native_ops.kv_view_ok(src, d):
            return super()._gather(tag, src, idx, dtype)
        out = self._buf(tag + "_q8", (idx.numel(), src.shape[1], d), torch.float32, src.device)
        return native_ops.kv_gather(src, idx.contiguous(), d, out=out)
