"""models/gguf_loader.py: writer -> loader round trip, stored forms, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from operator import attrgetter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant.dequant import dequantize
from swaserve.engine.quant.linear import expert_slice, linear
from swaserve.models.demo import tiny_writer
from swaserve.models.demo.tiny import RawTensor, preset_config, random_tensors, write_gguf
from swaserve.models.demo.tokenizer import demo_tokenizer_metadata
from swaserve.models.gguf_loader import GGUFError, load_gguf, read_metadata
from tests.models.hf_oracle import LAYER_FIELDS


@pytest.fixture(scope="module")
def cfg():
    return preset_config("tiny")


@pytest.fixture(scope="module")
def tensors(cfg):
    return random_tensors(cfg, seed=3)


@pytest.fixture(scope="module")
def tok_meta():
    return demo_tokenizer_metadata()


def _write(path: Path, cfg, tensors, tok_meta, qtype: str = "Q4_0") -> str:
    write_gguf(str(path), cfg, tensors, tok_meta, qtype=qtype)
    return str(path)


def _as_tensor(x) -> torch.Tensor:
    return dequantize(x) if hasattr(x, "qtype") else x


def _loaded_by_name(m) -> dict[str, torch.Tensor]:
    out = {"token_embd.weight": dequantize(m.weights.embed), "output_norm.weight": m.weights.final_norm}
    for i, layer in enumerate(m.weights.layers):
        for field, gname in LAYER_FIELDS.items():
            val = attrgetter(field)(layer)
            if val is not None:
                out[f"blk.{i}.{gname}"] = _as_tensor(val)
    return out


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F32", "F16"])
def test_round_trip(tmp_path, cfg, tensors, tok_meta, qtype: str) -> None:
    path = _write(tmp_path / "m.gguf", cfg, tensors, tok_meta, qtype)
    m = load_gguf(path, progress=False)
    assert m.config == cfg  # every config field recovered from metadata (+ rope_freqs)
    assert m.path == path and m.file_size == Path(path).stat().st_size
    assert m.metadata["general.architecture"] == "gemma4"
    assert m.metadata["tokenizer.ggml.tokens"] == list(tok_meta["tokenizer.ggml.tokens"])
    got = _loaded_by_name(m)
    assert set(got) == set(tensors) - {"rope_freqs.weight"}
    for name, t in got.items():
        want = tensors[name]
        assert tuple(t.shape) == want.shape, name
        tq = tiny_writer.tensor_qtype(name, want.shape, qtype)
        if tq == "F32":
            assert torch.equal(t, torch.from_numpy(want)), name  # norms, router, scalars: exact
        else:  # exactly gguf's own quantize -> dequantize of what was written
            ref = quants.dequantize(tiny_writer.encode(want, tq), GGMLQuantizationType[tq])
            assert torch.equal(t, torch.from_numpy(ref.reshape(want.shape))), name
            if tq == "Q4_0":  # and within Q4_0 error of the original: |err| <= amax(block) / 8 (+ fp16 d)
                blocks = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
                err = np.abs(t.numpy().reshape(-1, 32) - want.reshape(-1, 32))
                assert np.all(err <= blocks / 8 * 1.01 + 1e-6), name
    layer = m.weights.layers[0]
    assert layer.q_proj.qtype == (qtype if qtype != "F32" else "F32")
    assert layer.router.dtype == torch.float32 and layer.layer_scalar.shape == (1,)
    assert m.weights.layers[-1].v_proj is None and layer.v_proj is not None  # K = V on the full layer


def test_stored_form_is_a_view_of_the_file(tmp_path, cfg, tensors, tok_meta) -> None:
    path = _write(tmp_path / "m.gguf", cfg, tensors, tok_meta)
    m = load_gguf(path, progress=False)
    raw = Path(path).read_bytes()
    reader = gguf.GGUFReader(path)
    info = {t.name: t for t in reader.tensors}["blk.1.ffn_down_exps.weight"]
    w = m.weights.layers[1].experts.down
    assert w.qtype == "Q4_0" and w.data.dtype == torch.uint8 and w.data.shape == (8, 64, 18)
    assert w.data.numpy().tobytes() == raw[info.data_offset : info.data_offset + info.n_bytes]
    # using it (repack, file pages released) leaves the weight intact
    before = dequantize(w).clone()
    x = torch.randn(3, cfg.moe_intermediate_size)
    for e in range(cfg.num_experts):
        linear(x, expert_slice(w, e))
        linear(x.bfloat16(), expert_slice(w, e))
    assert torch.equal(dequantize(w), before)


def test_separate_gate_up_accepted(tmp_path, cfg, tensors, tok_meta) -> None:
    fused_path = _write(tmp_path / "fused.gguf", cfg, tensors, tok_meta)
    split: dict[str, np.ndarray] = {}
    ie = cfg.moe_intermediate_size
    for name, t in tensors.items():
        if name.endswith("ffn_gate_up_exps.weight"):
            p = name.replace("ffn_gate_up_exps.weight", "")
            split[p + "ffn_gate_exps.weight"] = t[:, :ie]
            split[p + "ffn_up_exps.weight"] = t[:, ie:]
        else:
            split[name] = t
    split_path = _write(tmp_path / "split.gguf", cfg, split, tok_meta)
    names = {t.name for t in gguf.GGUFReader(split_path).tensors}
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.0.ffn_gate_up_exps.weight" not in names
    a, b = load_gguf(fused_path, progress=False), load_gguf(split_path, progress=False)
    for la, lb in zip(a.weights.layers, b.weights.layers):
        assert lb.experts.gate_up.shape == (cfg.num_experts, 2 * ie, cfg.hidden_size)
        assert torch.equal(dequantize(la.experts.gate_up), dequantize(lb.experts.gate_up))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "IQ4_XS"])
def test_every_block_type_kept_in_stored_form(tmp_path, cfg, tensors, tok_meta, qtype: str) -> None:
    """Each block type stays a view of the file's bytes, in every role it fits at tiny geometry (the
    K types need 256-column rows: the full layer's o_proj), and dequantizes exactly as gguf does."""
    from swaserve.models.demo.random_blocks import random_blocks

    rng = np.random.default_rng(0)
    super_block = qtype.endswith("_K") or qtype == "IQ4_XS"
    names = ["blk.5.attn_output.weight"] if super_block else [
        "token_embd.weight", "blk.2.attn_q.weight", "blk.1.ffn_gate_up_exps.weight", "blk.3.ffn_down.weight"]
    t = dict(tensors)
    for name in names:
        t[name] = RawTensor(qtype, random_blocks(qtype, tensors[name].shape, 0.1, rng), tensors[name].shape)
    path = _write(tmp_path / "m.gguf", cfg, t, tok_meta)
    m = load_gguf(path, progress=False)
    raw = Path(path).read_bytes()
    info = {x.name: x for x in gguf.GGUFReader(path).tensors}
    got = _loaded_by_name(m)
    stored = {"token_embd.weight": m.weights.embed, "blk.2.attn_q.weight": m.weights.layers[2].q_proj,
              "blk.1.ffn_gate_up_exps.weight": m.weights.layers[1].experts.gate_up,
              "blk.3.ffn_down.weight": m.weights.layers[3].down_proj,
              "blk.5.attn_output.weight": m.weights.layers[5].o_proj}
    for name in names:
        w, ti = stored[name], info[name]
        assert w.qtype == qtype and w.mmapped and w.data.dtype == torch.uint8, name
        assert w.data.numpy().tobytes() == raw[ti.data_offset:ti.data_offset + ti.n_bytes], name
        want = quants.dequantize(t[name].data, GGMLQuantizationType[qtype]).reshape(tensors[name].shape)
        assert torch.equal(got[name], torch.from_numpy(want)), name


