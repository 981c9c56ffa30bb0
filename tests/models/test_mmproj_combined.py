"""A combined GGUF (the text model with the vision tower's keys and tensors inside, models/mmproj.py
combine_gguf): loaded with no --mmproj, it gives the same image features and logprobs as the model plus its
separate mmproj; --mmproj wins over it, --no-mmproj disables it."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

from swaserve.engine.core import ImageInput, SamplingParams
from swaserve.llm import LLM
from swaserve.models.demo.tiny import add_make_model_args, make_mmproj, make_model, run_make_model
from swaserve.models.gemma4_image import content_hash, prepare_image
from swaserve.models.gguf_loader import read_metadata
from swaserve.models.mmproj import combine_gguf, has_vision, load_mmproj


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("combined")
    model, mm, both = str(d / "m.gguf"), str(d / "m.mmproj.gguf"), str(d / "both.gguf")
    make_model("tiny", model, seed=3, progress=False)
    make_mmproj("tiny", mm, seed=4)
    combine_gguf(model, mm, both)
    return model, mm, both


def _image(llm: LLM) -> tuple[list[int], ImageInput]:
    spec = llm.engine.vision_spec
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (96, 144, 3), dtype=np.uint8))
    p = prepare_image(img, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                      max_soft_tokens=spec.max_soft_tokens)
    head = llm.encode("Look at this:")
    tail = llm.tokenizer.encode(" What is it?", add_bos=False)
    ids = head + [spec.image_token_id] * p.num_soft_tokens + tail
    return ids, ImageInput(len(head), p.num_soft_tokens, content_hash(p), p.pixel_values, p.position_ids)


def _run(llm: LLM) -> tuple[torch.Tensor, list[int], list[float]]:
    ids, im = _image(llm)
    feats = llm.engine.runner.images.encoder.encode(torch.as_tensor(im.pixel_values),
                                                    torch.as_tensor(im.position_ids))
    out = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), images=[[im]])[0]
    return feats, out.token_ids, [lp.logprob for lp in out.logprobs]


def test_combined_file_reads_as_the_mmproj(files) -> None:
    model, mm, both = files
    assert has_vision(read_metadata(both)) and not has_vision(read_metadata(model))
    (c1, t1), (c2, t2) = load_mmproj(mm), load_mmproj(both)
    assert c1 == c2 and t1.keys() == t2.keys()
    assert all(np.array_equal(t1[k], t2[k]) for k in t1)
    meta_model, meta_both = read_metadata(model), read_metadata(both)
    vision_keys = ("clip.", "swaserve.vision.")
    assert {k: v for k, v in meta_both.items() if not k.startswith(vision_keys)} == meta_model


def test_combined_file_serves_images_like_model_plus_mmproj(files) -> None:
    model, mm, both = files
    with LLM(model, mmproj=mm) as a:
        fa, ta, la = _run(a)
    with LLM(both) as b:
        assert b.engine.vision_spec is not None  # no --mmproj: the tower came from the model file
        fb, tb, lb = _run(b)
    assert torch.equal(fa, fb)  # the same stored bytes: bit-equal features
    assert ta == tb and np.allclose(la, lb, atol=0, rtol=0)


def test_explicit_mmproj_wins_and_no_mmproj_disables(files, tmp_path) -> None:
    _, _, both = files
    other = make_mmproj("tiny", str(tmp_path / "other.mmproj.gguf"), seed=9)
    with LLM(both, mmproj=other) as llm:
        w = llm.engine.runner.images.encoder.proj_w
        assert torch.equal(w, torch.from_numpy(load_mmproj(other)[1]["mm.input_projection.weight"]))
    with LLM(both, no_mmproj=True) as llm:
        assert llm.engine.vision_spec is None and llm.engine.runner.images is None


def test_make_model_vision_into_main(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_make_model_args(p)
    out = tmp_path / "one.gguf"
    assert run_make_model(p.parse_args(["--out", str(out), "--vision", "--vision-into-main"])) == 0
    assert has_vision(read_metadata(str(out))) and not (tmp_path / "one.mmproj.gguf").exists()
    load_mmproj(out)
    with pytest.raises(ValueError, match="needs --vision"):
        run_make_model(p.parse_args(["--out", str(tmp_path / "x.gguf"), "--vision-into-main"]))
