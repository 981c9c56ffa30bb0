"""Parity of our Gemma 4 with transformers' Gemma4ForCausalLM (the oracle) on a tiny random config with
every 26B-A4B feature, going through a GGUF written by our writer and read by our loader, and run
through the paged KV pools with the torch attention backend."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.moe import get_moe_backend
from swaserve.models.demo.tiny import write_gguf
from swaserve.models.gemma4 import Gemma4Model
from swaserve.models.gguf_loader import load_gguf
from tests.models.hf_oracle import (
    PagedRunner,
    build_hf_model,
    gguf_tensors,
    hf_logits,
    load_weights_into_hf,
    model_config,
    tiny_hf_config,
)

WINDOW = 16
TOL = 1e-3
TOKENIZER_META = {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}


def _prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(3, vocab) for _ in range(n - 1)]


class Pair:
    """Our model loaded from a GGUF and the oracle holding exactly the weights the GGUF stores."""

    def __init__(self, tmp_dir, qtype: str):
        hcfg = tiny_hf_config(window=WINDOW)
        source = build_hf_model(hcfg, seed=0)
        path = str(tmp_dir / f"tiny-{qtype}.gguf")
        write_gguf(path, model_config(hcfg), gguf_tensors(source), TOKENIZER_META, qtype=qtype)
        loaded = load_gguf(path, progress=False)
        self.cfg = loaded.config
        assert self.cfg == model_config(hcfg), "the loader's config differs from the oracle's"
        lw = loaded.weights.layers[0]
        assert {lw.q_proj.qtype, lw.experts.gate_up.qtype, loaded.weights.embed.qtype} == {qtype}
        if qtype == "F32":
            self.hf = source
        else:  # transformers given the dequantized weights
            self.hf = build_hf_model(hcfg, seed=0)
            load_weights_into_hf(self.hf, loaded.weights)
        moe = get_moe_backend("torch", self.cfg, loaded.weights.experts, "cpu")
        self.model = Gemma4Model(self.cfg, loaded.weights, TorchAttentionBackend(), moe, "cpu")

    def runner(self, page_size: int, max_len: int = 128, max_seqs: int = 4) -> PagedRunner:
        return PagedRunner(self.model, self.cfg, page_size, max_len, max_seqs)


@pytest.fixture(scope="module", params=["F32", "Q4_0"])
def pair(request, tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("gguf"), request.param)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(pair: Pair, page_size: int) -> None:
    ids = _prompt(45, seed=1)  # longer than the window: sliding masks matter
    ours = pair.runner(page_size).step([(0, ids)])[0]
    ref = hf_logits(pair.hf, ids)
    err = (ours - ref).abs().max().item()
    print(f"prefill max|dlogit| page_size={page_size}: {err:.2e}")
    assert err <= TOL


def test_greedy_decode_matches_transformers(pair: Pair) -> None:
    """32 greedy steps through the KV cache == transformers recomputing the whole sequence."""
    for seed, n, page_size in ((2, 40, 16), (3, 23, 1)):
        ids = _prompt(n, seed)
        run = pair.runner(page_size)
        logits = [run.step([(0, ids)])[0][-1]]
        seq = list(ids)
        for _ in range(32):
            seq.append(int(logits[-1].argmax()))
            logits.append(run.step([(0, seq[-1:])])[0][-1])
        ref = hf_logits(pair.hf, seq)[n - 1:]  # rows predicting seq[n:] and one more
        assert seq[n:] == ref[:-1].argmax(-1).tolist()
        err = (torch.stack(logits) - ref).abs().max().item()
        print(f"decode max|dlogit| prompt={n} page_size={page_size}: {err:.2e}")
        assert err <= TOL


def test_varlen_batch_equals_each_alone(pair: Pair) -> None:
    prompts = [_prompt(n, seed=10 + n) for n in (7, 41, 23)]
    alone = [pair.runner(16).step([(0, p)])[0] for p in prompts]
    run = pair.runner(16)
    batched = run.step([(s, p) for s, p in enumerate(prompts)])
    err = max((a - b).abs().max().item() for a, b in zip(alone, batched))
    print(f"varlen batch vs alone max|dlogit|: {err:.2e}")
    assert err < 1e-4
    # a mixed step: decodes of seqs 0 and 2 next to a new prefill of seq 3 with seq 1 idle
    nxt = [int(b[-1].argmax()) for b in batched]
    new = _prompt(30, seed=99)
    mixed = run.step([(0, [nxt[0]]), (3, new), (2, [nxt[2]])])
    for s, got in ((0, mixed[0]), (2, mixed[2])):
        ref = hf_logits(pair.hf, prompts[s] + [nxt[s]])[-1:]
        assert (got - ref).abs().max().item() <= TOL
    assert (mixed[1] - hf_logits(pair.hf, new)).abs().max().item() <= TOL


@pytest.mark.parametrize("page_size,split", [(16, 19), (1, 30), (16, 32)])
def test_chunked_prefill_equals_one_prefill(pair: Pair, page_size: int, split: int) -> None:
    ids = _prompt(50, seed=5)
    one = pair.runner(page_size).step([(0, ids)])[0]
    run = pair.runner(page_size)
    first = run.step([(0, ids[:split])])[0]
    second = run.step([(0, ids[split:])])[0]
    err = (torch.cat([first, second]) - one).abs().max().item()
    print(f"chunked prefill ({split}+{50 - split}) vs one page_size={page_size} max|dlogit|: {err:.2e}")
    assert err < 1e-4
    tok = int(one[-1].argmax())
    ref = hf_logits(pair.hf, ids + [tok])[-1]
    assert (run.step([(0, [tok])])[0][-1] - ref).abs().max().item() <= TOL
