"""Forced-sequence accuracy of the KV cache types: chosen-token |Δlogprob| against fp32 KV (CPU).

  .venv/bin/python tools/cpu/kv_accuracy.py --gguf small-2L.gguf [--len 512] [--dtypes fp16,bf16,q8_0]
      [--matmul exact] [--chunk 0] [--llama-python PY_WITH_LLAMA_CPP [--llama-types f32,f16,q8_0]]
A sequence of `--len` pseudo-random ids (seed `--seed`) is scored teacher-forced by swaserve's model once
per `--kv-cache-dtype`, every run with the same `--cpu-matmul` (default exact: the only difference between
the runs is the KV storage); logprob = log_softmax(fp32 logits in float64)[next id]. The reference is the
fp32-KV run. `--chunk N` scores in prefill chunks of N tokens (each chunk reads the earlier ones' KV back
from the pool, as a cached prefix does); 0 = one prefill (its keys are stored, then read, all the same).
With `--llama-python`, llama.cpp scores the same ids on the same file once per `-ctk/-ctv` type (K and V
alike; flash attention on, as `-fa auto` on CPU, which a quantized V needs; ubatches of `--chunk` or 512).
Prints, per run, its bytes per token and median / p90 / max |Δ| and the top-1 agreement against swaserve's
fp32 KV, and against the same engine's own fp32 KV (llama.cpp's f32 run: what its KV type alone costs,
without its 8-bit activations). The same method as tools/cpu/accuracy.py (docs/benchmarks.md); use a
shallow cut of a random preset (tools/models/trunc_gguf.py), the full random presets are chaotic.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from types import SimpleNamespace

import torch

# llama.cpp's -ctk/-ctv name -> (ggml type id, swaserve's name of the same storage)
LLAMA_TYPES = {"f32": (0, "fp32"), "f16": (1, "fp16"), "q8_0": (8, "q8_0")}
_LLAMA = r"""
import json, sys
import numpy as np
import llama_cpp
path, ids_file, threads, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids, res = json.load(open(ids_file)), {}
for kind, ggml in json.loads(sys.argv[5]).items():
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + 64, n_threads=threads, n_batch=batch,
                          n_ubatch=batch, logits_all=True, flash_attn=True, type_k=ggml, type_v=ggml,
                          verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    res[kind] = ([float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)],
                 [int(x) for x in logits[:-1].argmax(-1)])
    del llm
print("RESULT " + json.dumps(res))
"""


def score(path: str | None, kv: str, ids: list[int], matmul: str, threads: int, chunk: int
          ) -> tuple[list[float], list[int], object]:
    """(chosen-token logprobs [len - 1], argmax ids [len - 1], the model config) with KV `kv`."""
    from swaserve.engine.runner.model_runner import build_metadata
    from swaserve.llm import LLM

    n = len(ids)
    step = chunk or n
    room = n + max(512, step) + 2048  # every position's KV of both kinds (no SWA eviction; >= a window)
    llm = LLM(path, cpu_matmul=matmul, kv_cache_dtype=kv, cpu_threads=threads, cache_type="naive",
              device="cpu", max_running_requests=1, chunked_prefill_size=max(512, step),
              max_total_tokens=room, swa_tokens=room)
    eng = llm.engine
    model, pool, page = eng.runner.model, eng.pool, eng.config.cache.page_size
    npages = -(-n // page)
    k = getattr(pool, "full_per_block", 0)  # an arena: full page f is in block f // k, SWA page s is block s
    swa0 = -(-npages // k) if k else 0  # SWA pages in blocks no full page uses
    req = SimpleNamespace(full_pages=list(range(npages)), swa_pages=list(range(swa0, swa0 + npages)),
                          attn_blocks=())
    rows = []
    with torch.no_grad():
        for start in range(0, n, step):
            q = min(step, n - start)
            batch = SimpleNamespace(reqs=[req], prefix_lens=[start], q_lens=[q])
            meta = build_metadata(batch, page, eng.model_config.sliding_window)
            hidden = model.forward(torch.tensor(ids[start:start + q]), meta, pool)  # [q, H]
            rows.append(model.logits(hidden).double())  # [q, V]
    logits = torch.cat(rows)  # [n, V]
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    cfg = eng.model_config
    llm.close()
    return chosen.tolist(), logits[:-1].argmax(-1).tolist(), cfg


def score_llama(python: str, path: str, ids: list[int], threads: int, batch: int, kinds: list[str]
                ) -> dict[str, tuple[list[float], list[int]]]:
    """llama.cpp's (chosen logprobs, argmax ids) per -ctk/-ctv type, in one process of `python`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(ids, f)
        f.flush()
        types = json.dumps({k: LLAMA_TYPES[k][0] for k in kinds})
        out = subprocess.run([python, "-c", _LLAMA, path, f.name, str(threads), str(batch), types],
                             capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama.cpp failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])


