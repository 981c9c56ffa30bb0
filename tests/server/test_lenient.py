"""Requests as agent frameworks and vLLM / llama.cpp clients send them; sampling defaults; template
overrides; the fields and flags users look for; the small bugs of round 1 (each test fails before its fix)."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from swaserve import cli
from swaserve.engine.model_api import generation_defaults
from swaserve.server.app import ServerConfig, build_app
from swaserve.server.launch import apply_aliases, server_config_from_args
from swaserve.server.params import parse_default_sampling
from tests.server.conftest import SERVED, LiveServer, serve_args
from tests.server.fake_engine import FakeEngine

USER = [{"role": "user", "content": "hello"}]
ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.fixture
def fake():
    servers: list[LiveServer] = []

    def make(cfg: ServerConfig | None = None, **kw) -> tuple[FakeEngine, LiveServer]:
        eng = FakeEngine(**kw)
        s = LiveServer(build_app(eng, cfg or ServerConfig(served_model_name=SERVED)))
        servers.append(s)
        return eng, s

    yield make
    for s in servers:
        s.stop()


# what LangChain's ChatOpenAI, the Agents SDK (chat-completions model), vLLM and llama.cpp clients send
FRAMEWORK_FIELDS = {
    "reasoning_effort": "low", "store": False, "metadata": {"run": "1"}, "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "u1", "verbosity": "low", "user": "u", "audio": None,
    "skip_special_tokens": True, "min_tokens": 1, "include_stop_str_in_output": False,
    "continue_final_message": False, "add_generation_prompt": True, "echo": False,
    "stream_options": None, "cache_prompt": True, "parallel_tool_calls": True, "modalities": ["text"],
    "prediction": None, "web_search_options": None, "spaces_between_special_tokens": True,
}


def test_framework_fields_are_accepted(server: LiveServer, caplog):
    history = [USER[0], {"role": "assistant", "content": "hi", "refusal": None, "audio": None,
                         "function_call": None, "tool_calls": None, "annotations": []}, USER[0]]
    with server.http() as h, caplog.at_level(logging.WARNING, "swaserve.server"):
        r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": history, "max_tokens": 2,
                                                  **FRAMEWORK_FIELDS})
        assert r.status_code == 200, r.text
        assert not [rec for rec in caplog.records if "unknown field" in rec.getMessage()]
        r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "max_tokens": 2,
                                                  "frobnicate": 1, "stream_options": None,
                                                  "messages_extra": {"x": 1}})
        assert r.status_code == 200
        warned = [rec.getMessage() for rec in caplog.records if "unknown field" in rec.getMessage()]
        assert len(warned) == 1 and "frobnicate" in warned[0] and "messages_extra" in warned[0]
        r = h.post("/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2,
                                            "cache_prompt": True, "n_predict": 3})
        assert r.status_code == 200


def test_strict_requests_restores_400(engine):
    cfg = server_config_from_args(serve_args("--served-model-name", SERVED, "--strict-requests"))
    s = LiveServer(build_app(engine, cfg))
    try:
        with s.http() as h:
            r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "frobnicate": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
            msgs = [{"role": "user", "content": "x", "extra": 1}]
            r = h.post("/v1/chat/completions", json={"model": SERVED, "max_tokens": 1, "messages": msgs})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].extra"
            r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "max_tokens": 1,
                                                      "store": False, "reasoning_effort": "none"})
            assert r.status_code == 200  # documented fields stay accepted
        with pytest.raises(openai.BadRequestError) as ei:
            s.client().chat.completions.create(model=SERVED, messages=USER, extra_body={"unknown_field": 1})
        assert ei.value.body["code"] == "unsupported_parameter"
    finally:
        s.stop()


def test_reasoning_effort_maps_to_thinking(fake):
    eng, s = fake()
    c = s.client()
    for effort, thinking in (("none", False), ("minimal", False), ("low", True), ("high", True)):
        c.chat.completions.create(model=SERVED, messages=USER, max_tokens=1, reasoning_effort=effort)
        assert ("<|think|>" in eng.tokenizer.decode(eng.last_prompt)) == thinking, effort
    c.chat.completions.create(model=SERVED, messages=USER, max_tokens=1, reasoning_effort="high",
                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "<|think|>" not in eng.tokenizer.decode(eng.last_prompt)  # the explicit kwarg wins


def test_sampling_defaults(fake):
    eng, s = fake()
    c = s.client()
    c.chat.completions.create(model=SERVED, messages=USER, max_tokens=1)
    p = eng.last_params
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 64, 0.95, 0.0)  # Gemma 4's published defaults
    eng.generation_defaults = generation_defaults({"general.sampling.top_k": 20, "general.sampling.temp": 0.6,
                                                   "general.sampling.penalty_repeat": 1.1})
    c.completions.create(model=SERVED, prompt="x", max_tokens=1)
    p = eng.last_params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.6, 20, 0.95, 1.1)  # the GGUF's
    flag = tuple(parse_default_sampling("temperature=0.3,top_k=0").items())
    eng2, s2 = fake(ServerConfig(served_model_name=SERVED, default_sampling=flag))
    eng2.generation_defaults = dict(eng.generation_defaults)
    s2.client().chat.completions.create(model=SERVED, messages=USER, max_tokens=1)
    assert (eng2.last_params.temperature, eng2.last_params.top_k) == (0.3, -1)  # the flag over the GGUF
    s2.client().chat.completions.create(model=SERVED, messages=USER, max_tokens=1, temperature=0.9, top_p=0.5)
    assert (eng2.last_params.temperature, eng2.last_params.top_p) == (0.9, 0.5)  # the request wins
    want = {"temperature": 0.5, "max_tokens": 7}
    assert parse_default_sampling('{"temperature": 0.5, "max_new_tokens": 7}') == want
    for bad in ("temperature", "warmth=1", "top_p=2", "top_k=x"):
        with pytest.raises(ValueError, match="--default-sampling"):
            parse_default_sampling(bad)


def test_chat_template_kwargs_collisions_and_add_generation_prompt(server: LiveServer):
    with server.http() as h:
        for kw in ({"tools": []}, {"messages": []}):
            r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "max_tokens": 1,
                                                      "chat_template_kwargs": kw})
            assert r.status_code == 400, r.text
        r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "max_tokens": 1,
                                                  "chat_template_kwargs": {"add_generation_prompt": False}})
        assert r.status_code == 200
        kw = {"add_generation_prompt": True}
        r = h.post("/tokenize", json={"messages": USER, "chat_template_kwargs": kw})
        assert r.status_code == 200


def test_missing_chat_template_and_the_flag(fake, tmp_path):
    _, s = fake(chat_template=False)
    with s.http() as h:
        r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        r = h.post("/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|turn>model\nCUSTOM{% endif %}")
    cfg = server_config_from_args(serve_args("--served-model-name", SERVED, "--chat-template", str(path)))
    eng, s = fake(cfg, chat_template=False)
    r = s.client().chat.completions.create(model=SERVED, messages=USER, max_tokens=1)
    assert r.choices[0].finish_reason and eng.tokenizer.decode(eng.last_prompt).endswith("model\nCUSTOM")
    for text, msg in (("{% if %}", "--chat-template"), ("", "empty")):
        path.write_text(text)
        with pytest.raises(ValueError, match=msg):
            server_config_from_args(serve_args("--chat-template", str(path)))
    with pytest.raises(ValueError, match="no such file"):
        server_config_from_args(serve_args("--chat-template", str(tmp_path / "missing.jinja")))


def test_literal_special_text_survives_and_logprob_bytes(fake):
    eng, s = fake()
    tok = eng.tokenizer
    literal = [t for ch in "The token <eos> ends" for t in tok.encode(ch)]  # "<eos>" spelled as text tokens
    byte = tok.piece_to_id("<0xE2>")
    eng.reply_ids = literal + [tok.piece_to_id("<eos>"), byte]
    r = s.client().chat.completions.create(model=SERVED, messages=USER, max_tokens=40, logprobs=True,
                                           top_logprobs=1)
    assert r.choices[0].message.content.startswith("The token <eos> ends")  # the real <eos> token is dropped
    assert r.choices[0].logprobs.content[-1].bytes == [0xE2]  # not U+FFFD's bytes


def test_context_overflow_names_the_field_sent(server: LiveServer, engine):
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"model": SERVED, "messages": USER,
                                                  "max_completion_tokens": engine.context_length})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_completion_tokens"
        assert "max_completion_tokens" in err["message"] and "max_tokens" not in err["message"].replace(
            "max_completion_tokens", "")


def test_reasoning_fields_and_tokens(fake):
    eng, s = fake()
    tok = eng.tokenizer
    eng.reply_ids = (tok.encode("<|channel>") + tok.encode("thought\n") + tok.encode("step one")
                     + tok.encode("<channel|>") + tok.encode("Answer"))
    c = s.client()
    r = c.chat.completions.create(model=SERVED, messages=USER, max_tokens=40)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] == "step one" and msg["content"] == "Answer"
    thought = len(eng.reply_ids) - len(tok.encode("Answer"))
    assert r.usage.completion_tokens_details.reasoning_tokens == thought
    deltas = [ch.choices[0].delta.model_dump() for ch in c.chat.completions.create(
        model=SERVED, messages=USER, max_tokens=40, stream=True) if ch.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "step one"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "step one"


def test_vllm_chat_extensions(fake):
    eng, s = fake()
    eng.reply = " world"
    c = s.client()
    msgs = [USER[0], {"role": "assistant", "content": "Hello"}]
    r = c.chat.completions.create(model=SERVED, messages=msgs, max_tokens=5,
                                  extra_body={"continue_final_message": True, "echo": True})
    assert r.choices[0].message.content == "Hello world"
    assert eng.tokenizer.decode(eng.last_prompt).endswith("Hello")  # the assistant turn is left open
    chunks = list(c.chat.completions.create(model=SERVED, messages=USER, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}}))
    assert all(ch.usage is not None for ch in chunks)
    c.chat.completions.create(model=SERVED, messages=USER, max_tokens=5, extra_body={"min_tokens": 2})
    assert eng.last_params.min_tokens == 2


def test_serving_flags_and_vllm_aliases(engine):
    args = serve_args("--served-model-name", "a", "b", "--max-model-len", "512", "--gpu-memory-utilization",
                      "0.5", "--no-enable-prefix-caching", "--allowed-origins", "http://x.test")
    apply_aliases(args)
    from swaserve.engine.args import engine_config_from_args

    ecfg = engine_config_from_args(args)
    assert ecfg.scheduler.context_length == 512 and ecfg.cache.kv_memory_fraction == 0.5
    assert ecfg.cache.cache_type == "naive"
    cfg = server_config_from_args(args)
    assert (cfg.served_model_name, cfg.served_model_aliases) == ("a", ("b",))
    assert cli.build_parser().parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True
    s = LiveServer(build_app(engine, cfg))
    try:
        c = s.client()
        assert [m.id for m in c.models.list().data] == ["a", "b"]
        assert c.chat.completions.create(model="b", messages=USER, max_tokens=1).model == "b"
        with httpx.Client(base_url=s.url) as h:
            pre = h.options("/v1/chat/completions", headers={"Origin": "http://x.test",
                                                             "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://x.test"
    finally:
        s.stop()
    plain = LiveServer(build_app(engine, ServerConfig(served_model_name=SERVED)))
    try:
        with httpx.Client(base_url=plain.url) as h:
            r = h.get("/v1/models", headers={"Origin": "http://x.test"})
            assert "access-control-allow-origin" not in r.headers  # CORS is off by default
    finally:
        plain.stop()
