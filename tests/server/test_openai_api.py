"""OpenAI API behaviour through the official client against the real engine (tiny demo model)."""

from __future__ import annotations

import logging

import openai
import pytest

from tests.server.conftest import SERVED, LiveServer, greedy

USER = [{"role": "user", "content": "Write a short note about sliding window attention."}]


def _collect_chat_stream(stream) -> tuple[str, str | None, list]:
    text, finish, chunks = "", None, []
    for ch in stream:
        chunks.append(ch)
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, chunks


def test_models_and_health(server: LiveServer, client: openai.OpenAI, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert client.models.retrieve(SERVED).id == SERVED
    with server.http() as h:
        assert h.get("/health").status_code == 200
    # the engine's own model name is accepted too, and answered as the served name
    r = client.chat.completions.create(model=engine.model_name, messages=USER, max_tokens=2)
    assert r.model == SERVED


def test_chat_stream_equals_non_stream_greedy(client: openai.OpenAI):
    full = client.chat.completions.create(model=SERVED, messages=USER, **greedy(max_tokens=24))
    msg = full.choices[0].message
    assert msg.role == "assistant"
    assert full.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=SERVED, messages=USER, stream=True,
                                            stream_options={"include_usage": True}, **greedy(max_tokens=24))
    text, finish, chunks = _collect_chat_stream(stream)
    assert text == (msg.content or "")
    assert finish == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens_details is not None
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI):
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=SERVED, messages=USER, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_usage_matches_tokenize_and_cache_report(server: LiveServer, client: openai.OpenAI):
    msgs = [{"role": "system", "content": "You are terse. Cache report test prompt number one."},
            {"role": "user", "content": "Explain why prefix caching saves prefill time in one line."}]
    with server.http() as h:
        tok = h.post("/tokenize", json={"messages": msgs}).json()
    r1 = client.chat.completions.create(model=SERVED, messages=msgs, **greedy(max_tokens=4))
    assert r1.usage.prompt_tokens == tok["count"]
    assert r1.usage.total_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens == 0  # present and 0 on a cold prompt
    r2 = client.chat.completions.create(model=SERVED, messages=msgs, **greedy(max_tokens=4))
    cached = r2.usage.prompt_tokens_details.cached_tokens
    page = 16
    assert tok["count"] - 1 - page < cached <= tok["count"] - 1  # a full hit: all but the last token, paged
    assert r2.choices[0].message.content == r1.choices[0].message.content


def test_no_cache_report_without_flag(engine):
    from swaserve.server.app import ServerConfig, build_app

    s = LiveServer(build_app(engine, ServerConfig(served_model_name=SERVED)))
    try:
        c = s.client()
        r = c.chat.completions.create(model=SERVED, messages=USER, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is None
        with s.http() as h:
            req = {"model": SERVED, "messages": USER, "max_tokens": 2}
            body = h.post("/v1/chat/completions", json=req).json()
        assert "prompt_tokens_details" not in body["usage"]
    finally:
        s.stop()


def test_completions_text_ids_list_and_stream(server: LiveServer, client: openai.OpenAI):
    prompt = "The quick brown fox jumps over"
    with server.http() as h:
        ids = h.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert h.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith(prompt)
    a = client.completions.create(model=SERVED, prompt=prompt, **greedy(max_tokens=8))
    b = client.completions.create(model=SERVED, prompt=ids, **greedy(max_tokens=8))
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)
    lst = client.completions.create(model=SERVED, prompt=[prompt, "A different prompt entirely"],
                                    **greedy(max_tokens=8))
    assert [c.index for c in lst.choices] == [0, 1]
    assert lst.choices[0].text == a.choices[0].text
    single = client.completions.create(model=SERVED, prompt="A different prompt entirely",
                                       **greedy(max_tokens=8))
    assert lst.choices[1].text == single.choices[0].text
    assert lst.usage.prompt_tokens == a.usage.prompt_tokens + single.usage.prompt_tokens
    streamed = {0: "", 1: ""}
    for ch in client.completions.create(model=SERVED, prompt=[prompt, "A different prompt entirely"],
                                        stream=True, **greedy(max_tokens=8)):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == {0: a.choices[0].text, 1: single.choices[0].text}
    echo = client.completions.create(model=SERVED, prompt=prompt, echo=True, **greedy(max_tokens=8))
    assert echo.choices[0].text == prompt + a.choices[0].text


def test_stop_strings_cut_the_greedy_output(client: openai.OpenAI):
    base = client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=24,
                                     **greedy(extra_body={"ignore_eos": True}))
    text = base.choices[0].text
    stop = next((text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip()), None)
    if stop is None:
        pytest.skip(f"greedy output too short to pick a stop string: {text!r}")
    cut = client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=24, stop=[stop],
                                    **greedy(extra_body={"ignore_eos": True}))
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_chat_and_completions(client: openai.OpenAI):
    r = client.chat.completions.create(model=SERVED, messages=USER, logprobs=True, top_logprobs=3,
                                       **greedy(max_tokens=6))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)  # greedy picks the top-1
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert t.logprob <= 0
    c = client.completions.create(model=SERVED, prompt="Hello there", logprobs=2, **greedy(max_tokens=5))
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) <= 2 for d in lp.top_logprobs)