def _cells(lp: list[float], top: list[int], ref: list[float], ref_top: list[int]) -> str:
    """median | p90 | max | top-1 of |lp - ref|."""
    n = len(ref)
    d = sorted(abs(a - b) for a, b in zip(lp, ref))
    agree = sum(a == b for a, b in zip(top, ref_top)) / n
    return f"{statistics.median(d):.2e} | {d[int(0.9 * (n - 1))]:.2e} | {d[-1]:.2e} | {agree:.1%}"


def main() -> None:
    from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat
    from swaserve.engine.attention.kv_pool import bytes_per_token

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="a Gemma 4 GGUF (default: the built-in tiny demo model)")
    p.add_argument("--dtypes", default="fp16,bf16,q8_0", help="KV types compared with fp32, comma-separated")
    p.add_argument("--matmul", default="exact", choices=["exact", "native", "fast"],
                   help="--cpu-matmul of every run")
    p.add_argument("--len", type=int, default=512, help="sequence length (scored positions = len - 1)")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the whole sequence at once)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llama-python", default=None, help="a Python that imports llama_cpp (adds llama.cpp)")
    p.add_argument("--llama-types", default="f32,f16,q8_0",
                   help=f"llama.cpp -ctk/-ctv types, comma-separated (f32 first: its own reference; "
                        f"choose from {', '.join(LLAMA_TYPES)})")
    args = p.parse_args()
    if args.llama_python and not args.gguf:
        p.error("--llama-python needs --gguf (llama.cpp reads the same file)")
    kinds = [k for k in args.llama_types.split(",") if k]
    if args.llama_python and (any(k not in LLAMA_TYPES for k in kinds) or kinds[:1] != ["f32"]):
        p.error(f"--llama-types: f32 first, then any of {', '.join(LLAMA_TYPES)}")
    torch.set_num_threads(args.threads)
    r = random.Random(args.seed)
    ids = [2] + [r.randint(300, 2999) for _ in range(args.len - 1)]
    ours = {}
    for kv in ["fp32", *[d for d in args.dtypes.split(",") if d and d != "fp32"]]:
        t0 = time.monotonic()
        ours[kv] = score(args.gguf, kv, ids, args.matmul, args.threads, args.chunk)
        print(f"scored with KV {kv} in {time.monotonic() - t0:.1f}s", flush=True)
    ref, ref_top, cfg = ours["fp32"]
    theirs = {}
    if args.llama_python:
        t0 = time.monotonic()
        theirs = score_llama(args.llama_python, args.gguf, ids, args.threads, args.chunk or 512, kinds)
        print(f"scored by llama.cpp ({', '.join(kinds)}) in {time.monotonic() - t0:.1f}s", flush=True)
    n = len(ref)
    how = f"chunks of {args.chunk}" if args.chunk else "one prefill"
    print(f"\n{args.gguf or 'tiny demo model'}: {args.len} pseudo-random ids (seed {args.seed}), {n} scored "
          f"positions, swaserve: {how}, --cpu-matmul {args.matmul}; reference = swaserve fp32 KV; mean "
          f"chosen logprob {sum(ref) / n:.2f}\n")
    print("| engine, KV type | bytes / token (full, SWA) | median abs Δlogprob vs swaserve fp32 KV | p90 | "
          "max | top-1 agrees | median abs Δ vs the engine's own fp32 KV | p90 | max | top-1 agrees |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(f"swaserve {kv}", kv, lp, top, ref, ref_top) for kv, (lp, top, _) in ours.items()
            if kv != "fp32"]
    rows += [(f"llama.cpp -ctk/-ctv {k}", LLAMA_TYPES[k][1], *theirs[k], *theirs["f32"]) for k in theirs]
    for label, kv, lp, top, own, own_top in rows:
        full_b, swa_b = bytes_per_token(cfg, KVFormat(KV_TYPES[kv], KV_TYPES[kv]))
        print(f"| {label} | {full_b}, {swa_b} | {_cells(lp, top, ref, ref_top)} | "
              f"{_cells(lp, top, own, own_top)} |")


if __name__ == "__main__":
    main()
