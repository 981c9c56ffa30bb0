"""How long a big grammar stalls another user's stream (issue 24 item 3), against `swaserve serve`.

    python -m tools.serving.grammar_stall [--props 10000] [--case all] [-- extra serve flags]

Starts `swaserve serve` on the demo model (engine process, chat worker processes: the defaults), runs one
long greedy completion stream, and while it streams sends one chat request whose grammar is big:
  * `schema`: response_format json_schema with --props string properties, all required (~100 bytes each:
    10,000 make a 1 MB schema);
  * `optional`: the same properties, none required;
  * `tool`: one tool with 1,200 optional integer properties under tool_choice required;
  * `within`: 3,500 required string properties (~0.5 MB), inside the server's limits;
  * `tool1000`: a tool with 1,000 optional integer properties (the most one object may have).
(The first three are over the limits of server/chat/schema_limits.py since issue 24: a 400 at once.)
Each case prints the big request's status and time, and the stream's largest inter-token gap in the
window against the same stream idle (the slower of a window before and one after) and its mean step.
A tool case's prompt (20k tokens for 1,000 properties) is prefilled once before its window, with
tool_choice auto: a cold 20k-token prefill alone makes 3-5 s gaps on the demo model, grammar or not.
The acceptance line of issue 24: max gap <= 2 x idle max gap + one step.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from swaserve.server.fleet.launch import free_port
from swaserve.server.fleet.procs import Child

POOL_ARGS = ["--max-total-tokens", "65536", "--device", "cpu", "--cpu-threads", "1"]


def props_schema(n: int, required: bool) -> dict[str, Any]:
    """n string properties with ~60-character descriptions (~100 bytes each)."""
    props = {f"field_{i:05d}": {"type": "string", "maxLength": 8,
                                "description": f"property number {i} of the big schema, a plain text"}
             for i in range(n)}
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(props)
    return out


def case_body(case: str, n: int) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "fill the form"}]
    if case in ("tool", "tool1000"):
        count = 1200 if case == "tool" else 1000
        props = {f"f{i}": {"type": "integer"} for i in range(count)}  # short: the prompt fits the context
        tool = {"type": "function", "function": {"name": "fill", "parameters": {"type": "object",
                                                                                "properties": props}}}
        return {"messages": msgs, "tools": [tool], "tool_choice": "required", "max_tokens": 8}
    size = 3500 if case == "within" else n
    schema = props_schema(size, case != "optional")
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    return {"messages": msgs, "response_format": fmt, "max_tokens": 8}


def _stream(url: str, stop: threading.Event, out: list[tuple[float, float]],
            started: threading.Event) -> None:
    body = {"prompt": "a", "max_tokens": 20000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=300) as h, h.stream("POST", "/v1/completions", json=body) as r:
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                out.append((now, now - last))
            else:
                started.set()
            last = now
            if stop.is_set():
                break


def window(url: str, raw: bytes | None, idle_s: float = 3.0) -> tuple[list[float], Any]:
    """(the stream's gaps inside the window, (status, seconds, body head) of the big request or None)."""
    gaps: list[tuple[float, float]] = []
    stop, started = threading.Event(), threading.Event()
    t = threading.Thread(target=_stream, args=(url, stop, gaps, started))
    t.start()
    assert started.wait(120)
    time.sleep(0.5)
    t0 = time.perf_counter()
    result = None
    if raw is None:
        time.sleep(idle_s)
    else:
        with httpx.Client(base_url=url, timeout=600) as h:
            r = h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        result = (r.status_code, time.perf_counter() - t0, r.text[:300])
        time.sleep(0.5)  # the grammar's first masks come after the answer's head
    t1 = time.perf_counter()
    stop.set()
    t.join(120)
    return [d for at, d in gaps if t0 <= at <= t1], result


def start_server(extra: list[str]) -> tuple[Child, str]:
    port = free_port()
    child = Child("serve", [sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port), *POOL_ARGS,
                            "--log-level", "warning", *extra], sink=io.StringIO())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if not child.alive():
            raise RuntimeError("\n".join(child.tail))
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return child, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become ready")
        time.sleep(0.3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--props", type=int, default=10000)
    ap.add_argument("--case", default="all",
                    choices=["schema", "optional", "tool", "within", "tool1000", "all"])
    ap.add_argument("extra", nargs="*", help="more `swaserve serve` flags (after --)")
    a = ap.parse_args(argv)
    child, url = start_server(a.extra)
    try:
        warm = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        for _ in range(2):
            httpx.post(url + "/v1/chat/completions", content=warm, timeout=300,
                       headers={"content-type": "application/json"})
        cases = ["schema", "optional", "tool", "within", "tool1000"] if a.case == "all" else [a.case]
        for case in cases:
            body = case_body(case, a.props)
            if "tools" in body:  # prefill the prompt first (cached): the window then measures the grammar
                warm_body = {**body, "tool_choice": "auto", "max_tokens": 1}
                httpx.post(url + "/v1/chat/completions", json=warm_body, timeout=600)
            raw = json.dumps(body).encode()
            before, _ = window(url, None)
            gaps, (status, secs, head) = window(url, raw)
            after, _ = window(url, None)
            idle = max(max(before), max(after))
            step = max(statistics.fmean(before), statistics.fmean(after))
            print(f"{case}: body {len(raw) / 1e6:.2f} MB -> {status} in {secs:.1f} s; stream max gap "
                  f"{1e3 * max(gaps):.0f} ms (idle max {1e3 * idle:.0f} ms, mean step {1e3 * step:.1f} ms; "
                  f"limit 2 x idle + step = {1e3 * (2 * idle + step):.0f} ms; n {len(gaps)})", flush=True)
            if status != 200:
                print(f"  {head}", flush=True)
    finally:
        child.stop(timeout=30)


if __name__ == "__main__":
    main()
