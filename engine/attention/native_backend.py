"""The CPU attention backend of the native path: the torch backend, with decode rows computed by one
native call straight from the paged pool (engine/quant/native_ops.py: no gathered K/V copy, no padded
SDPA; fp32 / fp16 / bf16 / q8_0 K and V, each side its own type, read as fp32). Prefill chunks are the
torch backend's, except that q8_0 rows are gathered and dequantized by one native call too; under
`--batch-invariant` (`row_prefill`) prefill rows go through the decode call as well, one row each, so a
prompt row's KV has the bits a decode step would have written (docs/cache.md).

Chosen by the engine for `--attention-backend auto` on CPU when `--cpu-matmul native` and the kernels
are built (`native` by name otherwise); the exact path keeps the torch backend as its oracle.
"""

from __future__ import annotations

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.torch_backend import Plan, TorchAttentionBackend, _key_start
from swaserve.engine.quant import native_ops
from swaserve.engine.quant.kv_quant import head_dim


def row_plan(meta: AttentionMetadata, sliding: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every prefill row (q_len > 1) as decode_attn's rows: (rows [R], slots [R, S], counts [R]) int64,
    row r's visible keys in position order (padding: its first key)."""
    table = meta.swa_page_table if sliding else meta.full_page_table  # [B, max_pages]
    cu, page, window = meta.cu_q_lens, meta.page_size, meta.window
    bidir = sliding and meta.key_ends is not None
    rows: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    seqs: list[int] = []
    for b, n in enumerate(meta.q_lens):
        if n > 1:
            p = meta.prefix_lens[b]
            rows += range(cu[b], cu[b] + n)
            starts += [_key_start(pos, window, sliding) for pos in range(p, p + n)]
            ends += meta.key_ends[cu[b]:cu[b] + n] if bidir else range(p + 1, p + n + 1)  # type: ignore[index]
            seqs += [b] * n
    lo, hi = torch.tensor(starts), torch.tensor(ends)  # [R]
    counts = hi - lo
    kpos = lo[:, None] + torch.arange(int(counts.max()))[None, :]  # [R, S]
    kpos = torch.where(kpos < hi[:, None], kpos, lo[:, None])
    pages = table[torch.tensor(seqs)[:, None], kpos // page]  # [R, S]
    return torch.tensor(rows), (pages * page + kpos % page).contiguous(), counts


class NativeAttentionBackend(TorchAttentionBackend):
    """`row_prefill`: prefill rows through decode_attn too (a prompt row then has a decode row's bits);
    else the torch backend's SDPA blocks."""

    row_prefill = False

    def __init__(self) -> None:
        super().__init__()
        if not native_ops.available():
            raise ValueError("--attention-backend native needs the native CPU kernels (see the log line)")

    def _decode(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, plan: Plan,
                out: torch.Tensor) -> None:
        D = q.shape[-1]
        if not (native_ops.fits(q, out) and native_ops.kv_view_ok(K, D) and native_ops.kv_view_ok(V, D)):
            return super()._decode(q, K, V, plan, out)
        rows, slots, counts = plan.decode_rows, plan.decode_slots, plan.decode_counts
        assert rows is not None and slots is not None and counts is not None
        native_ops.decode_attn(q, rows, K, V, slots, counts, out)

    def _prefill(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, meta: AttentionMetadata,
                 sliding: bool, plan: Plan, out: torch.Tensor) -> None:
        D = q.shape[-1]
        if not (self.row_prefill and native_ops.fits(q, out) and native_ops.kv_view_ok(K, D)
                and native_ops.kv_view_ok(V, D)):
            return super()._prefill(q, K, V, meta, sliding, plan, out)
        rp = meta.backend_plans.get(("native-rows", sliding))
        if rp is None:
            rp = meta.backend_plans[("native-rows", sliding)] = row_plan(meta, sliding)
        native_ops.decode_attn(q, rp[0], K, V, rp[1], rp[2], out)

    def _gather(self, tag: str, src: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = head_dim(src)
        if src.dtype != torch.uint8 or dtype != torch.float32 or not native_ops.kv_view_ok(src, d):
            return super()._gather(tag, src, idx, dtype)
        out = self._buf(tag + "_q8", (idx.numel(), src.shape[1], d), torch.float32, src.device)
        return native_ops.kv_gather(src, idx.contiguous(), d, out=out)
