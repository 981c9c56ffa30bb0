"""Prompt logprobs over HTTP with the official openai client: completions' echo + logprobs (the OpenAI
shape, the first token null) and vLLM's `prompt_logprobs` on completions and chat, streamed and not,
against the exact forward (the served model run once over the whole sequence on a pool of its own).
The server prefills in 24-token chunks, so chunk boundaries fall inside every prompt."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import torch

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.models.hf_oracle import PagedRunner
from tests.server.conftest import SERVED, LiveServer, make_engine, serve_args, wait_idle

TOL = 5e-4  # exact fp32 matmuls: chunks differ from one forward by the order of sums (tests/engine/runner)
TEXT = "The sliding window keeps the last tokens close; " * 4
MESSAGES = [{"role": "user", "content": "Name three prime numbers and say why they are prime."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    # fp32 KV: the oracle's forward keeps its keys in fp32 (the CPU default, fp16, is ~1e-3 off)
    eng = make_engine("--chunked-prefill-size", "24", "--cpu-matmul", "exact", "--kv-cache-dtype", "fp32")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    cfg = server_config_from_args(serve_args("--enable-cache-report", "--served-model-name", SERVED))
    s = LiveServer(build_app(engine, cfg))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def exact(engine: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64 log-softmax of one forward over ids (run while the engine is idle)."""
    wait_idle(engine)
    core = engine.core
    run = PagedRunner(core.runner.model, core.model_config, core.config.cache.page_size, len(ids) + 16, 1)
    with torch.no_grad():
        return torch.log_softmax(run.step([(0, ids)])[0].double(), dim=-1)


def prompt_ids(server: LiveServer, **body: Any) -> list[int]:
    with server.http() as h:
        return h.post("/tokenize", json=body).json()["tokens"]


def check_echo(lp: Any, ids: list[int], ref: torch.Tensor, k: int, texts: list[str]) -> None:
    """The legacy logprobs of an echoed prompt: tokens, null first logprob and alternatives, offsets."""
    n = len(ids)
    assert lp.tokens[:n] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, n):
        assert abs(lp.token_logprobs[t] - ref[t - 1, ids[t]].item()) <= TOL, t
        best = ref[t - 1].topk(k).values.tolist()
        vals = list(lp.top_logprobs[t].values())  # keyed by text: alternatives of one text (U+FFFD) merge
        assert 0 < len(vals) <= k and abs(max(vals) - best[0]) <= TOL
        assert all(min(abs(v - b) for b in best) <= TOL for v in vals)
    assert lp.text_offset[:2] == [0, 0]  # the BOS the server added takes no width in the echoed text
    assert "".join(texts[1:]) == TEXT
    assert all(TEXT[o:o + len(tok)] == tok for o, tok in zip(lp.text_offset[1:n], texts[1:]))


