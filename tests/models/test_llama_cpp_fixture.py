"""swaserve's GGUF writer and loader checked against llama.cpp, not only against each other (and gguf-py).

tests/data/tiny-llamacpp-q4_0.gguf was written by llama.cpp's quantizer (`python -m
tools.models.llama_cpp_fixture`)
from the `tiny` preset (seed 0) written in F32 by swaserve: llama.cpp's GGUF writer laid it out, and its
Q4_0 / Q8_0 blocks (it keeps some tensors at Q8_0: K/V projections, the token embedding whose rows are
too short for Q6_K) come from llama.cpp's C quantizer. The first tests need nothing but the fixture; the
last runs llama.cpp itself and skips without it (llama_cpp importable, or $SWASERVE_LLAMA_CPP_PYTHON =
an interpreter that imports it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from swaserve.engine.core import SamplingParams
from swaserve.engine.quant.dequant import dequantize
from swaserve.llm import LLM
from swaserve.models.demo.tiny import make_model
from swaserve.models.gguf_loader import load_gguf

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "tiny-llamacpp-q4_0.gguf"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for q in ("F32", "Q4_0"):
        out[q] = d / f"tiny-{q}.gguf"
        make_model("tiny", str(out[q]), seed=0, progress=False, qtype=q)
    return out


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_llama_cpp_quantizer_gives_the_bytes_swaserve_writes(sources) -> None:
    """Every tensor llama.cpp quantized holds exactly the blocks gguf-py's quantizer makes from the F32
    source, and those swaserve's own Q4_0 file holds where both chose Q4_0."""
    ll, f32, ours = _tensors(FIXTURE), _tensors(sources["F32"]), _tensors(sources["Q4_0"])
    assert set(ll) == set(f32) == set(ours)
    kinds = {}
    for name, t in ll.items():
        kind = t.tensor_type.name
        kinds[kind] = kinds.get(kind, 0) + 1
        src = np.asarray(f32[name].data, dtype=np.float32)
        if kind == "F32":
            assert np.array_equal(np.asarray(t.data), src), name
            continue
        want = gguf.quants.quantize(src, t.tensor_type)
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(want.shape), want), name
        if ours[name].tensor_type == t.tensor_type:
            assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data)), name
    assert kinds == {"F32": 80, "Q8_0": 12, "Q4_0": 42}, kinds


def test_loader_reads_the_llama_cpp_file(sources) -> None:
    """swaserve's loader on llama.cpp's layout: the same config as from its own file, every weight equal
    to gguf-py's dequantization of the fixture's blocks."""
    ll, own = load_gguf(str(FIXTURE), progress=False), load_gguf(str(sources["F32"]), progress=False)
    assert ll.config == own.config
    assert ll.metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    raw = _tensors(FIXTURE)
    t = raw["token_embd.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    assert torch.equal(dequantize(ll.weights.embed), want)
    for i, layer in enumerate(ll.weights.layers):
        for field, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                            ("o_proj", "attn_output"), ("down_proj", "ffn_down")):
            w = getattr(layer, field)
            if w is None:
                continue
            t = raw[f"blk.{i}.{name}.weight"]
            assert w.qtype == t.tensor_type.name, (i, name)
            want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            assert torch.equal(dequantize(w), want), (i, name)


def test_engine_serves_the_llama_cpp_file() -> None:
    llm = LLM(str(FIXTURE), cpu_matmul="exact")
    (o,) = llm.generate([[2] + list(range(100, 140))], SamplingParams(max_tokens=6, temperature=0.0,
                                                                      ignore_eos=True))
    assert len(o.token_ids) == 6 and all(0 <= t < llm.tokenizer.vocab_size for t in o.token_ids)


def _llama_python() -> str | None:
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return os.environ.get("SWASERVE_LLAMA_CPP_PYTHON") or None


LLAMA_GREEDY = """
import json, sys
import numpy as np
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, logits_all=True, verbose=False, n_threads=1)
toks, out = json.loads(sys.argv[2]), []
llm.eval(toks)
for _ in range(int(sys.argv[3])):
    sc = np.asarray(llm.scores[len(toks) - 1], dtype=np.float64)
    lp = sc - sc.max()
    lp -= np.log(np.exp(lp).sum())
    t = int(np.argmax(sc))
    out.append([t, np.sort(lp)[::-1][:5].tolist()])
    toks.append(t)
    llm.eval([t])
print(json.dumps(out))
"""


def test_llama_cpp_and_swaserve_agree_on_a_make_model_file(sources) -> None:
    """llama.cpp's own Gemma 4 forward on a file swaserve wrote: the same greedy tokens and top-5
    log-probabilities within 0.05 (F32 weights: llama.cpp quantizes no activation, so what is left is
    summation order; the random presets amplify any activation quantization ~2.5x per layer, which is
    why quantized files are not compared this way)."""
    py = _llama_python()
    if py is None:
        pytest.skip("llama_cpp is not importable and $SWASERVE_LLAMA_CPP_PYTHON is not set")
    prompt = [2] + list(range(100, 140))
    run = subprocess.run([py, "-c", LLAMA_GREEDY, str(sources["F32"]), json.dumps(prompt), "6"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ref = json.loads(run.stdout.strip().splitlines()[-1])
    (o,) = LLM(str(sources["F32"]), cpu_matmul="exact").generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True))
    assert o.token_ids == [t for t, _ in ref]
    for lp, (_, top) in zip(o.logprobs, ref):
        assert [v for _, v in lp.top] == pytest.approx(top, abs=0.05)
