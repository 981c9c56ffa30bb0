"""Encoder work batched and budgeted: a batched forward equals one image at a time, the uncached images of a
step are encoded together (one forward per patch count), and a step with many new images spreads them over
steps under --image-encoder-budget, each image encoded once, every request's output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from swaserve.engine.core import ImageInput, SamplingParams
from swaserve.engine.runner.images import ImageEmbedder
from swaserve.llm import LLM
from swaserve.models.gemma4_image import content_hash, prepare_image
from swaserve.models.gemma4_vision import Gemma4Vision, VisionConfig
from swaserve.models.mmproj import random_vision, tiny_vision_config

BATCH_TOL = 1e-5  # max |batched - single| / max |single|, fp32


def _prepared(seed: int, h: int, w: int, max_soft: int = 64):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return prepare_image(img, patch_size=16, pooling_kernel_size=3, max_soft_tokens=max_soft)


def _input(p, offset: int = 0) -> ImageInput:
    return ImageInput(offset, p.num_soft_tokens, content_hash(p), p.pixel_values, p.position_ids)


@pytest.mark.parametrize("cfg", [tiny_vision_config(32),
                                 VisionConfig(num_layers=2, text_hidden_size=32, max_soft_tokens=64)],
                         ids=["tiny", "768-wide"])
def test_batched_encode_equals_one_at_a_time(cfg: VisionConfig) -> None:
    torch.manual_seed(0)
    tower = Gemma4Vision(cfg, random_vision(cfg, seed=1))
    ims = [_prepared(s, 144, 144) for s in range(4)]
    pairs = [(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids)) for p in ims]
    batched = tower.encode_batch(pairs)
    for (pv, pos), b in zip(pairs, batched):
        one = tower.encode(pv, pos)
        err = float((b - one).abs().max() / one.abs().max())
        print(f"{cfg.hidden_size}-wide: batched vs single max |diff| / max |single| = {err:.2e}")
        assert err < BATCH_TOL
    with pytest.raises(ValueError, match="one patch count"):
        tower.encode_batch([pairs[0], (pairs[0][0][:9], pairs[0][1][:9])])


def test_embedder_groups_by_patch_count_and_isolates_a_bad_image() -> None:
    cfg = tiny_vision_config(32)
    emb = ImageEmbedder(Gemma4Vision(cfg, random_vision(cfg)), torch.device("cpu"), capacity=16, max_batch=8)
    same = [_input(_prepared(s, 144, 144)) for s in range(3)]
    other = _input(_prepared(9, 96, 192))
    bad = ImageInput(0, 3, 12345, same[0].pixel_values, same[0].position_ids)  # wrong span length
    rows, failed = emb.encode_all(same + [other, same[0], bad])
    assert set(failed) == {bad.key} and len(rows) == 4
    # 3 of one shape + the bad one (same shape) in one forward that failed, retried one by one (4), other (1):
    # a failed batch costs its good images a second run
    assert emb.encoder_forwards == 1 + 4 + 1 and emb.encoder_runs == 4 + 4 + 1
    emb2 = ImageEmbedder(emb.encoder, torch.device("cpu"), capacity=16, max_batch=8)
    rows2, _ = emb2.encode_all(same + [other])
    assert emb2.encoder_forwards == 2 and emb2.encoder_runs == 4  # one per patch count
    assert all(torch.equal(rows[k], rows2[k]) for k in rows2)
    emb2.encode_all(same)
    assert emb2.encoder_runs == 4 and emb2.hits == 3


def _prompts(llm: LLM, n: int) -> tuple[list[list[int]], list[list[ImageInput]]]:
    spec = llm.engine.vision_spec
    ids, ims = [], []
    for i in range(n):
        head = llm.encode(f"Picture {i}:")
        p = _prepared(100 + i, 144, 144, spec.max_soft_tokens)
        ids.append(head + [spec.image_token_id] * p.num_soft_tokens + llm.tokenizer.encode(" Describe it.",
                                                                                           add_bos=False))
        ims.append([_input(p, len(head))])
    return ids, ims


def test_many_new_images_spread_over_steps() -> None:
    budget = 2 * 64  # two demo images (64 soft tokens each at 144x144) a step
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    with LLM(image_encoder_budget=budget, chunked_prefill_size=2048) as llm:
        emb = llm.engine.runner.images
        assert emb.max_batch == 1  # the CPU default
        emb.max_batch = 8  # batched as on CUDA
        ids, ims = _prompts(llm, 8)
        assert all(im[0].length == 64 for im in ims)
        per_step: list[int] = []
        encode_all = emb.encode_all

        def counted(images):
            before = emb.encoder_runs
            out = encode_all(images)
            per_step.append(emb.encoder_runs - before)
            return out

        emb.encode_all = counted
        outs = llm.generate(ids, greedy, images=ims)
        assert emb.encoder_runs == 8  # each image once
        assert max(per_step) <= 2 and sum(per_step) == 8, per_step
        assert emb.encoder_forwards == 4  # two images of one patch count a forward
    with LLM(image_encoder_budget=100_000) as ref:  # no spreading, one request at a time
        for i in range(8):
            o = ref.generate(ids[i], greedy, images=[ims[i]])[0]
            assert o.token_ids == outs[i].token_ids
            assert np.allclose([lp.logprob for lp in o.logprobs], [lp.logprob for lp in outs[i].logprobs],
                               atol=1e-4)