def test_n_choices_and_seed(client: openai.OpenAI):
    r = client.chat.completions.create(model=SERVED, messages=USER, n=3, max_tokens=6, temperature=1.0,
                                       seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    again = client.chat.completions.create(model=SERVED, messages=USER, n=3, max_tokens=6, temperature=1.0,
                                           seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = {0: "", 1: "", 2: ""}
    for ch in client.chat.completions.create(model=SERVED, messages=USER, n=3, max_tokens=6, temperature=1.0,
                                             seed=7, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in r.choices]


def test_sampling_fields_accepted(client: openai.OpenAI):
    r = client.chat.completions.create(
        model=SERVED, messages=USER, max_tokens=4, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=3, stop=["zzzz"], logit_bias={"5": -100}, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [1],
                    "ignore_eos": False, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens >= 1


def test_logit_bias_forces_a_token(server: LiveServer, client: openai.OpenAI):
    with server.http() as h:
        tid = h.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    r = client.completions.create(model=SERVED, prompt="Fruit:", max_tokens=3, logit_bias={str(tid): 100},
                                  **greedy(extra_body={"ignore_eos": True}))
    with server.http() as h:
        piece = h.post("/detokenize", json={"tokens": [tid]}).json()["prompt"]
    assert r.choices[0].text == piece * 3


def test_chat_template_kwargs_enable_thinking(server: LiveServer, client: openai.OpenAI):
    with server.http() as h:
        plain = h.post("/tokenize", json={"messages": USER}).json()
        kw = {"enable_thinking": True}
        think = h.post("/tokenize", json={"messages": USER, "chat_template_kwargs": kw}).json()
    assert think["tokens"] != plain["tokens"]
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.usage.prompt_tokens == think["count"]


def test_named_tool_choice_returns_that_call(client: openai.OpenAI):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=SERVED, messages=USER, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    assert [tc.function.name for tc in choice.message.tool_calls] == ["get_time"]
    s = client.chat.completions.create(model=SERVED, messages=USER, tools=tools, max_tokens=8, stream=True,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=0)
    names = [tc.function.name for ch in s for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert names == ["get_time"]
    # tool_choice "none" and "auto" with tools run normally
    for tc in ("none", "auto"):
        r = client.chat.completions.create(model=SERVED, messages=USER, tools=tools, tool_choice=tc,
                                           max_tokens=3)
        assert r.usage.completion_tokens >= 1


def test_multi_turn_with_tool_messages_and_parts(client: openai.OpenAI):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                         {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"}]
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=3)
    assert r.usage.prompt_tokens > 30


def test_metrics_exposed(server: LiveServer, client: openai.OpenAI):
    client.chat.completions.create(model=SERVED, messages=USER, max_tokens=2)
    with server.http() as h:
        text = h.get("/metrics").text
    for name in ("swaserve:prompt_tokens_total", "swaserve:generation_tokens_total",
                 "swaserve:time_to_first_token_seconds_bucket", "swaserve:inter_token_latency_seconds_bucket",
                 "swaserve:e2e_request_latency_seconds_count", "swaserve:num_requests_running",
                 "swaserve:num_requests_waiting",
                 'swaserve:kv_cache_usage_perc{model_name="swaserve-test",pool="full"}', 'pool="swa"',
                 "swaserve:prefix_cache_queries_total", "swaserve:prefix_cache_hits_total"):
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['swaserve:generation_tokens_total{model_name="swaserve-test"}'] >= 2
    assert values["swaserve:e2e_request_latency_seconds_count"] >= 1
    blocks = {st: values[f'swaserve:kv_arena_blocks{{model_name="swaserve-test",state="{st}"}}']
              for st in ("total", "free", "full", "swa")}
    assert blocks["free"] + blocks["full"] + blocks["swa"] == blocks["total"] > 0
    assert values['swaserve:kv_cache_pages{model_name="swaserve-test",pool="full",state="capacity"}'] > 0


def test_one_info_line_per_request(client: openai.OpenAI, caplog):
    with caplog.at_level(logging.INFO):
        r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=3)
        s = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=3, stream=True)
        sid = [ch.id for ch in s][0]
    for rid in (r.id, sid):
        lines = [rec for rec in caplog.records if rec.levelno >= logging.INFO and rid in rec.getMessage()]
        assert len(lines) == 1, [rec.getMessage() for rec in lines]
        msg = lines[0].getMessage()
        for field in ("prompt=", "cached=", "completion=", "ttft=", "total="):
            assert field in msg
