"""A tiny fake OpenAI chat server for the benchmark tests: words are tokens, a prefix cache with the
lazy / eager-16 / naive behaviours, TTFT proportional to the uncached tokens, deterministic replies.

Run as `python -m tests.bench.fake_server --port P --policy lazy` (used to test the server launcher).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.helpers import lcp

PAGE = 4
SEC_PER_UNCACHED_TOKEN = 5e-4  # large enough that HTTP overhead on a loaded 2-core box stays below it


def render(messages: list[dict]) -> list[str]:
    """Chat 'template': words of every message, with role markers; generation prompt at the end."""
    toks = []
    for m in messages:
        toks += [f"<{m['role']}>"] + str(m.get("content") or "").split() + ["</turn>"]
    return toks + ["<model>", "<thought>", "</thought>"]


class FakeCache:
    def __init__(self, policy: str):
        self.policy = policy
        self.prompts: list[list[str]] = []

    def match(self, toks: list[str]) -> int:
        if self.policy == "naive":
            return 0
        best = 0
        for p in self.prompts:
            n = lcp(p, toks)
            if self.policy == "eager" and n < len(p) - 16:  # the seed: windows trimmed before end - 16
                continue
            best = max(best, n)
        return min(best, len(toks) - 1) // PAGE * PAGE


def build_fake_app(policy: str = "lazy") -> FastAPI:
    app = FastAPI()
    cache = FakeCache(policy)
    app.state.received = []  # every chat request body, for assertions

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": f"fake-{policy}", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        body = await req.json()
        toks = render(body["messages"]) if "messages" in body else body["prompt"].split()
        ids = [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) for t in toks]  # stable ids
        return {"tokens": ids, "count": len(toks)}

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        body = await req.json()
        app.state.received.append(body)
        if body.get("max_tokens", 1) > 1000:
            return JSONResponse(
                {
                    "error": {
                        "message": "max_tokens too large",
                        "type": "invalid_request_error",
                        "param": "max_tokens",
                        "code": None,
                    }
                },
                status_code=400,
            )
        toks = render(body["messages"])
        cached = cache.match(toks)
        cache.prompts.append(toks)
        digest = hashlib.sha256(" ".join(toks).encode()).hexdigest()
        words = [f"w{digest[i % 60 : i % 60 + 4]}" for i in range(body["max_tokens"])]

        async def stream():
            await asyncio.sleep(SEC_PER_UNCACHED_TOKEN * (len(toks) - cached))
            head = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            yield f"data: {json.dumps(head)}\n\n"
            think = {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}
            yield f"data: {json.dumps(think)}\n\n"
            for i, w in enumerate(words):
                await asyncio.sleep(0.0005)
                fin = "length" if i == len(words) - 1 else None
                chunk = {
                    "choices": [
                        {"index": 0, "delta": {"content": (" " if i else "") + w}, "finish_reason": fin}
                    ]
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {
                "prompt_tokens": len(toks),
                "completion_tokens": len(words),
                "total_tokens": len(toks) + len(words),
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--cache-type", default="radix")  # `swaserve serve` flags, as the bench passes them
    ap.add_argument("--swa-retain-policy", default="lazy")
    a, _ = ap.parse_known_args()
    policy = a.policy or ("naive" if a.cache_type == "naive" else a.swa_retain_policy)
    uvicorn.run(build_fake_app(policy), host="127.0.0.1", port=a.port, log_level="warning")
