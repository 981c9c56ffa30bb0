"""Offline LLM API and `swaserve generate` on the demo model."""

from __future__ import annotations

import pytest

from swaserve import cli
from swaserve.engine.args import engine_config_from_kwargs
from swaserve.engine.core import SamplingParams
from swaserve.llm import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_build_engine_config_maps_flat_kwargs():
    cfg = engine_config_from_kwargs(None, page_size=4, max_running_requests=3, cache_type="naive",
                                    device="cpu", max_total_tokens=1000)
    assert cfg.cache.page_size == 4 and cfg.cache.cache_type == "naive" and cfg.cache.full_tokens == 1000
    assert cfg.scheduler.max_running_requests == 3 and cfg.device == "cpu"
    with pytest.raises(ValueError, match="unknown engine argument"):
        engine_config_from_kwargs(None, page_sise=4)


def test_generate_text_and_ids(llm):
    outs = llm.generate(["hello world", "a b c"], SamplingParams(max_tokens=5, temperature=0.0))
    assert len(outs) == 2
    for o in outs:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    (again,) = llm.generate(llm.encode("hello world"), SamplingParams(max_tokens=5, temperature=0.0))
    assert again.token_ids == outs[0].token_ids and again.prompt_tokens == outs[0].prompt_tokens


def test_eos_stops_unless_ignored(llm):
    eos = min(llm.engine.eos_ids)
    # a logit_bias that forces EOS as the first token
    p = SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((eos, 100.0),))
    (o,) = llm.generate(["hi"], p)
    assert o.token_ids == [eos] and o.finish_reason == "stop" and o.matched_stop == eos and o.text == ""
    (o,) = llm.generate(["hi"], SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((eos, 100.0),),
                                               ignore_eos=True))
    assert o.token_ids == [eos] * 5 and o.finish_reason == "length"


def test_cli_generate_matches_llm(llm, capsys):
    ids = llm.encode("hello there")
    (ref,) = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0))
    assert cli.main(["generate", "--prompt", "hello there", "--max-tokens", "6", "--print-ids"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ",".join(map(str, ref.token_ids))
    assert cli.main(["generate", "--token-ids", ",".join(map(str, ids)), "--max-tokens", "6",
                     "--print-ids"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == lines[-1]


def test_cli_generate_chat_and_sampling(llm, capsys):
    chat_ids, _ = llm.chat_ids([{"role": "user", "content": "hi"}])
    (ref,) = llm.generate([chat_ids], SamplingParams(max_tokens=4, temperature=0.0))
    assert cli.main(["generate", "--chat", "--prompt", "hi", "--max-tokens", "4", "--print-ids"]) == 0
    out = capsys.readouterr().out.splitlines()[-1]
    assert out == ",".join(map(str, ref.token_ids))
    args = ["generate", "--prompt", "x", "--max-tokens", "8", "--temperature", "1.0", "--seed", "7",
            "--ignore-eos", "--print-ids"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out.splitlines()[-1]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == first


def test_cli_generate_errors(capsys):
    assert cli.main(["generate", "--token-ids", "1,x", "--max-tokens", "2"]) == 2
    assert "--token-ids must be comma-separated integers" in capsys.readouterr().err
    assert cli.main(["generate", "--token-ids", "2", "--max-tokens", "100000000"]) == 2
    assert "context length" in capsys.readouterr().err
