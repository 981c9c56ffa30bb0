"""One-stream decode at 1 and 2 threads, on a quiet box and beside busy neighbours, per OpenMP wait policy.

  python tools/cpu/thread_contention.py --gguf small.gguf [--neighbours 0,1] [--policies PASSIVE,ACTIVE]
      [--threads 1,2] [--prompt-len 128] [--gen 32] [--peer-python /path/to/python-with-llama_cpp]

Each cell is one engine process (bench/speed_worker.py's protocol: greedy, EOS ignored, best of --reps)
started with OMP_WAIT_POLICY set, while N neighbour processes spin on the CPU (`while True: pass`), so a
2-thread team has fewer free cores than threads. The question of issue 29: does 2-thread decode fall below
1-thread decode when a core is taken? With --peer-python, llama.cpp (bench/speed_peer.py) runs the same
cells. Prints wall tok/s per cell and the 2-thread / 1-thread ratio per row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BURNER = "while True: pass"


def _cell(engine: str, args: argparse.Namespace, threads: int, policy: str, neighbours: int) -> float | None:
    """Wall decode tok/s of one run (None when the run failed), with `neighbours` spinning beside it."""
    common = ["--gguf", args.gguf, "--threads", str(threads), "--prompt-len", str(args.prompt_len),
              "--gen", str(args.gen), "--stream-prompt-len", "1", "--stream-gen", "1",
              "--reps", str(args.reps)]
    if engine == "swaserve":
        cmd = [sys.executable, "-m", "swaserve.bench.speed_worker", *common, "--kv-gb", "1"]
        if policy == "FOLLOW":  # the default policy, and the thread count follows the free cores
            cmd.append("--follow-load")
    elif policy == "FOLLOW":
        return None
    else:
        peer = Path(__file__).resolve().parents[2] / "bench" / "speed_peer.py"
        cmd = [args.peer_python, str(peer), *common]
    env = dict(os.environ)
    env.pop("GOMP_SPINCOUNT", None)
    if policy in ("DEFAULT", "FOLLOW"):  # libgomp's default: spin a while (GOMP_SPINCOUNT 300000), then sleep
        env.pop("OMP_WAIT_POLICY", None)
    elif policy.startswith("SPIN="):  # libgomp's spin count before a thread sleeps (overrides the policy)
        env["GOMP_SPINCOUNT"] = policy[len("SPIN="):]
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = policy
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(neighbours)]
    try:
        time.sleep(0.5 if neighbours else 0)
        res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for b in burners:
            b.kill()
            b.wait()
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(json.loads(line[len("RESULT "):])["decode_tps_1"])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--neighbours", default="0,1", help="busy neighbour processes, comma-separated")
    p.add_argument("--policies", default="DEFAULT,PASSIVE",
                   help="OMP_WAIT_POLICY values, DEFAULT (unset: libgomp's), SPIN=N (GOMP_SPINCOUNT=N), "
                        "FOLLOW (swaserve: DEFAULT, threads follow the free cores)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--peer-python", default=None, help="a Python that imports llama_cpp (adds llama.cpp)")
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    engines = ["swaserve"] + (["llama.cpp"] if args.peer_python else [])
    print(f"{Path(args.gguf).name}: one stream, {args.prompt_len}-token prompt, {args.gen} tokens, "
          f"{os.cpu_count()} CPUs; decode tok/s (wall)\n")
    head = " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads)
    print(f"| engine | OMP_WAIT_POLICY | busy neighbours | {head} | {threads[-1]} / {threads[0]} |")
    print("|---|---|---|" + "---|" * (len(threads) + 1))
    for engine in engines:
        for policy in args.policies.split(","):
            for n in [int(x) for x in args.neighbours.split(",")]:
                tps = [_cell(engine, args, t, policy, n) for t in threads]
                cells = " | ".join("failed" if v is None else f"{v:.2f}" for v in tps)
                ratio = f"{tps[-1] / tps[0]:.2f}x" if tps[0] and tps[-1] else "-"
                print(f"| {engine} | {policy} | {n} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
