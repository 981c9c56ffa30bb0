"""`swaserve bench speed`: CPU speed of swaserve's engine on a GGUF, beside llama.cpp's on the same file.

Each engine runs in its own process, one after the other (two 14 GB models never share the RAM), with
the same protocol (bench/speed_peer.py `measure`), prompts of the same pseudo-random token ids, greedy
decoding with EOS ignored, and the same thread count:
  load s             engine start: file open, weight repack (swaserve) / load (llama.cpp)
  first TTFT s       the first request after load: prompt -> first token (every lazy cost included)
  warm TTFT s        the same for a later request (best of --reps), and prefill tok/s = prompt / that
  decode tok/s @ B   B streams decoding together (B = 1 and --streams): aggregate tokens/s after every
                     stream has its first token
  RSS MB             resident memory of the engine process at the end
Beside each wall time, the same measure in process CPU seconds (all threads): on a shared machine the
wall times mostly measure the neighbours; with --threads 1 the CPU numbers are the cost of the work.
The peer is llama-cpp-python (optional extra `peer`; run with `--peer`, and `--peer-python` when it lives
in another environment): one llama_context with unified KV decodes all streams in one llama_decode per
step, as llama-server --parallel does. Ratios are swaserve / llama.cpp (tok/s: higher is better;
seconds: lower is better). Wall times on a shared machine are noisy: compare the ratios of one run.

The dimensions of one command, all in one table at the end (rows threads x streams x context):
  --threads 1,2          every engine process runs once per thread count
  --contexts 4096,32768  a 1-stream run per context C: a C-token prompt (prefill tok/s at C), then
                         --context-gen tokens (decode tok/s at C); C is cut to fit the model's context
  --peer-flash-attn on,off  one llama.cpp process (column) per value
  --gap-context C        a short stream decodes, then a C-token prompt arrives: the short stream's
                         inter-token gaps while the long one prefills (its own table)
In that table the ratios are swaserve / the best llama.cpp column of the row (highest tok/s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_PEER_SCRIPT = Path(__file__).with_name("speed_peer.py")
_ROWS = [("load_s", "load s", "{:.1f}"), ("ttft_first_s", "first-request TTFT s", "{:.2f}"),
         ("ttft_warm_s", "warm TTFT s", "{:.2f}"), ("prefill_tps", "prefill tok/s", "{:.1f}"),
         ("decode_tps_1", "decode tok/s, 1 stream", "{:.2f}"),
         ("ttft_first_cpu_s", "first-request TTFT, CPU s", "{:.2f}"),
         ("ttft_warm_cpu_s", "warm TTFT, CPU s", "{:.2f}"),
         ("prefill_tps_cpu", "prefill tok per CPU-s", "{:.1f}"),
         ("decode_tps_1_cpu", "decode tok per CPU-s, 1 stream", "{:.2f}")]


def add_speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", required=True, help="the GGUF both engines run")
    p.add_argument("--peer", action="store_true", help="also run llama.cpp (llama-cpp-python) on the file")
    p.add_argument("--peer-python", default=sys.executable,
                   help="Python that imports llama_cpp (default: this one)")
    p.add_argument("--modes", default="native",
                   help="swaserve --cpu-matmul values to run, comma-separated (default: native)")
    p.add_argument("--threads", default=str(os.cpu_count() or 1),
                   help="compute threads, comma-separated: each engine runs once per count (default: all)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the 1-stream runs")
    p.add_argument("--gen", type=int, default=32, help="generated tokens of the 1-stream runs")
    p.add_argument("--streams", default="8,32", help="concurrent stream counts, comma-separated")
    p.add_argument("--stream-prompt-len", type=int, default=32, help="prompt tokens per concurrent stream")
    p.add_argument("--stream-gen", type=int, default=16, help="generated tokens per concurrent stream")
    p.add_argument("--reps", type=int, default=1, help="warm 1-stream repetitions (best is kept)")
    p.add_argument("--contexts", default="",
                   help="long-prompt token counts, comma-separated (e.g. 4096,16384,32768; default: none): "
                        "a 1-stream run each, prefill and decode tok/s at that context")
    p.add_argument("--context-gen", type=int, default=16, help="generated tokens of each --contexts run")
    p.add_argument("--gap-context", type=int, default=0,
                   help="a short stream decodes while a prompt of this many tokens is prefilled: its "
                        "inter-token gaps (default 0: off)")
    p.add_argument("--peer-flash-attn", default="on",
                   help="llama.cpp flash attention, comma-separated on,off: one llama.cpp column each")
    p.add_argument("--peer-n-batch", type=int, default=512,
                   help="llama.cpp n_batch (n_ubatch = min(it, 512)); llama-server's default is 2048")
    p.add_argument("--kv-gb", type=float, default=4.0,
                   help="swaserve's KV pools in GB (default 4: enough for 8 streams of 26b-a4b, 32 of small; "
                        "the engine's own default, a share of free memory, does not leave room for a peer)")
    p.add_argument("--kv-dtype", default="auto",
                   help="swaserve's KV dtypes, comma-separated (one run each, columns side by side): auto "
                        "(q8_0 on CPU), bf16, fp16, fp32, q8_0")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine before it is stopped")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _common(args: argparse.Namespace, threads: int) -> list[str]:
    return ["--gguf", args.gguf, "--threads", str(threads), "--prompt-len", str(args.prompt_len),
            "--gen", str(args.gen), "--streams", args.streams, "--stream-prompt-len",
            str(args.stream_prompt_len), "--stream-gen", str(args.stream_gen), "--reps", str(args.reps),
            "--kv-gb", str(args.kv_gb), "--contexts", args.contexts,
            "--context-gen", str(args.context_gen), "--gap-context", str(args.gap_context)]


def parse_ints(csv: str, what: str) -> list[int]:
    """'1,2' -> [1, 2] ('' -> []); ValueError naming the flag for anything but positive integers."""
    try:
        out = [int(s) for s in csv.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {csv!r}") from None
    if any(v < 1 for v in out):
        raise ValueError(f"{what}: values must be >= 1, got {csv!r}")
    return out


def clamp_contexts(contexts: list[int], gen: int, context_length: int | None) -> list[int]:
    """Each context cut so that its prompt and `gen` tokens fit `context_length` (None: no limit), a line
    on stderr for each cut; duplicates after cutting dropped."""
    out: list[int] = []
    for c in contexts:
        if context_length is not None and c + gen > context_length:
            print(f"[speed] context {c} clamped to {context_length - gen}: {c} + {gen} generated tokens "
                  f"exceed the model's context length {context_length}", file=sys.stderr)
            c = context_length - gen
        if c not in out:
            out.append(c)
    return out


def model_context_length(gguf: str) -> int | None:
    """The GGUF's gemma4.context_length (None when the file has none)."""
    from swaserve.models.gemma4_layout import ARCH
    from swaserve.models.gguf_loader import read_metadata

    v = read_metadata(gguf).get(f"{ARCH}.context_length")
    return int(v) if v is not None else None


