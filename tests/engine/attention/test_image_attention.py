"""Bidirectional image attention on the sliding layers (AttentionMetadata.key_ends): the torch backend (the
oracle), the native backend and the Triton kernel (interpreter on the CPU) against a dense float64 brute
force of transformers' Gemma 4 mask, AND(sliding window, OR(causal, same image)); full layers stay causal.
Spans inside one chunk, a span whose start is in the cached prefix (a prefix hit inside an image), two
spans in one chunk, a span longer than the window, beside decodes and text-only prefills."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.core import Batch, Req, SamplingParams
from swaserve.engine.quant import native
from swaserve.engine.runner.model_runner import key_ends
from tests.engine.attention.test_triton_attention import FULL, SWA, Case, check, make_case, make_cfg

# (prefix, q_len, image spans [start, end) in absolute positions) per sequence; window 6
SEQS = [
    (0, 24, [(5, 14), (15, 19)]),  # two images in one chunk, the first longer than the window
    (10, 12, [(6, 15)]),  # the image began in the cached prefix: its rest is in this chunk
    (30, 1, []),  # a decode
    (3, 9, [(3, 12)]),  # the chunk is the image
    (0, 7, []),  # text only
]
WINDOW = 6


def batch_of(seqs: list[tuple[int, int, list[tuple[int, int]]]]) -> Batch:
    reqs = [Req(f"r{i}", f"r{i}", 0, [0] * (p + q), p + q, SamplingParams(), attn_blocks=tuple(spans))
            for i, (p, q, spans) in enumerate(seqs)]
    return Batch(reqs, [q for _, q, _ in seqs], [p for p, _, _ in seqs], [True] * len(seqs))


def image_case(seed: int, dtype: torch.dtype = torch.float32, page: int = 4) -> Case:
    cfg = make_cfg(4, 2, 1, 16, 32, window=WINDOW)
    case = make_case(seed, cfg, [q for _, q, _ in SEQS], [p for p, _, _ in SEQS], page, dtype)
    ends = key_ends(batch_of(SEQS))
    assert ends is not None
    case.meta = dataclasses.replace(case.meta, key_ends=ends)
    return case


def brute(case: Case, layer: int, bidirectional: bool) -> torch.Tensor:
    """Dense float64 attention with transformers' mask: sliding AND(kv > q - W, OR(kv <= q, same image))."""
    meta, outs = case.meta, []
    q_all = case.q[layer].double().cpu()
    for b, (p, n, spans) in enumerate(SEQS):
        q = q_all[meta.cu_q_lens[b]: meta.cu_q_lens[b] + n]  # [n, H, D]
        k, v = case.k_all[layer][b].double(), case.v_all[layer][b].double()  # [L, KVH, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", q, k)
        qpos, kpos = torch.arange(p, p + n)[:, None], torch.arange(p + n)[None, :]
        mask = kpos <= qpos
        if layer == SWA:
            if bidirectional:
                for lo, hi in spans:
                    mask |= (qpos >= lo) & (qpos < hi) & (kpos >= lo) & (kpos < hi)
            mask &= kpos > qpos - meta.window
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def run(case: Case, backend) -> None:
    for layer in (SWA, FULL):
        out = backend.forward(layer, case.q[layer], case.k_new[layer], case.v_new[layer], case.meta,
                              case.pool)
        ref = brute(case, layer, bidirectional=True)
        check(out, ref, torch.float32, 0, f"{type(backend).__name__} layer {layer}")
        if layer == SWA:  # the mask matters: the causal answer is far from it
            causal = brute(case, layer, bidirectional=False)
            assert (out.double().cpu() - causal).abs().max() > 1e-2


def unpoison(case: Case) -> Case:
    for t in case.pool.tensors():  # the torch backend may read whole pages: no NaN poison there
        t.nan_to_num_(0.0)
    return case


def test_key_ends() -> None:
    ends = key_ends(batch_of(SEQS))
    assert ends[:6] == [1, 2, 3, 4, 5, 14]  # text, then the first image's tokens see its end
    assert ends[5:14] == [14] * 9 and ends[14] == 15 and ends[15:19] == [19] * 4
    assert ends[24:36] == [15] * 5 + list(range(16, 23))  # the rest of an image begun in the prefix
    assert key_ends(batch_of([(0, 8, [])])) is None  # text only: causal
    assert key_ends(batch_of([(0, 8, [(7, 8)])])) is None  # only an image's last token: causal too
    with pytest.raises(AssertionError, match="splits the image"):
        key_ends(batch_of([(0, 8, [(5, 10)])]))


@pytest.mark.parametrize("query_block", [256, 4])
def test_torch_backend_bidirectional(query_block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import swaserve.engine.attention.torch_backend as tb

    monkeypatch.setattr(tb, "QUERY_BLOCK", query_block)  # 4: an image's rows over several query blocks
    run(unpoison(image_case(1)), TorchAttentionBackend())


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("row_prefill", [False, True], ids=["blocks", "row-prefill"])  # --batch-invariant
def test_native_backend_bidirectional(row_prefill: bool) -> None:
    from swaserve.engine.attention.native_backend import NativeAttentionBackend

    be = NativeAttentionBackend()
    be.row_prefill = row_prefill
    run(unpoison(image_case(2, page=1)), be)


@pytest.mark.parametrize("page", [1, 4])
def test_triton_bidirectional(page: int) -> None:
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend

    run(image_case(3, page=page), TritonAttentionBackend(block_m=16, block_n=16))  # NaN-poisoned pool


def test_triton_matches_torch_and_causal_unchanged() -> None:
    """Triton == torch with key_ends; without them both give the causal brute force (the setting off)."""
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend

    tri, ref = image_case(4), unpoison(image_case(4))
    be_t, be_r = TritonAttentionBackend(block_m=16, block_n=16), TorchAttentionBackend()
    for layer in (SWA, FULL):
        out_t = be_t.forward(layer, tri.q[layer], tri.k_new[layer], tri.v_new[layer], tri.meta, tri.pool)
        out_r = be_r.forward(layer, ref.q[layer], ref.k_new[layer], ref.v_new[layer], ref.meta, ref.pool)
        check(out_t, out_r.double().cpu(), torch.float32, 4, f"triton vs torch layer {layer}")
    for case, be in ((image_case(5), be_t), (unpoison(image_case(5)), be_r)):
        case.meta = dataclasses.replace(case.meta, key_ends=None)
        out = be.forward(SWA, case.q[SWA], case.k_new[SWA], case.v_new[SWA], case.meta, case.pool)
        check(out, brute(case, SWA, bidirectional=False), torch.float32, 5, f"{type(be).__name__} causal")
