"""Chunk invariance of a forced-sequence prefill on CPU: does where a chunk starts change the numbers?

  .venv/bin/python tools/cpu/chunk_invariance.py [--gguf small-2L.gguf] [--len 320] [--matmul native]
      [--kv q8_0] [--bisect]
A sequence of `--len` pseudo-random ids is scored teacher-forced (log_softmax of fp32 logits in float64 at
the next id) under several chunkings of the same prefill, each reading the earlier chunks' K/V back from
the pool as a cached prefix does: `whole` (one chunk), `c64`, `c256`, and `prefix` (the first 5/8 of the
ids in chunks of 256, the rest in chunks of 48: a prefix cached by one request, the tail prefilled by
another with another chunk size). Prints the max |Δlogprob| and top-1 agreement of each against `whole`.
Rows: `none` (as served), `before` (prefill attention in 256-row blocks cut from each chunk's first row,
as before torch_backend.INVARIANT). `--bisect` adds float64 stand-ins (`attn`: SDPA per row over each
row's visible keys; `linear`: every dense matmul, not the MoE experts), which name the op that makes the
difference.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from collections.abc import Iterator
from types import SimpleNamespace

import torch


def chunkings(n: int) -> dict[str, list[int]]:
    """Name -> chunk starts (each chunk runs to the next start, the last to n)."""
    cut = (5 * n // 8) // 16 * 16
    return {"whole": [0], "c64": list(range(0, n, 64)), "c256": list(range(0, n, 256)),
            "prefix": [*range(0, cut, 256), *range(cut, n, 48)]}


def score(llm, ids: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen logprobs [n - 1] float64, argmax [n - 1]) with chunks starting at `starts`."""
    from swaserve.engine.runner.model_runner import build_metadata

    eng = llm.engine
    model, pool, page = eng.runner.model, eng.pool, eng.config.cache.page_size
    n = len(ids)
    npages = -(-n // page)
    k = getattr(pool, "full_per_block", 0)  # an arena: full page f is in block f // k, SWA page s is block s
    swa0 = -(-npages // k) if k else 0
    req = SimpleNamespace(full_pages=list(range(npages)), swa_pages=list(range(swa0, swa0 + npages)),
                          attn_blocks=())
    rows = []
    with torch.no_grad():
        for a, b in zip(starts, [*starts[1:], n]):
            batch = SimpleNamespace(reqs=[req], prefix_lens=[a], q_lens=[b - a])
            meta = build_metadata(batch, page, eng.model_config.sliding_window)
            rows.append(model.logits(model.forward(torch.tensor(ids[a:b]), meta, pool)).double())
    lp = torch.log_softmax(torch.cat(rows), dim=-1)  # [n, V]
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lp[:-1].argmax(-1)


def _sdpa64(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention in float64: per-row results independent of the key split."""
    qd, kd, vd = q.double(), k.double(), v.double()
    if enable_gqa and kd.shape[-3] != qd.shape[-3]:
        rep = qd.shape[-3] // kd.shape[-3]
        kd, vd = kd.repeat_interleave(rep, -3), vd.repeat_interleave(rep, -3)
    s = (qd @ kd.transpose(-1, -2)) * (1.0 if scale is None else scale)  # [..., n, S]
    if is_causal:
        attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2])
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return (s.softmax(-1) @ vd).to(q.dtype)


@contextlib.contextmanager
def stand_in(op: str) -> Iterator[None]:
    """Replace `op` ('attn', 'linear', 'attn+linear', or 'none') by its float64 stand-in; with 'before':
    the prefill attention's 256-row blocks from each chunk's first row (torch_backend.INVARIANT off)."""
    from swaserve.engine.attention import torch_backend
    from swaserve.engine.quant.dequant import dequantize
    from swaserve.models import gemma4

    saved = (torch_backend.F, gemma4.Gemma4Model._linear, torch_backend.INVARIANT, torch_backend.QUERY_BLOCK)
    if "before" in op:
        torch_backend.INVARIANT, torch_backend.QUERY_BLOCK = False, 256
    if "attn" in op:
        torch_backend.F = SimpleNamespace(scaled_dot_product_attention=_sdpa64)
    if "linear" in op:
        def lin64(self, x, w):
            return (x.double() @ dequantize(w).double().T).to(x.dtype)
        gemma4.Gemma4Model._linear = lin64
    try:
        yield
    finally:
        (torch_backend.F, gemma4.Gemma4Model._linear, torch_backend.INVARIANT,
         torch_backend.QUERY_BLOCK) = saved


def main() -> None:
    from swaserve.llm import LLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="a Gemma 4 GGUF (default: the built-in tiny demo model)")
    p.add_argument("--len", type=int, default=320)
    p.add_argument("--matmul", default="native", choices=["native", "exact"])
    p.add_argument("--kv", default="q8_0", help="--kv-cache-dtype")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--bisect", action="store_true", help="also with float64 stand-ins, one op at a time")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    r = random.Random(args.seed)
    ids = [2] + [r.randint(300, 2999) for _ in range(args.len - 1)]
    room = args.len + 4096
    llm = LLM(args.gguf, cpu_matmul=args.matmul, kv_cache_dtype=args.kv, cpu_threads=args.threads,
              cache_type="naive", device="cpu", max_running_requests=1,
              chunked_prefill_size=max(512, args.len),
              max_total_tokens=room, swa_tokens=room)
    ops = ["before", "none"]
    if args.bisect:
        ops = ["before", "before+attn", "before+linear", "before+attn+linear", "none", "linear"]
    print(f"{args.gguf or 'tiny demo model'}, {args.len} ids, --cpu-matmul {args.matmul}, KV {args.kv}: "
          f"max |Δlogprob| vs one whole prefill (top-1 changes)")
    print("| stand-in | " + " | ".join(k for k in chunkings(args.len) if k != "whole") + " |")
    print("|---|" + "---|" * (len(chunkings(args.len)) - 1))
    for op in ops:
        with stand_in(op):
            res = {k: score(llm, ids, s) for k, s in chunkings(args.len).items()}
        ref, top = res.pop("whole")
        cells = [f"{(lp - ref).abs().max().item():.2e} ({int((t != top).sum())})" for lp, t in res.values()]
        print(f"| {op} | " + " | ".join(cells) + " |", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