def _run(name: str, cmd: list[str], timeout: float) -> dict | None:
    """Run one engine process (its stderr, with progress bars, passes through); its RESULT line or None."""
    print(f"[speed] {name}: {' '.join(cmd[:3])} ...", file=sys.stderr, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", ""))
    if not env["OMP_NUM_THREADS"]:
        env.pop("OMP_NUM_THREADS")
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"[speed] {name}: stopped after {timeout:.0f} s", file=sys.stderr)
        return None
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"[speed] {name}: exited with {res.returncode} and no result", file=sys.stderr)
    return None


def peer_available(python: str) -> str:
    """'' when `python` imports llama_cpp, else why not."""
    try:
        res = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return "" if res.returncode == 0 else (res.stderr.strip().splitlines() or ["import failed"])[-1]


def _peers(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("llama.cpp")]


def format_table(results: dict[str, dict], streams: list[int]) -> str:
    """Markdown: one row per measure, one column per engine, then swaserve / llama.cpp ratios (one column
    per swaserve x llama.cpp pair)."""
    names = list(results)
    peers = _peers(names)
    rows = list(_ROWS)
    for b in streams:
        rows += [(f"decode_tps_{b}", f"decode tok/s, {b} streams (aggregate)", "{:.2f}"),
                 (f"decode_tps_{b}_cpu", f"decode tok per CPU-s, {b} streams", "{:.2f}")]
    rows += [("rss_mb", "RSS MB at the end", "{:.0f}"), ("kv_pool_mb", "KV pools MB (swaserve)", "{:.0f}")]
    ours = [n for n in names if n not in peers]
    head = ["", *names] + [f"{n} / {p}" for n in ours for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, fmt in rows:
        cells = [label]
        for n in names:
            v = results[n].get(key)
            cells.append(fmt.format(v) if v is not None else "-")
        for n in ours:
            for p in peers:
                v, pv = results[n].get(key), results[p].get(key)
                cells.append(f"{v / pv:.2f}x" if v is not None and pv else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _grid_rows(args: argparse.Namespace) -> list[tuple[int, str, str | None, str]]:
    """(streams, context, prefill key, decode key) of each row of one thread count."""
    rows: list[tuple[int, str, str | None, str]] = [(1, str(args.prompt_len), "prefill_tps", "decode_tps_1")]
    rows += [(b, f"{args.stream_prompt_len} each", None, f"decode_tps_{b}")
             for b in parse_ints(args.streams, "--streams")]
    rows += [(1, str(c), f"prefill_tps_at_{c}", f"decode_tps_at_{c}")
             for c in parse_ints(args.contexts, "--contexts")]
    return rows


def format_grid(by_threads: dict[int, dict[str, dict]], args: argparse.Namespace, cpu: bool = False) -> str:
    """Markdown: one row per (threads, streams, context = prompt tokens), a prefill and a decode tok/s
    column per engine (cpu: per CPU-second), then swaserve / the best llama.cpp column of the row."""
    names: list[str] = []
    for res in by_threads.values():
        names += [n for n in res if n not in names]
    peers = _peers(names)
    ours = [n for n in names if n not in peers]
    head = ["threads", "streams", "context"] + [f"{n} {w}" for n in names for w in ("prefill", "decode")]
    head += [f"{n} / best llama.cpp, {w}" for n in ours for w in ("prefill", "decode")] if peers else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sfx = "_cpu" if cpu else ""
    for t, res in by_threads.items():
        for b, ctx, pre, dec in _grid_rows(args):
            keys = [k + sfx if k else None for k in (pre, dec)]
            cells = [str(t), str(b), ctx]
            for n in names:
                got = [res.get(n, {}).get(k) if k else None for k in keys]
                cells += [f"{v:.1f}" if v is not None else "-" for v in got]
            for n in ours if peers else []:
                for k in keys:
                    v = res.get(n, {}).get(k) if k else None
                    best = max([res[p][k] for p in peers if p in res and k and res[p].get(k)], default=None)
                    cells.append(f"{v / best:.2f}x" if v is not None and best else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_gap(by_threads: dict[int, dict[str, dict]]) -> str:
    """Markdown: per thread count and engine, the short stream's plain decode step, its median and max
    inter-token gap while the long prompt prefills (wall ms), and the long prompt's TTFT."""
    head = ["threads", "engine", "context", "decode step ms before", "median gap ms", "max gap ms",
            "long prompt TTFT s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, res in by_threads.items():
        for n, r in res.items():
            g = r.get("gap")
            if g:
                step = f"{g['a_step_ms']:.1f}" if g["a_step_ms"] is not None else "-"
                lines.append(f"| {t} | {n} | {g['context']} | {step} | {g['gap_median_ms']:.1f} | "
                             f"{g['gap_max_ms']:.1f} | {g['b_ttft_s']:.2f} |")
    return "\n".join(lines)


def run_speed(args: argparse.Namespace) -> int:
    if not Path(args.gguf).is_file():
        print(f"error: {args.gguf}: no such file", file=sys.stderr)
        return 2
    try:
        streams, threads = parse_ints(args.streams, "--streams"), parse_ints(args.threads, "--threads")
        contexts = parse_ints(args.contexts, "--contexts")
        fas = [f for f in args.peer_flash_attn.split(",") if f]
        if any(f not in ("on", "off") for f in fas):
            raise ValueError(f"--peer-flash-attn: on or off, got {args.peer_flash_attn!r}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_ctx = model_context_length(args.gguf)
    args.contexts = ",".join(map(str, clamp_contexts(contexts, args.context_gen, n_ctx)))
    if args.gap_context:
        args.gap_context = clamp_contexts([args.gap_context], 1, n_ctx)[0]
    peer_why = peer_available(args.peer_python) if args.peer else ""
    if peer_why:
        print(f"[speed] llama.cpp skipped: {args.peer_python} cannot import llama_cpp ({peer_why}); install "
              "the extra: pip install 'swaserve[peer]' --no-binary llama-cpp-python", file=sys.stderr)
    kvs = [k for k in args.kv_dtype.split(",") if k]
    by_threads: dict[int, dict[str, dict]] = {}
    for t in threads:
        results: dict[str, dict] = {}
        for fa in fas if args.peer and not peer_why else []:
            cmd = [args.peer_python, str(_PEER_SCRIPT), *_common(args, t), "--flash-attn", fa,
                   "--n-batch", str(args.peer_n_batch)]
            got = _run(f"llama.cpp fa={fa}, {t} threads", cmd, args.timeout)
            if got is not None:
                results[f"llama.cpp fa={fa}"] = got
        for mode in [m for m in args.modes.split(",") if m]:
            for kv in kvs:
                name = f"swaserve {mode}" + (f" {kv}" if len(kvs) > 1 else "")
                cmd = [sys.executable, "-m", "swaserve.bench.speed_worker", "--cpu-matmul", mode,
                       *_common(args, t), "--kv-dtype", kv]
                got = _run(f"{name}, {t} threads", cmd, args.timeout)
                if got is not None:
                    results[name] = got
        if results:
            by_threads[t] = results
    if not by_threads:
        print("error: no engine produced a result", file=sys.stderr)
        return 1
    for t, results in by_threads.items():
        print(f"\n{Path(args.gguf).name}, {t} threads, {args.prompt_len}-token prompt, "
              f"{args.gen} tokens; streams: {args.stream_prompt_len}-token prompts, "
              f"{args.stream_gen} tokens each\n")
        print(format_table(results, streams))
    print(f"\nAll runs, tok/s (wall); context = prompt tokens; decode at B streams is the aggregate; "
          f"{args.context_gen} tokens decoded at each long context\n")
    print(format_grid(by_threads, args))
    print("\nThe same, tok per CPU-second (all threads of the process)\n")
    print(format_grid(by_threads, args, cpu=True))
    if args.gap_context:
        print(f"\nA {args.prompt_len}-token stream decoding while a {args.gap_context}-token prompt arrives "
              f"and is prefilled: its inter-token gaps (wall)\n")
        print(format_gap(by_threads))
    if args.json:
        Path(args.json).write_text(json.dumps({"gguf": args.gguf, "contexts": parse_ints(args.contexts, ""),
                                               "gap_context": args.gap_context,
                                               "results": {str(t): r for t, r in by_threads.items()}},
                                              indent=1))
    return 0
