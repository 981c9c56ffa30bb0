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
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads (default: all)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the 1-stream runs")
    p.add_argument("--gen", type=int, default=32, help="generated tokens of the 1-stream runs")
    p.add_argument("--streams", default="8,32", help="concurrent stream counts, comma-separated")
    p.add_argument("--stream-prompt-len", type=int, default=32, help="prompt tokens per concurrent stream")
    p.add_argument("--stream-gen", type=int, default=16, help="generated tokens per concurrent stream")
    p.add_argument("--reps", type=int, default=1, help="warm 1-stream repetitions (best is kept)")
    p.add_argument("--kv-gb", type=float, default=4.0,
                   help="swaserve's KV pools in GB (default 4: enough for 8 streams of 26b-a4b, 32 of small; "
                        "the engine's own default, a share of free memory, does not leave room for a peer)")
    p.add_argument("--kv-dtype", default="auto",
                   help="swaserve's KV dtypes, comma-separated (one run each, columns side by side): auto "
                        "(q8_0 on CPU), bf16, fp16, fp32, q8_0")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine before it is stopped")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _common(args: argparse.Namespace) -> list[str]:
    return ["--gguf", args.gguf, "--threads", str(args.threads), "--prompt-len", str(args.prompt_len),
            "--gen", str(args.gen), "--streams", args.streams, "--stream-prompt-len",
            str(args.stream_prompt_len), "--stream-gen", str(args.stream_gen), "--reps", str(args.reps),
            "--kv-gb", str(args.kv_gb)]


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


def format_table(results: dict[str, dict], streams: list[int]) -> str:
    """Markdown: one row per measure, one column per engine, then swaserve / llama.cpp ratios."""
    names = list(results)
    peer = "llama.cpp" if "llama.cpp" in results else None
    rows = list(_ROWS)
    for b in streams:
        rows += [(f"decode_tps_{b}", f"decode tok/s, {b} streams (aggregate)", "{:.2f}"),
                 (f"decode_tps_{b}_cpu", f"decode tok per CPU-s, {b} streams", "{:.2f}")]
    rows += [("rss_mb", "RSS MB at the end", "{:.0f}"), ("kv_pool_mb", "KV pools MB (swaserve)", "{:.0f}")]
    ours = [n for n in names if n != peer]
    head = ["", *names] + ([f"{n} / llama.cpp" for n in ours] if peer else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, fmt in rows:
        cells = [label]
        for n in names:
            v = results[n].get(key)
            cells.append(fmt.format(v) if v is not None else "-")
        if peer:
            pv = results[peer].get(key)
            for n in ours:
                v = results[n].get(key)
                cells.append(f"{v / pv:.2f}x" if v is not None and pv else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_speed(args: argparse.Namespace) -> int:
    if not Path(args.gguf).is_file():
        print(f"error: {args.gguf}: no such file", file=sys.stderr)
        return 2
    streams = [int(s) for s in args.streams.split(",") if s]
    results: dict[str, dict] = {}
    if args.peer:
        why = peer_available(args.peer_python)
        if why:
            print(f"[speed] llama.cpp skipped: {args.peer_python} cannot import llama_cpp ({why}); install "
                  "the extra: pip install 'swaserve[peer]' --no-binary llama-cpp-python", file=sys.stderr)
        else:
            got = _run("llama.cpp", [args.peer_python, str(_PEER_SCRIPT), *_common(args)], args.timeout)
            if got is not None:
                results["llama.cpp"] = got
    kvs = [k for k in args.kv_dtype.split(",") if k]
    for mode in [m for m in args.modes.split(",") if m]:
        for kv in kvs:
            name = f"swaserve {mode}" + (f" {kv}" if len(kvs) > 1 else "")
            cmd = [sys.executable, "-m", "swaserve.bench.speed_worker", "--cpu-matmul", mode, *_common(args),
                   "--kv-dtype", kv]
            got = _run(name, cmd, args.timeout)
            if got is not None:
                results[name] = got
    if not results:
        print("error: no engine produced a result", file=sys.stderr)
        return 1
    print(f"\n{Path(args.gguf).name}, {args.threads} threads, {args.prompt_len}-token prompt, "
          f"{args.gen} tokens; streams: {args.stream_prompt_len}-token prompts, "
          f"{args.stream_gen} tokens each\n")
    print(format_table(results, streams))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