def check_vllm(entries: list[Any], ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs: first null; {token id: {logprob, rank, decoded_token}} of the prompt token
    and the top-k."""
    assert len(entries) == len(ids) and entries[0] is None
    for t in range(1, len(ids)):
        e = entries[t]
        own = e[str(ids[t])]
        assert abs(own["logprob"] - ref[t - 1, ids[t]].item()) <= TOL, t
        assert isinstance(own["decoded_token"], str) and own["rank"] >= 1
        top = sorted((v for v in e.values() if v["rank"] <= k), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == list(range(1, k + 1))
        best = ref[t - 1].topk(k).values.tolist()
        assert all(abs(v["logprob"] - b) <= TOL for v, b in zip(top, best))
        assert len(e) in (k, k + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_max_tokens_0(server: LiveServer, engine: Any, client: openai.OpenAI, stream: bool):
    ids = prompt_ids(server, prompt=TEXT)
    ref = exact(engine, ids)
    texts = [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    kw: dict[str, Any] = dict(model=SERVED, prompt=TEXT, echo=True, logprobs=5, max_tokens=0, temperature=0)
    if not stream:
        r = client.completions.create(**kw)
        c = r.choices[0]
        assert c.text == TEXT and c.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        check_echo(c.logprobs, ids, ref, 5, texts)
        assert len(c.logprobs.tokens) == len(ids)
        return
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    reasons = []
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            text += c.text
            for key in lp:
                lp[key] += getattr(c.logprobs, key) if c.logprobs is not None else []
            reasons.append(c.finish_reason)
    assert text == TEXT and reasons[-1] == "length"
    check_echo(SimpleNamespace(**lp), ids, ref, 5, texts)
    assert len(lp["tokens"]) == len(ids)


def test_echo_logprobs_with_a_completion(server: LiveServer, engine: Any, client: openai.OpenAI):
    """Prompt + completion in one logprobs object; the completion part is a plain request's."""
    ids = prompt_ids(server, prompt=TEXT)
    ref = exact(engine, ids)
    plain = client.completions.create(model=SERVED, prompt=TEXT, logprobs=2, max_tokens=3, temperature=0)
    r = client.completions.create(model=SERVED, prompt=TEXT, echo=True, logprobs=2, max_tokens=3,
                                  temperature=0)
    c, p = r.choices[0], plain.choices[0]
    assert c.text == TEXT + p.text
    texts = [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    check_echo(c.logprobs, ids, ref, 2, texts)
    n = len(ids)
    assert c.logprobs.tokens[n:] == p.logprobs.tokens
    assert all(abs(a - b) <= TOL for a, b in zip(c.logprobs.token_logprobs[n:], p.logprobs.token_logprobs))
    assert c.logprobs.text_offset[n] == len(TEXT)  # offsets index the echoed text


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prompt_logprobs_completions(server: LiveServer, engine: Any, client: openai.OpenAI,
                                          stream: bool):
    ids = prompt_ids(server, prompt=TEXT)
    ref = exact(engine, ids)
    client.completions.create(model=SERVED, prompt=TEXT, max_tokens=1, temperature=0)  # cached now
    kw: dict[str, Any] = dict(model=SERVED, prompt=TEXT, max_tokens=2, temperature=0,
                              extra_body={"prompt_logprobs": 3})
    if not stream:
        r = client.completions.create(**kw)
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # recomputed for its logprobs
        check_vllm(r.choices[0].model_extra["prompt_logprobs"], ids, ref, 3)
        return
    chunks = [ch for ch in client.completions.create(stream=True, **kw) if ch.choices]
    firsts = [ch.choices[0].model_extra.get("prompt_logprobs") for ch in chunks]
    assert firsts[0] is not None and all(f is None for f in firsts[1:])  # once, on the first chunk
    check_vllm(firsts[0], ids, ref, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prompt_logprobs_chat(server: LiveServer, engine: Any, client: openai.OpenAI, stream: bool):
    ids = prompt_ids(server, messages=MESSAGES)
    ref = exact(engine, ids)
    kw: dict[str, Any] = dict(model=SERVED, messages=MESSAGES, max_tokens=2, temperature=0,
                              extra_body={"prompt_logprobs": 2})
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.usage.prompt_tokens == len(ids)
        check_vllm(r.model_extra["prompt_logprobs"], ids, ref, 2)
        return
    got = [ch.model_extra["prompt_logprobs"] for ch in client.chat.completions.create(stream=True, **kw)
           if (ch.model_extra or {}).get("prompt_logprobs") is not None]
    assert len(got) == 1
    check_vllm(got[0], ids, ref, 2)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 50}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_400_envelopes(server: LiveServer, path: str, body: dict[str, Any], param: str):
    with server.http() as h:
        r = h.post(path, json={"model": SERVED, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_tokenizer_info_for_remote_tokenizers(server: LiveServer, engine: Any):
    """What lm-evaluation-harness's remote tokenizer reads (the special tokens; the chat template)."""
    with server.http() as h:
        info = h.get("/tokenizer_info").json()
        tok = engine.tokenizer
        assert (info["bos_token"], info["eos_token"]) == (tok.bos_token, tok.eos_token)
        assert info["model_max_length"] == engine.context_length and info["vocab_size"] == tok.vocab_size
        assert info["chat_template"] == engine.chat_template.source
        eos = h.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos["tokens"] == [min(tok.eos_ids)]  # lm-eval's eos_token_id
