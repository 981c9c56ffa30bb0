"""HTTP side of the serving benchmark: streamed chat requests (SSE), server probes, the workload runner."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from swaserve.bench.serve_stats import RequestResult
from swaserve.bench.workloads import Session, Workload, arrival_offsets


@dataclass
class RunConfig:
    base_url: str  # http://host:port (no /v1)
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    timeout: float = 600.0
    extra_body: dict = field(default_factory=dict)  # e.g. {"chat_template_kwargs": {...}}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def apply_chunk(res: RequestResult, obj: dict, now: float, last: list[float]) -> None:
    """Fold one parsed stream chunk into `res`; `last` holds the arrival time of the previous text."""
    if "error" in obj:
        err = obj["error"]
        res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    usage = obj.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details and details["cached_tokens"] is not None:
            res.cached_tokens = int(details["cached_tokens"])
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        text = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        tools = delta.get("tool_calls")
        if tools:
            text += json.dumps(tools, sort_keys=True)
        if text or reasoning:
            res.text += text
            res.reasoning += reasoning
            if res.ttft is None:
                res.ttft = now - res.start
            else:
                res.itl.append(now - last[0])
            last[0] = now
        if ch.get("finish_reason"):
            res.finish_reason = ch["finish_reason"]


async def chat_request(
    client: httpx.AsyncClient, rc: RunConfig, messages: list[dict], max_tokens: int, res: RequestResult
) -> RequestResult:
    """Send one streamed chat completion and fill `res` (timings, usage, text); never raises."""
    body = {
        "model": rc.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": rc.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **rc.extra_body,
    }
    if rc.ignore_eos:
        body["ignore_eos"] = True
    if rc.temperature > 0:
        body["seed"] = rc.seed
    res.start = time.perf_counter()
    last = [res.start]
    try:
        async with client.stream(
            "POST", f"{rc.base_url}/v1/chat/completions", json=body, headers=rc.headers, timeout=rc.timeout
        ) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200]
                res.error = f"HTTP {resp.status_code}: {msg}"
                return res
            done = False
            async for line in resp.aiter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                apply_chunk(res, json.loads(data), time.perf_counter(), last)
            if not done and res.error is None:
                res.error = "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    res.e2e = res.end - res.start
    if res.completion_tokens == 0:  # no usage chunk: count text chunks instead
        res.completion_tokens = len(res.itl) + (res.ttft is not None)
    res.ok = res.error is None
    return res


async def run_session(
    client: httpx.AsyncClient, rc: RunConfig, s: Session, sem: asyncio.Semaphore | None, delay: float
) -> list[RequestResult]:
    """Run a session's turns in order; each reply goes back as plain assistant content (no thinking)."""
    await asyncio.sleep(delay)
    msgs: list[dict] = [{"role": "system", "content": s.system}] if s.system is not None else []
    out = []
    for i, turn in enumerate(s.turns):
        if turn.image is None:
            msgs.append({"role": "user", "content": turn.user})
        else:
            msgs.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": turn.image}},
                                                      {"type": "text", "text": turn.user}]})
        res = RequestResult(s.key, i, turn.tag)
        if sem is None:
            await chat_request(client, rc, list(msgs), turn.max_tokens, res)
        else:
            async with sem:
                await chat_request(client, rc, list(msgs), turn.max_tokens, res)
        out.append(res)
        if not res.ok:
            break
        msgs.append({"role": "assistant", "content": res.text})
    return out


async def run_workload(
    wl: Workload, rc: RunConfig, client: httpx.AsyncClient | None = None
) -> tuple[list[RequestResult], float]:
    """Run the phases in order; returns every request's result and the wall time (s)."""
    own = client is None
    if own:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        client = httpx.AsyncClient(limits=limits, timeout=rc.timeout)
    sem = asyncio.Semaphore(rc.max_concurrency) if rc.max_concurrency else None
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    try:
        for k, phase in enumerate(wl.phases):
            offsets = arrival_offsets(len(phase.sessions), rc.request_rate, rc.seed + k)
            done = await asyncio.gather(
                *(run_session(client, rc, s, sem, d) for s, d in zip(phase.sessions, offsets))
            )
            results.extend(r for rs in done for r in rs)
    finally:
        if own:
            await client.aclose()
    return results, time.perf_counter() - t0


async def run_interleaved(
    wl: Workload, rcs: dict[str, RunConfig], client: httpx.AsyncClient | None = None
) -> dict[str, tuple[list[RequestResult], float]]:
    """Run the workload on several servers, one session at a time, each session on every server in turn.

    Returns per server its results and its busy time (the sum of its sessions' wall times).
    """
    own = client is None
    if own:
        client = httpx.AsyncClient(timeout=max(rc.timeout for rc in rcs.values()))
    out: dict[str, tuple[list[RequestResult], float]] = {name: ([], 0.0) for name in rcs}
    try:
        for phase in wl.phases:
            for s in phase.sessions:
                for name, rc in rcs.items():
                    t0 = time.perf_counter()
                    res = await run_session(client, rc, s, None, 0.0)
                    results, busy = out[name]
                    results.extend(res)
                    out[name] = (results, busy + time.perf_counter() - t0)
    finally:
        if own:
            await client.aclose()
    return out


async def model_id(client: httpx.AsyncClient, base_url: str, headers: dict | None = None) -> str:
    """The first model id of GET /v1/models."""
    r = await client.get(f"{base_url}/v1/models", headers=headers or {})
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def count_tokens(
    client: httpx.AsyncClient, base_url: str, model: str, text: str, headers: dict | None = None
) -> int | None:
    """Token count of `text` from POST /tokenize (vLLM/SGLang shape); None if unavailable."""
    try:
        r = await client.post(
            f"{base_url}/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": False},
            headers=headers or {},
        )
        if r.status_code != 200:
            return None
        d = r.json()
        if "count" in d:
            return int(d["count"])
        return len(d["tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def tokenize_chat(
    client: httpx.AsyncClient, base_url: str, model: str, messages: list[dict], headers: dict | None = None
) -> list[int] | None:
    """Prompt token ids of a chat, rendered by the server's template (POST /tokenize); None if unavailable."""
    try:
        r = await client.post(
            f"{base_url}/tokenize",
            json={"model": model, "messages": messages, "add_generation_prompt": True},
            headers=headers or {},
        )
        if r.status_code != 200:
            return None
        return [int(t) for t in r.json()["tokens"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def wait_healthy(base_url: str, timeout: float, alive=lambda: True) -> None:
    """Poll GET /health until 200; raises RuntimeError on timeout or when `alive()` turns False."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the server exited before becoming healthy")
            try:
                if (await client.get(f"{base_url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server at {base_url} was not healthy after {timeout:.0f} s")
