"""The Gemma 4 vision tower (models/gemma4_vision.py) and its mmproj GGUF (models/mmproj.py).

Oracle: a random transformers Gemma4ForConditionalGeneration (tiny text model; vision tower hidden 64,
2 layers, 2 heads of 32, patch 16, pooling 3, standardize on, clipped linears with finite bounds on
layer 0), its `model.get_image_features(...).pooler_output` on the transformers processor's padded batch:
exactly the rows transformers scatters into inputs_embeds. Ours runs on prepare_image's unpadded patches
with the weights passed through the GGUF name mapping and, for one test, an mmproj file."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from swaserve.models.gemma4_image import prepare_image
from swaserve.models.gemma4_vision import Gemma4Vision, VisionConfig
from swaserve.models.mmproj import (
    hf_state_to_gguf,
    load_mmproj,
    random_vision,
    tiny_vision_config,
    vision_config_from_hf,
    write_mmproj,
)

TEXT_HIDDEN = 48
TOL = 1e-3  # max abs error relative to the reference's max abs value


def _hf_config(num_kv_heads: int = 2) -> Gemma4Config:
    text = dict(vocab_size=300, hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                vocab_size_per_layer_input=300, hidden_size_per_layer_input=8, layer_types=["full_attention"])
    vision = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=num_kv_heads, head_dim=32, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=256, standardize=True, use_clipped_linears=True)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=299,
                        boi_token_id=297, eoi_token_id=298, video_token_id=296, audio_token_id=295,
                        boa_token_id=294, eoa_token_index=293)


def _randomize(model: Gemma4ForConditionalGeneration, seed: int) -> None:
    """Non-trivial weights: norms around 1, std bias/scale, a strong position table, tight clamps on
    layer 0 (they bind for a few percent of the values) and none (+-inf) on layer 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.model.vision_tower.named_parameters():
            if t.dim() == 1:
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
            elif "position_embedding_table" in name:
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
        vt = model.model.vision_tower
        vt.std_bias.copy_(0.5 * torch.randn(vt.std_bias.shape, generator=g))
        vt.std_scale.copy_(1 + 0.3 * torch.randn(vt.std_scale.shape, generator=g))
        for name, buf in vt.encoder.layers[0].named_buffers():
            bound = {"input_min": -2.0, "input_max": 2.0, "output_min": -1.5, "output_max": 1.5}
            for suffix, v in bound.items():
                if name.endswith(suffix):
                    buf.fill_(v)
        w = model.model.embed_vision.embedding_projection.weight
        w.copy_(torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def hf_model() -> Gemma4ForConditionalGeneration:
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(_hf_config()).eval()
    _randomize(model, seed=1)
    return model


def _ours(model: Gemma4ForConditionalGeneration) -> Gemma4Vision:
    vc = model.config.vision_config
    cfg = vision_config_from_hf(vc, TEXT_HIDDEN)
    return Gemma4Vision(cfg, hf_state_to_gguf(model.state_dict(), vc))


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = rng.integers(0, 256, (max(h // 8, 1), max(w // 8, 1), 3), dtype=np.uint8)
    base = Image.fromarray(smooth).resize((w, h), Image.Resampling.BILINEAR)  # some spatial structure
    noise = rng.integers(-20, 21, (h, w, 3))
    return Image.fromarray(np.clip(np.asarray(base, dtype=np.int64) + noise, 0, 255).astype(np.uint8))


def _hf_soft_tokens(model, images: list[Image.Image], max_soft_tokens: int) -> tuple[torch.Tensor, ...]:
    batch = Gemma4ImageProcessorPil()(images=images, return_tensors="pt", max_soft_tokens=max_soft_tokens)
    with torch.no_grad():
        out = model.model.get_image_features(batch["pixel_values"], batch["image_position_ids"])
    return out.pooler_output


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("w,h,budget", [(224, 224, 70), (1000, 300, 140), (20, 30, 70), (1, 2000, 70)])
def test_soft_tokens_match_transformers(hf_model, w: int, h: int, budget: int) -> None:
    img = _image(w, h, seed=w + h)
    (want,) = _hf_soft_tokens(hf_model, [img], budget)
    p = prepare_image(img, max_soft_tokens=budget)
    got = _ours(hf_model).encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
    assert got.dtype == torch.float32 and got.shape == (p.num_soft_tokens, TEXT_HIDDEN) == want.shape
    err = _rel_err(got, want)
    print(f"{w}x{h} budget {budget}: {p.num_soft_tokens} tokens, max abs err / scale {err:.2e}")
    assert err <= TOL
    assert float(want.std(0).mean()) > 0.05  # the rows differ from each other: a non-degenerate check


def test_batch_of_two_with_padding(hf_model) -> None:
    """transformers pads both images to the budget and splits the result; each image's rows are ours."""
    imgs = [_image(300, 200, 7), _image(90, 400, 8)]
    want = _hf_soft_tokens(hf_model, imgs, 140)
    ours = _ours(hf_model)
    for img, ref in zip(imgs, want):
        p = prepare_image(img, max_soft_tokens=140)
        got = ours.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
        assert got.shape == ref.shape and _rel_err(got, ref) <= TOL
    # the padded HF tensors give the same rows (encode drops the (-1, -1) patches)
    batch = Gemma4ImageProcessorPil()(images=imgs[:1], return_tensors="pt", max_soft_tokens=140)
    padded = ours.encode(batch["pixel_values"], batch["image_position_ids"])
    assert _rel_err(padded, want[0]) <= TOL


def test_clamps_matter(hf_model) -> None:
    """The layer-0 clamps bind: dropping them from our weights moves the output well past the tolerance."""
    img = _image(224, 224, 3)
    (want,) = _hf_soft_tokens(hf_model, [img], 70)
    vc = hf_model.config.vision_config
    tensors = {k: v for k, v in hf_state_to_gguf(hf_model.state_dict(), vc).items() if "put_m" not in k}
    p = prepare_image(img, max_soft_tokens=70)
    got = Gemma4Vision(vision_config_from_hf(vc, TEXT_HIDDEN), tensors).encode(
        torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
    assert _rel_err(got, want) > 10 * TOL


def test_grouped_query_heads() -> None:
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(_hf_config(num_kv_heads=1)).eval()
    _randomize(model, seed=2)
    img = _image(400, 250, 11)
    (want,) = _hf_soft_tokens(model, [img], 70)
    p = prepare_image(img, max_soft_tokens=70)
    got = _ours(model).encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
    assert _rel_err(got, want) <= TOL


def test_parity_through_an_mmproj_file(hf_model, tmp_path) -> None:
    vc = hf_model.config.vision_config
    cfg = vision_config_from_hf(vc, TEXT_HIDDEN, max_soft_tokens=70)
    path = tmp_path / "mmproj.gguf"
    write_mmproj(path, cfg, hf_state_to_gguf(hf_model.state_dict(), vc), dtype=np.float32)
    cfg2, tensors = load_mmproj(path)
    assert cfg2 == cfg
    img = _image(500, 375, 4)
    (want,) = _hf_soft_tokens(hf_model, [img], 70)
    p = prepare_image(img, max_soft_tokens=cfg2.max_soft_tokens)
    enc = Gemma4Vision(cfg2, tensors)
    got = enc.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
    assert _rel_err(got, want) <= TOL


# --- mmproj files -------------------------------------------------------------------------------------


def test_round_trip_f32_and_f16(tmp_path) -> None:
    cfg = tiny_vision_config(TEXT_HIDDEN)
    tensors = random_vision(cfg, seed=3)
    tensors["v.blk.0.attn_q.input_max"] = np.array([3.0], dtype=np.float32)
    for dtype, atol in ((np.float32, 0.0), (np.float16, 2e-3)):
        path = tmp_path / f"m-{dtype.__name__}.gguf"
        write_mmproj(path, cfg, tensors, dtype=dtype)
        cfg2, got = load_mmproj(path)
        assert cfg2 == cfg and set(got) == set(tensors)
        for name, arr in tensors.items():
            assert got[name].shape == arr.shape and got[name].dtype == np.float32
            np.testing.assert_allclose(got[name], arr, atol=atol, rtol=1e-3 if atol else 0, err_msg=name)
    r = gguf.GGUFReader(tmp_path / "m-float16.gguf")
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["v.blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["v.position_embd.weight"] == types["v.blk.0.ln1.weight"] == gguf.GGMLQuantizationType.F32
    assert bytes(r.fields["clip.projector_type"].parts[-1]).decode() == "gemma4v"
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "clip"
    # llama.cpp's conv-kernel layout: numpy [D, 3, p, p] is ggml ne [p, p, 3, D]
    patch = next(t for t in r.tensors if t.name == "v.patch_embd.weight")
    assert [int(n) for n in patch.shape] == [16, 16, 3, 64]


def test_random_file_encodes(tmp_path) -> None:
    cfg = tiny_vision_config(TEXT_HIDDEN)
    write_mmproj(tmp_path / "m.gguf", cfg, random_vision(cfg))
    cfg2, tensors = load_mmproj(tmp_path / "m.gguf")
    enc = Gemma4Vision(cfg2, tensors)
    outs = []
    for seed, (w, h) in enumerate([(640, 480), (100, 300)]):
        p = prepare_image(_image(w, h, seed), max_soft_tokens=cfg2.max_soft_tokens)
        out = enc.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))
        assert out.shape == (p.num_soft_tokens, TEXT_HIDDEN) and p.num_soft_tokens <= 64
        assert torch.isfinite(out).all() and 0.1 < float(out.std()) < 10
        outs.append(out)
    assert not torch.allclose(outs[0][:5], outs[1][:5])


def _write_header_only(path, projector: str | None) -> None:
    w = gguf.GGUFWriter(str(path), "clip" if projector else "gemma4")
    if projector:
        w.add_clip_projector_type(projector)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_not_a_gemma4v_file(tmp_path) -> None:
    _write_header_only(tmp_path / "text.gguf", None)
    with pytest.raises(ValueError, match="not an mmproj file.*gemma4"):
        load_mmproj(tmp_path / "text.gguf")
    _write_header_only(tmp_path / "g3.gguf", "gemma3")
    with pytest.raises(ValueError, match="projector type 'gemma3', expected 'gemma4v'"):
        load_mmproj(tmp_path / "g3.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_mmproj(tmp_path / "junk.gguf")


def test_missing_tensor_is_named(tmp_path) -> None:
    cfg = tiny_vision_config(TEXT_HIDDEN)
    tensors = random_vision(cfg)
    with pytest.raises(ValueError, match="missing tensor v.blk.1.ffn_up.weight"):
        write_mmproj(tmp_path / "x.gguf", cfg, {k: v for k, v in tensors.items() if "blk.1.ffn_up" not in k})
    # a file written without it (bypassing the writer's check) fails at load, naming it
    cfg_small = VisionConfig(**{**cfg.__dict__, "num_layers": 1})
    one_layer = {k: v for k, v in tensors.items() if not k.startswith("v.blk.1.")}
    write_mmproj(tmp_path / "one.gguf", cfg_small, one_layer)
    r = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "clip")
    src = gguf.GGUFReader(tmp_path / "one.gguf")
    for f in src.fields.values():
        if f.name.startswith(("clip.", "swaserve.")):
            r.add_key_value(f.name, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    for t in src.tensors:
        if t.name != "v.blk.0.attn_k_norm.weight":
            r.add_tensor(t.name, np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)]))
    r.write_header_to_file()
    r.write_kv_data_to_file()
    r.write_tensors_to_file()
    r.close()
    with pytest.raises(ValueError, match="missing tensor v.blk.0.attn_k_norm.weight"):
        load_mmproj(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="missing tensor v.blk.0.attn_q.weight"):
        Gemma4Vision(cfg_small, {k: v for k, v in tensors.items() if k != "v.blk.0.attn_q.weight"})


def test_bidirectional_attention_setting(hf_model, tmp_path) -> None:
    """The mmproj key round-trips both ways; a gemma4v file without it (llama.cpp's converter writes
    none) is bidirectional, as llama.cpp decodes it; HF conversion follows use_bidirectional_attention."""
    vc = hf_model.config.vision_config
    assert not vision_config_from_hf(vc, TEXT_HIDDEN).bidirectional_attention  # transformers' default
    on = vision_config_from_hf(vc, TEXT_HIDDEN, use_bidirectional_attention="vision")
    assert on.bidirectional_attention
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        vision_config_from_hf(vc, TEXT_HIDDEN, use_bidirectional_attention="all")
    cfg = tiny_vision_config(TEXT_HIDDEN)
    for on in (True, False):
        write_mmproj(tmp_path / f"{on}.gguf", dataclasses.replace(cfg, bidirectional_attention=on),
                     random_vision(cfg))
        assert load_mmproj(tmp_path / f"{on}.gguf")[0].bidirectional_attention is on
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "clip")  # the same file without swaserve's key
    r = gguf.GGUFReader(tmp_path / "False.gguf")
    for name, field in r.fields.items():
        if name.startswith(("clip.", "swaserve.vision.max", "swaserve.vision.rope")):
            val = field.contents()
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(name, val)
            else:
                w.add_key_value(name, val, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(n) for n in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_mmproj(tmp_path / "bare.gguf")[0].bidirectional_attention
