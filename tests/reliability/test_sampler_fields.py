"""Every sampling field of a request reaches the sampler: each field set to a value no default has, on
/v1/completions, /v1/chat/completions and /v1/responses, and the rows the model runner hands to the
sampler (recorded by wrapping engine/runner/model_runner.py's sample_isolated) carry exactly those values, the
prompt for the repetition penalty, the output for the other penalties, the stop ids while min_tokens
is not reached, and a generator seeded from the request's seed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from swaserve.engine.runner import model_runner
from swaserve.engine.runner.sampling import make_generator

FIELDS = {"temperature": 0.7, "top_p": 0.83, "top_k": 7, "min_p": 0.11, "presence_penalty": 0.3,
          "frequency_penalty": 0.4, "repetition_penalty": 1.2, "seed": 1234}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    calls: list[list[Any]] = []
    lock = threading.Lock()
    real = model_runner.sample_isolated

    def spy(logits, rows, *a, **kw):
        with lock:
            calls.append([(r.params, r.generator.get_state().clone() if r.generator is not None else None,
                           list(r.prompt_ids), list(r.output_ids), list(r.banned_ids)) for r in rows])
        return real(logits, rows, *a, **kw)

    monkeypatch.setattr(model_runner, "sample_isolated", spy)
    return calls


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_every_sampling_field_reaches_the_sampler(live: Any, rel_engine: Any, recorded: list, route: str):
    s = live()
    tok = rel_engine.tokenizer
    prompt = [2] + tok.encode("sampler fields", add_bos=False)
    bias = {str(prompt[1]): 2.5}
    if route == "completions":
        path, body = "/v1/completions", {"prompt": prompt, "max_tokens": 4, "logit_bias": bias, "logprobs": 2,
                                         "min_tokens": 3, "stop_token_ids": [5], "ignore_eos": True, **FIELDS}
    elif route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "sampler fields"}],
                                              "max_tokens": 4, "logit_bias": bias, "logprobs": True,
                                              "top_logprobs": 2, "min_tokens": 3, "stop_token_ids": [5],
                                              "ignore_eos": True, **FIELDS}
    else:
        path, body = "/v1/responses", {"input": "sampler fields", "max_output_tokens": 4,
                                       **{k: v for k, v in FIELDS.items()}}
    with s.http() as http:
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    rows = [row for call in recorded for row in call]
    assert 1 <= len(rows) <= 4  # one row per generated token (4 unless the model ended early)
    p, state0, prompt_ids, out0, banned0 = rows[0]
    for name, v in FIELDS.items():
        assert getattr(p, name) == pytest.approx(v), name
    assert torch.equal(state0, make_generator(FIELDS["seed"]).get_state())
    assert prompt_ids and len(prompt_ids) == r.json()["usage"].get("prompt_tokens",
                                                                   r.json()["usage"].get("input_tokens"))
    assert out0 == []
    assert [len(row[3]) for row in rows] == list(range(len(rows)))  # the penalties see the output so far
    if route != "responses":
        assert p.logit_bias == ((prompt[1], 2.5),)
        assert p.logprobs == 2 and p.min_tokens == 3 and 5 in p.stop_token_ids
        # the stop ids are banned for the first 3 tokens
        assert len(rows) == 4 and [row[4] for row in rows] == [[5], [5], [5], []]
