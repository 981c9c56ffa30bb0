"""models/demo/tiny.py: presets, the random-model GGUF writer (llama.cpp gemma4 layout), make-model, demo
model."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from swaserve.models.demo.quant_mix import tensor_types
from swaserve.models.demo.tiny import (
    LazyTensors,
    RawTensor,
    add_make_model_args,
    demo_model_path,
    fit_vocab,
    make_model,
    preset_config,
    random_tensors,
    run_make_model,
)
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.models.gemma4_layout import tensor_shapes
from swaserve.models.gguf_loader import load_gguf

# every gemma4.* key that llama.cpp's gemma4 loader reads
GEMMA4_KEYS = [
    "context_length", "embedding_length", "block_count", "feed_forward_length", "expert_feed_forward_length",
    "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.key_length_swa",
    "attention.value_length_swa",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "attention.shared_kv_layers", "embedding_length_per_layer_input", "rope.freq_base", "rope.freq_base_swa",
    "rope.dimension_count", "rope.dimension_count_swa", "final_logit_softcapping",
]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    t0 = time.perf_counter()
    make_model("tiny", str(out), seed=0, progress=False)
    assert time.perf_counter() - t0 < 20  # "builds in seconds"
    return str(out)


def test_tiny_builds_and_loads(tiny_file) -> None:
    m = load_gguf(tiny_file, progress=False)
    cfg = preset_config("tiny")
    assert m.config == cfg
    assert cfg.vocab_size == len(demo_tokenizer_metadata()["tokenizer.ggml.tokens"])
    assert cfg.layer_types == ("sliding",) * 5 + ("full",) and cfg.sliding_window == 64
    assert m.weights.layers[0].q_proj.qtype == "Q4_0"
    assert Path(tiny_file).stat().st_mode & 0o044  # readable by others (not mkstemp's 0600)


def test_file_is_llama_cpp_gemma4_layout(tiny_file) -> None:
    r = gguf.GGUFReader(tiny_file)
    cfg = preset_config("tiny")
    assert r.fields["general.architecture"].contents() == "gemma4"
    for key in GEMMA4_KEYS:
        assert f"gemma4.{key}" in r.fields, key
    f = r.fields["gemma4.attention.head_count_kv"]
    assert f.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32] and f.contents() == [2] * 5 + [1]
    f = r.fields["gemma4.attention.sliding_window_pattern"]
    assert f.types[-1] == gguf.GGUFValueType.BOOL and f.contents() == [True] * 5 + [False]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert key in r.fields
    assert r.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    # names: each one is a gemma4 tensor of gguf-py's table (the names llama.cpp uses)
    templates = [TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GEMMA4]]
    pats = [re.compile(re.escape(t).replace(r"\{bid\}", r"\d+") + r"\.(weight|scale)") for t in templates]
    tensors = {t.name: t for t in r.tensors}
    for name in tensors:
        assert any(p.fullmatch(name) for p in pats), name
    # GGUF shapes (ne order, the reverse of torch) as llama.cpp's gemma4 loader creates them
    h, e, ie = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    ne = {n: t.shape.tolist() for n, t in tensors.items()}
    assert ne["token_embd.weight"] == [h, cfg.vocab_size]
    assert ne["blk.0.attn_q.weight"] == [h, cfg.num_heads * cfg.head_dim_swa]
    assert ne["blk.5.attn_k.weight"] == [h, cfg.num_kv_heads_full * cfg.head_dim_full]
    assert "blk.5.attn_v.weight" not in ne and "blk.4.attn_v.weight" in ne
    assert ne["blk.5.attn_output.weight"] == [cfg.num_heads * cfg.head_dim_full, h]
    assert ne["blk.5.attn_k_norm.weight"] == [cfg.head_dim_full]
    assert ne["blk.0.ffn_gate_up_exps.weight"] == [h, 2 * ie, e]
    assert ne["blk.0.ffn_down_exps.weight"] == [ie, h, e]
    assert ne["blk.0.ffn_gate_inp.weight"] == [h, e] and ne["blk.0.ffn_down_exps.scale"] == [e]
    assert ne["blk.0.layer_output_scale.weight"] == [1]
    assert ne["rope_freqs.weight"] == [cfg.head_dim_full // 2]
    rope = np.asarray(tensors["rope_freqs.weight"].data)
    n_rot = cfg.rope_full_rotated_pairs
    assert np.all(rope[:n_rot] == 1.0) and np.all(rope[n_rot:] == np.float32(1e30))
    types = {n: t.tensor_type.name for n, t in tensors.items()}
    assert types["blk.0.ffn_gate_up_exps.weight"] == "Q4_0" and types["token_embd.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.ffn_gate_inp.weight"] == "F32"


def test_random_weights_not_constant_and_sane() -> None:
    cfg = preset_config("tiny")
    t = random_tensors(cfg, seed=1)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale",
                 "blk.0.post_ffw_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight"):
        assert t[name].std() > 0.05, name
    assert len({float(t[f"blk.{i}.layer_output_scale.weight"][0]) for i in range(6)}) == 6
    q = t["blk.0.attn_q.weight"]
    assert 0.5 < q.std() * cfg.hidden_size**0.5 < 1.5  # fan-in scaled
    assert all(v.dtype == np.float32 for v in t.values())
    again = random_tensors(cfg, seed=1)
    assert all(np.array_equal(again[k], v) for k, v in t.items())
    assert not np.array_equal(random_tensors(cfg, seed=2)["blk.0.attn_q.weight"], q)


def test_deterministic_file(tmp_path, tiny_file) -> None:
    again = make_model("tiny", str(tmp_path / "again.gguf"), seed=0, progress=False)
    assert Path(again).read_bytes() == Path(tiny_file).read_bytes()
    other = make_model("tiny", str(tmp_path / "other.gguf"), seed=1, progress=False)
    assert Path(other).read_bytes() != Path(tiny_file).read_bytes()


def test_26b_a4b_preset_shapes() -> None:
    cfg = preset_config("26b-a4b")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.top_k_experts) == (
        262144, 2816, 30, 128, 8)
    assert cfg.full_layers == [5, 11, 17, 23, 29]
    shapes = tensor_shapes(cfg)
    assert shapes["blk.0.attn_q.weight"] == (16 * 256, 2816)
    assert shapes["blk.5.attn_k.weight"] == (2 * 512, 2816)
    assert shapes["blk.0.ffn_gate_up_exps.weight"] == (128, 1408, 2816)
    assert shapes["blk.0.ffn_down_exps.weight"] == (128, 2816, 704)
    assert shapes["rope_freqs.weight"] == (256,)
    total = sum(int(np.prod(s)) for s in shapes.values())
    experts = sum(int(np.prod(s)) for n, s in shapes.items() if "_exps.weight" in n)
    assert total == pytest.approx(25.2e9, rel=0.01)  # ~25.2B parameters
    assert total - experts * (1 - 8 / 128) == pytest.approx(3.8e9, rel=0.02)  # ~3.8B active
    # the streamed generator makes blocks directly (no fp32 pass), with sane scales
    lazy = LazyTensors(cfg, seed=0, types=tensor_types(shapes, "Q4_0"), raw=True)
    v = lazy["blk.0.ffn_down_exps.weight"]
    assert isinstance(v, RawTensor) and v.qtype == "Q4_0" and v.data.shape == (128, 2816, 704 // 32 * 18)
    d = v.data.reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32)
    assert np.all(np.isfinite(d)) and 0 < d.mean() * 4.6 < 2 / 704**0.5
    assert isinstance(lazy["blk.0.attn_norm.weight"], np.ndarray)
    lazy = LazyTensors(cfg, seed=0, types=tensor_types(shapes, "Q4_K_M"), raw=True)
    v = lazy["blk.3.attn_q.weight"]
    assert v.qtype == "Q4_K" and v.data.shape == (4096, 2816 // 256 * 144)
    vals = gguf.quants.dequantize(v.data[:64], gguf.GGMLQuantizationType.Q4_K)
    assert 0.5 < vals.std() * 2816**0.5 < 2 and abs(vals.mean()) < 0.1 * vals.std()


def test_small_preset_config() -> None:
    cfg = preset_config("small")
    assert cfg.sliding_window == 1024 and cfg.num_layers == 12 and cfg.full_layers == [5, 11]
    shapes = tensor_shapes(cfg)
    for name, s in shapes.items():  # Q4_0 needs the input dim of every matrix to be a multiple of 32
        if len(s) >= 2:
            assert s[-1] % 32 == 0, name


def test_make_model_cli_and_errors(tmp_path, capsys) -> None:
    p = argparse.ArgumentParser()
    add_make_model_args(p)
    out = tmp_path / "sub" / "m.gguf"
    args = p.parse_args(["--preset", "tiny", "--out", str(out), "--seed", "5", "--qtype", "Q8_0"])
    assert run_make_model(args) == 0
    assert str(out) in capsys.readouterr().out
    m = load_gguf(str(out), progress=False)
    assert m.weights.layers[0].q_proj.qtype == "Q8_0"
    assert not [f for f in out.parent.iterdir() if f.name != "m.gguf"]  # no temp file left
    with pytest.raises(SystemExit):
        p.parse_args(["--preset", "huge", "--out", "x"])
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("huge", str(tmp_path / "x.gguf"))


def test_demo_model_path_generated_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path / "cache"))
    path = demo_model_path()
    assert Path(path).parent == tmp_path / "cache" and Path(path).exists()
    mtime = Path(path).stat().st_mtime_ns
    assert demo_model_path() == path and Path(path).stat().st_mtime_ns == mtime  # not regenerated
    assert [f.name for f in (tmp_path / "cache").iterdir()] == [Path(path).name]
    assert load_gguf(path, progress=False).config == preset_config("tiny")


def test_fit_vocab_pads_with_unused_tokens() -> None:
    meta = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.scores": [0.0, 0.0],
            "tokenizer.ggml.token_type": [1, 1]}
    out = fit_vocab(meta, 5)
    assert out["tokenizer.ggml.tokens"] == ["a", "b", "<unused0>", "<unused1>", "<unused2>"]
    assert len(out["tokenizer.ggml.scores"]) == 5 and out["tokenizer.ggml.token_type"][2:] == [3, 3, 3]
    with pytest.raises(ValueError, match="more than"):
        fit_vocab(meta, 1)
