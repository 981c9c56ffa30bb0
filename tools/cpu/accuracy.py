"""Forced-sequence accuracy of the CPU matmul paths: chosen-token |Δlogprob| against the exact fp32 path.

  .venv/bin/python tools/cpu/accuracy.py --gguf small-2L.gguf [--modes native,fast]
      [--peer-python /path/to/python-with-llama_cpp]
A sequence of `--len` pseudo-random ids (seed `--seed`) is scored teacher-forced in one prefill by each
swaserve `--cpu-matmul` path (and, with --peer-python, by llama.cpp: once in one ubatch, once token by
token); logprob = log_softmax(fp32 logits in float64)[next id]. Prints median / p90 / max |Δ| against
`exact` and the top-1 agreement. Use a shallow cut of a random preset (tools/models/trunc_gguf.py): the full
random presets are chaotic (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
from types import SimpleNamespace

import torch

_PEER = r"""
import json, sys
import numpy as np
import llama_cpp
path, ids_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids = json.load(open(ids_file))
res = {}
for nb, name in ((512, "llama.cpp (one ubatch)"), (1, "llama.cpp (token by token)")):
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(1024, len(ids) + 16), n_threads=threads, n_batch=nb,
                          n_ubatch=nb, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    res[name] = ([float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)],
                 [int(x) for x in logits[:-1].argmax(-1)])
    del llm
print("RESULT " + json.dumps(res))
"""


def score(path: str, mode: str, ids: list[int], threads: int) -> tuple[list[float], list[int]]:
    from swaserve.engine.runner.model_runner import build_metadata
    from swaserve.llm import LLM

    llm = LLM(path, cpu_matmul=mode, cpu_threads=threads, cache_type="naive", device="cpu",
              max_running_requests=1, chunked_prefill_size=max(512, len(ids)),
              kv_cache_dtype="fp16")  # one KV type for every mode: the matmul is what differs
    eng = llm.engine
    model, pool, page = eng.runner.model, eng.pool, eng.config.cache.page_size
    pages = list(range(-(-len(ids) // page)))
    req = SimpleNamespace(full_pages=pages, swa_pages=pages, attn_blocks=())
    batch = SimpleNamespace(reqs=[req], prefix_lens=[0], q_lens=[len(ids)])
    meta = build_metadata(batch, page, eng.model_config.sliding_window)
    with torch.no_grad():
        logits = model.logits(model.forward(torch.tensor(ids), meta, pool)).double()  # [T, V]
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return chosen.tolist(), logits[:-1].argmax(-1).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--modes", default="native,fast", help="paths compared with exact, comma-separated")
    p.add_argument("--peer-python", default=None, help="a Python that imports llama_cpp (adds llama.cpp)")
    p.add_argument("--len", type=int, default=160, help="sequence length (scored positions = len - 1)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    r = random.Random(args.seed)
    ids = [2] + [r.randint(300, 2999) for _ in range(args.len - 1)]
    res = {m: score(args.gguf, m, ids, args.threads) for m in ["exact", *args.modes.split(",")] if m}
    if args.peer_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(ids, f)
            f.flush()
            out = subprocess.run([args.peer_python, "-c", _PEER, args.gguf, f.name, str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
        res.update(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:]))
    ref, ref_top = res["exact"]
    n = len(ref)
    print(f"{args.gguf}: {args.len} pseudo-random ids (seed {args.seed}), {n} scored positions; reference = "
          f"swaserve exact (fp32); mean chosen logprob {sum(ref) / n:.2f}\n")
    print("| path | median abs Δlogprob | p90 | max | top-1 agrees with exact |")
    print("|---|---|---|---|---|")
    for name, (lp, top) in res.items():
        if name == "exact":
            continue
        d = sorted(abs(a - b) for a, b in zip(lp, ref))
        agree = sum(a == b for a, b in zip(top, ref_top)) / n
        label = name if name.startswith("llama") else f"swaserve {name}"
        p90 = d[int(0.9 * (n - 1))]
        print(f"| {label} | {statistics.median(d):.2e} | {p90:.2e} | {d[-1]:.2e} | {agree:.1%} |")


if __name__ == "__main__":
    main()