def test_tokenizer_model_llama_with_pre_gemma4_passes_through(tmp_path, cfg, tensors, tok_meta) -> None:
    meta = dict(tok_meta, **{"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "gemma4"})
    m = load_gguf(_write(tmp_path / "m.gguf", cfg, tensors, meta), progress=False)
    assert m.metadata["tokenizer.ggml.model"] == "llama" and m.metadata["tokenizer.ggml.pre"] == "gemma4"


def test_read_metadata_plain_python(tmp_path, cfg, tensors, tok_meta) -> None:
    meta = read_metadata(_write(tmp_path / "m.gguf", cfg, tensors, tok_meta))
    assert meta["gemma4.attention.head_count_kv"] == [2, 2, 2, 2, 2, 1]
    assert meta["gemma4.attention.sliding_window_pattern"] == [True] * 5 + [False]
    assert meta["gemma4.attention.sliding_window"] == 64
    assert meta["gemma4.final_logit_softcapping"] == pytest.approx(30.0)
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert isinstance(meta["tokenizer.chat_template"], str)
    assert all(type(v) in (str, int, float, bool, list) for v in meta.values())


def test_fast_reader_matches_gguf_reader(tmp_path, cfg, tensors, tok_meta) -> None:
    from swaserve.models.gguf_loader import _metadata, _Reader

    path = _write(tmp_path / "m.gguf", cfg, tensors, tok_meta)
    fast, stock = _Reader(path), gguf.GGUFReader(path)
    assert _metadata(fast) == _metadata(stock)
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.tokens", "gemma4.attention.head_count_kv"):
        a, b = fast.fields[key], stock.fields[key]
        assert a.types == b.types and a.contents(slice(2, 5)) == b.contents(slice(2, 5))
    assert [(t.name, t.data_offset, t.tensor_type) for t in fast.tensors] == [
        (t.name, t.data_offset, t.tensor_type) for t in stock.tensors]


# ---- errors: one line, naming the key/tensor and the file ----


def _load_err(path: str) -> str:
    with pytest.raises(GGUFError) as ei:
        load_gguf(path, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg and path in msg
    assert isinstance(ei.value, ValueError)
    return msg


def test_error_missing_tensor(tmp_path, cfg, tensors, tok_meta) -> None:
    t = {k: v for k, v in tensors.items() if k != "blk.2.ffn_down.weight"}
    assert "missing tensor blk.2.ffn_down.weight" in _load_err(_write(tmp_path / "m.gguf", cfg, t, tok_meta))
    t = {k: v for k, v in tensors.items() if k != "blk.4.attn_v.weight"}  # sliding layers need V
    assert "missing tensor blk.4.attn_v.weight" in _load_err(_write(tmp_path / "v.gguf", cfg, t, tok_meta))
    t = {k: v for k, v in tensors.items() if k != "rope_freqs.weight"}
    assert "missing tensor rope_freqs.weight" in _load_err(_write(tmp_path / "r.gguf", cfg, t, tok_meta))
    t = {k: v for k, v in tensors.items() if "blk.3.ffn_gate_up_exps" not in k}
    assert "missing tensor blk.3.ffn_gate_up_exps.weight" in _load_err(
        _write(tmp_path / "e.gguf", cfg, t, tok_meta))


def test_error_wrong_shape(tmp_path, cfg, tensors, tok_meta) -> None:
    t = dict(tensors)
    t["blk.1.attn_q.weight"] = np.zeros((cfg.num_heads * cfg.head_dim_swa + 32, cfg.hidden_size), np.float32)
    msg = _load_err(_write(tmp_path / "m.gguf", cfg, t, tok_meta))
    assert "blk.1.attn_q.weight" in msg and "(160, 64)" in msg and "(128, 64)" in msg
    t = dict(tensors)
    t["blk.0.ffn_down_exps.scale"] = np.ones(cfg.num_experts + 1, np.float32)
    assert "blk.0.ffn_down_exps.scale" in _load_err(_write(tmp_path / "s.gguf", cfg, t, tok_meta))


def test_error_wrong_architecture(tmp_path, cfg, tensors, tok_meta, monkeypatch) -> None:
    monkeypatch.setattr(tiny_writer, "ARCH", "llama")
    msg = _load_err(_write(tmp_path / "m.gguf", cfg, tensors, tok_meta))
    assert "general.architecture" in msg and "'llama'" in msg


def test_error_unsupported_type(tmp_path, cfg, tensors, tok_meta) -> None:
    t = dict(tensors)
    w = tensors["blk.0.attn_k.weight"]
    t["blk.0.attn_k.weight"] = RawTensor("I32", np.zeros(w.shape, np.int32), w.shape)
    msg = _load_err(_write(tmp_path / "m.gguf", cfg, t, tok_meta))
    assert "blk.0.attn_k.weight" in msg and "unsupported type I32" in msg
    # a block type gguf can decode but the engine has no decoder for: refused, not converted
    t = dict(tensors)
    shape = tensors["blk.5.attn_output.weight"].shape  # (64, 256): whole 256-weight blocks
    raw = quants.quantize(np.zeros(shape, np.float32), GGMLQuantizationType.TQ2_0)
    t["blk.5.attn_output.weight"] = RawTensor("TQ2_0", raw, shape)
    msg = _load_err(_write(tmp_path / "tq.gguf", cfg, t, tok_meta))
    assert "blk.5.attn_output.weight" in msg and "unsupported type TQ2_0" in msg


def test_error_missing_key(tmp_path, cfg, tensors, tok_meta, monkeypatch) -> None:
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, v: None)
    msg = _load_err(_write(tmp_path / "m.gguf", cfg, tensors, tok_meta))
    assert "missing metadata key gemma4.attention.sliding_window" in msg


def test_error_not_gguf(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    assert "not a GGUF file" in _load_err(str(bad))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "not a GGUF file" in _load_err(str(empty))
    assert "no such file" in _load_err(str(tmp_path / "missing.gguf"))
    with pytest.raises(GGUFError, match="not a GGUF"):
        read_metadata(str(bad))


def test_error_truncated_file(tmp_path, cfg, tensors, tok_meta) -> None:
    path = _write(tmp_path / "m.gguf", cfg, tensors, tok_meta)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    assert "not a GGUF file" in _load_err(path)


def test_progress_bar(tmp_path, cfg, tensors, tok_meta, capsys) -> None:
    load_gguf(_write(tmp_path / "m.gguf", cfg, tensors, tok_meta), progress=True)
    assert "loading m.gguf" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("qtype,embed_qtype", [("Q4_0", None), ("Q4_0", "Q6_K"), ("Q4_K_M", None),
                                               ("Q5_K_M", None), ("Q6_K", None), ("Q8_0", None)])
def test_small_preset_resident_memory(tmp_path, qtype: str, embed_qtype: str | None) -> None:
    """RSS after loading `small` <= 1.2 x file size + 300 MB (measured in a fresh process), for every
    llama.cpp mix: every matrix stays a view of the file mapping, nothing is converted at load."""
    from swaserve.models.demo.quant_mix import tensor_types
    from swaserve.models.demo.tiny import LazyTensors, fit_vocab
    from swaserve.models.gemma4_layout import tensor_shapes

    cfg = preset_config("small")
    types = tensor_types(tensor_shapes(cfg), qtype, embed_qtype)
    path = str(tmp_path / "small.gguf")
    meta = fit_vocab(demo_tokenizer_metadata(), cfg.vocab_size)
    write_gguf(path, cfg, LazyTensors(cfg, 0, types, raw=True), meta, qtype=qtype, embed_qtype=embed_qtype)
    code = (
        "import psutil, sys; from swaserve.models.gguf_loader import load_gguf; "
        "m = load_gguf(sys.argv[1], progress=False); print(psutil.Process().memory_info().rss, m.file_size)"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
    rss, size = map(int, out.stdout.split())
    print(f"small {qtype} embed {embed_qtype}: file {size / 1e6:.0f} MB, RSS after load {rss / 1e6:.0f} MB")
    assert rss <= 1.2 * size + 300e6, (rss, size)


def test_serve_refuses_an_unsupported_type_with_one_line(tmp_path, cfg, tensors, tok_meta) -> None:
    """`swaserve serve --model` on a file with a TQ2_0 matrix (a ternary type no gemma-4 mix uses):
    exit status 2 and one line naming the tensor and its type, no traceback."""
    t = dict(tensors)
    shape = tensors["blk.5.attn_output.weight"].shape  # (64, 256): whole 256-weight blocks
    raw = np.random.default_rng(0).integers(0, 256, size=(shape[0], 66), dtype=np.uint8)  # 66 B per block
    t["blk.5.attn_output.weight"] = RawTensor("TQ2_0", raw, shape)
    path = _write(tmp_path / "tq2.gguf", cfg, t, tok_meta)
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "swaserve.cli", "serve", "--model", path, "--port", "0"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("swaserve serve: error:") and path in last
    assert "tensor blk.5.attn_output.weight has unsupported type TQ2_0" in last
    assert "Traceback" not in p.stderr
