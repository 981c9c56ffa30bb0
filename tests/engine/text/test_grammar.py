"""Structured output in the engine (llguidance): the random demo model under a grammar returns valid output,
every choice has its own matcher, preemption keeps the matcher in step, finished requests free it."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from swaserve.engine.core import GrammarSpec, RequestError, SamplingParams
from swaserve.engine.text.grammar import GrammarBackend, json_lark
from swaserve.llm import LLM

W = 64  # the tiny preset's window
CHUNK = 96


class Order(BaseModel):
    """The oracle: pydantic validates what the model wrote against the schema it generated."""

    model_config = ConfigDict(extra="forbid")
    item: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)
    express: bool
    size: Literal["S", "M", "L"]
    notes: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)
    # every string is bounded: a random model picks among the allowed tokens, so it ends only when the
    # schema makes it end


SPEC = GrammarSpec("json_schema", json.dumps(Order.model_json_schema()))


@pytest.fixture(scope="module")
def llm() -> LLM:
    # the exact matmul path: a re-prefill after preemption recomputes KV that decode steps wrote, and only
    # the exact path computes a row the same way at every batch shape (native quantizes activations
    # per call; its own tests cover it)
    return LLM(chunked_prefill_size=CHUNK, max_running_requests=16, cpu_threads=1, cpu_matmul="exact")


def test_random_model_writes_schema_valid_json_n_choices(llm):
    """n = 3 sampled choices: each has its own matcher (they diverge) and each is valid."""
    outs = llm.generate(["Order something."], SamplingParams(max_tokens=400, temperature=1.0, n=3, seed=7,
                                                             grammar=SPEC))
    assert len({o.text for o in outs}) > 1  # the choices did diverge
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert o.token_ids[-1] in llm.engine.eos_ids  # the grammar ended with EOS
        Order.model_validate_json(o.text)
    assert all(r.grammar is None for r in llm.engine.scheduler.running)


def test_greedy_lark_with_special_tokens_and_regex(llm):
    lark = 'start: <|tool_call> "call:f{x:" <|"|> /[a-z]{1,6}/ <|"|> "}" <tool_call|>'
    (o,) = llm.generate(["Call it."], SamplingParams(max_tokens=40, temperature=0.0,
                                                     grammar=GrammarSpec("lark", lark)))
    ids = o.token_ids
    tok = llm.tokenizer
    assert ids[0] == tok.piece_to_id("<|tool_call>") and tok.piece_to_id('<|"|>') in ids
    text = tok.decode(ids[:-1])
    assert text.startswith('<|tool_call>call:f{x:<|"|>') and text.endswith('<|"|>}<tool_call|>')
    (r,) = llm.generate(["Digits"], SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                   grammar=GrammarSpec("regex", r"[0-9]{3}-[0-9]{2}")))
    assert r.finish_reason == "stop" and len(r.text) == 6 and r.text[3] == "-"


def test_json_embedded_in_lark(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    spec = GrammarSpec("lark", f"start: {json_lark(schema)}\n")
    (o,) = llm.generate(["x"], SamplingParams(max_tokens=60, temperature=0.0, grammar=spec))
    assert o.finish_reason == "stop" and isinstance(json.loads(o.text)["a"], int)


def test_preemption_keeps_matchers_in_step(llm):
    """A tight KV arena forces preemption (re-admission and re-prefill); greedy outputs equal the runs
    alone. The smallest arena for 8 running windows: their windows take most of it, so their full
    pages do not fit beside them."""
    small = LLM(chunked_prefill_size=CHUNK, max_running_requests=8, cpu_threads=1, cpu_matmul="exact",
                full_tokens=160, swa_tokens=8 * (W + 32) + CHUNK + 16)
    prompts = [[2] + [100 + (i * 37 + j) % 2000 for j in range(60 + 13 * i)] for i in range(10)]
    params = SamplingParams(max_tokens=200, temperature=0.0, grammar=SPEC)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    alone = llm.generate(prompts, params)
    for o, a in zip(outs, alone):
        assert o.token_ids == a.token_ids
        if o.finish_reason == "stop":
            Order.model_validate_json(o.text)
        else:  # cut by max_tokens: still a prefix the grammar accepts
            assert o.finish_reason == "length"
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


def test_bad_grammars_are_request_errors(llm):
    for spec in (GrammarSpec("lark", "start: undefined_rule"), GrammarSpec("json_schema", "{not json"),
                 GrammarSpec("regex", "(")):
        with pytest.raises(RequestError):
            llm.engine.add_request("bad", [2, 5], SamplingParams(grammar=spec))
    with pytest.raises(RequestError, match="ignore_eos"):
        llm.engine.add_request("bad", [2, 5], SamplingParams(grammar=SPEC, ignore_eos=True))
    assert not llm.engine.has_unfinished()


def test_backend_masks_and_failed_state(llm):
    backend = GrammarBackend(llm.tokenizer, llm.engine.eos_ids)
    st = backend.new_state(GrammarSpec("regex", "ab"))
    mask = backend.fill([st])  # [1, ceil(V / 32)]
    allowed = [t for t in range(llm.tokenizer.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(llm.tokenizer.decode([t]) in ("a", "ab") for t in allowed)
    st.sync([llm.tokenizer.encode("zz")[0]])  # a token the grammar rejects
    assert st.failed and st.done
    mask = backend.fill([st])
    allowed = {t for t in range(llm.tokenizer.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert allowed == set(backend.eos_ids)
