"""Images in the engine (fake encoder on the demo model): pad ids as cache keys, soft-token rows at the
image positions, prefix reuse across requests sharing an image, encoder runs counted once per image."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from swaserve.engine.core import ImageInput, RequestError, SamplingParams, image_pad_ids
from swaserve.engine.runner.images import ImageEmbedder
from swaserve.llm import LLM

IMAGE_TOKEN = 17  # any id: the engine replaces the span's ids with pad ids


class FakeEncoder:
    """Rows determined by the pixels: [n, H], n = the patches / 4 (pooling 2x2)."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.calls = 0

    def encode(self, pv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g = torch.Generator().manual_seed(int(pv.sum().item() * 1000) % (2**31))
        return torch.randn(pv.shape[0] // 4, self.hidden, generator=g)


def image(seed: int, n: int = 12) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    pv = rng.random((4 * n, 12), dtype=np.float32)
    pos = np.stack(np.meshgrid(np.arange(2 * n), np.arange(2)), -1).reshape(-1, 2)[:4 * n].astype(np.int64)
    return pv, pos, 1000 + seed


def prompt_with(llm: LLM, before: str, img: tuple, after: str) -> tuple[list[int], ImageInput]:
    head = llm.encode(before)
    tail = llm.tokenizer.encode(after, add_bos=False)
    pv, pos, key = img
    n = pv.shape[0] // 4
    ids = head + [IMAGE_TOKEN] * n + tail
    return ids, ImageInput(len(head), n, key, pv, pos)


@pytest.fixture(scope="module")
def llm():
    with LLM(no_mmproj=True, chunked_prefill_size=16) as llm:
        enc = FakeEncoder(llm.engine.model_config.hidden_size)
        llm.engine.scheduler  # noqa: B018
        runner = llm.engine.runner
        runner.images = ImageEmbedder(enc, torch.device("cpu"), capacity=4)
        llm.engine.request_limits = dataclasses.replace(llm.engine.request_limits, images=True)
        yield llm


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_pad_ids_are_keys() -> None:
    a, b = image_pad_ids(5, 40, 300), image_pad_ids(6, 40, 300)
    assert len(a) == 40 and min(a) >= 300 and a == image_pad_ids(5, 40, 300)
    assert a[0] != b[0] and len(set(a)) == 40


def test_shared_image_is_reused_a_different_one_is_not(llm: LLM) -> None:
    text = "The picture below shows a small model."
    ids1, im1 = prompt_with(llm, text, image(1), " What is in it?")
    ids2, im2 = prompt_with(llm, text, image(1), " Which colours are there?")
    ids3, im3 = prompt_with(llm, text, image(2), " What is in it?")
    runs = llm.engine.runner.images.encoder_runs
    o1 = llm.generate(ids1, greedy(), images=[[im1]])[0]
    o2 = llm.generate(ids2, greedy(), images=[[im2]])[0]
    assert llm.engine.runner.images.encoder_runs == runs + 1  # the second request found it encoded
    page = 16
    assert o2.cached_tokens >= (im2.offset + im2.length) // page * page  # the image's span reused
    o3 = llm.generate(ids3, greedy(), images=[[im3]])[0]
    assert o3.cached_tokens <= im3.offset  # a different image: no reuse past the text before it
    assert o1.token_ids and o3.token_ids


def test_image_rows_change_the_output_and_cached_equals_fresh(llm: LLM) -> None:
    ids, im = prompt_with(llm, "Look:", image(3, n=20), " Describe the image in one line.")
    warm = llm.generate(ids, greedy(8), images=[[im]])[0]
    again = llm.generate(ids, greedy(8), images=[[im]])[0]  # served from the cache
    assert again.cached_tokens > im.offset + im.length - 16
    assert again.token_ids == warm.token_ids
    with LLM(no_mmproj=True, cache_type="naive", chunked_prefill_size=7) as fresh:  # other chunk edges
        fresh.engine.runner.images = ImageEmbedder(FakeEncoder(fresh.engine.model_config.hidden_size),
                                                   torch.device("cpu"))
        fresh.engine.request_limits = dataclasses.replace(fresh.engine.request_limits, images=True)
        cold = fresh.generate(ids, greedy(8), images=[[im]])[0]
        assert cold.cached_tokens == 0 and cold.token_ids == warm.token_ids
        other = dataclasses.replace(im, key=im.key + 1, pixel_values=im.pixel_values + 0.5)
        changed = fresh.generate(ids, greedy(8), images=[[other]])[0]
        assert changed.token_ids != warm.token_ids  # the rows reach the model


def test_bad_spans_and_no_encoder_are_request_errors(llm: LLM) -> None:
    ids, im = prompt_with(llm, "x", image(4), " y")
    with pytest.raises(RequestError, match="not in order"):
        llm.engine.make_requests("bad1", ids, greedy(), images=[dataclasses.replace(im, offset=len(ids))])
    with pytest.raises(RequestError, match="prompt_logprobs"):
        llm.engine.make_requests("bad2", ids, SamplingParams(max_tokens=2, prompt_logprobs=1), images=[im])
    with LLM(no_mmproj=True) as text_only:
        with pytest.raises(RequestError, match="--mmproj"):
            text_only.engine.make_requests("bad3", ids, greedy(), images=[im])


def _with_encoder(llm: LLM, bidirectional: bool) -> LLM:
    enc = FakeEncoder(llm.engine.model_config.hidden_size)
    llm.engine.runner.images = ImageEmbedder(enc, torch.device("cpu"))
    llm.engine.request_limits = dataclasses.replace(llm.engine.request_limits, images=True)
    llm.engine.bidirectional_images = bidirectional  # what a gemma4v mmproj sets (VisionSpec)
    return llm


def test_demo_encoder_is_bidirectional() -> None:
    with LLM() as demo:  # the demo model's own gemma4v mmproj: bidirectional, as llama.cpp decodes gemma4v
        assert demo.engine.vision_spec is not None and demo.engine.bidirectional_images
    with LLM(no_mmproj=True) as text_only:
        assert not text_only.engine.bidirectional_images


def test_bidirectional_images_cached_equals_scratch() -> None:
    """Bidirectional image attention through the scheduler and the radix cache: chunks of 16 around a
    20-token image, then a second question on the same image whose prefix hit ends inside it, equal to
    naive runs at chunks of 7 (token ids, and each token's logprob); the causal answer differs."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    with _with_encoder(LLM(no_mmproj=True, chunked_prefill_size=16), True) as radix, \
            _with_encoder(LLM(no_mmproj=True, cache_type="naive", chunked_prefill_size=7), True) as scratch, \
            _with_encoder(LLM(no_mmproj=True, cache_type="naive", chunked_prefill_size=7), False) as causal:
        ids1, im = prompt_with(radix, "Look:", image(5, n=20), " Describe the image in one line.")
        ids2, _ = prompt_with(radix, "Look:", image(5, n=20), " Which colours are in it?")
        assert ids1[im.offset + im.length] != ids2[im.offset + im.length]
        a1 = radix.generate(ids1, params, images=[[im]])[0]
        a2 = radix.generate(ids2, params, images=[[im]])[0]
        assert im.offset < a2.cached_tokens < im.offset + im.length  # the hit ends inside the image
        for got, ids in ((a1, ids1), (a2, ids2)):
            want = scratch.generate(ids, params, images=[[im]])[0]
            assert want.cached_tokens == 0 and got.token_ids == want.token_ids
            err = max(abs(x.logprob - y.logprob) for x, y in zip(got.logprobs, want.logprobs))
            print(f"cached {got.cached_tokens}: max |dlogprob| vs scratch {err:.2e}")
            assert err <= 1e-3, err
        c1 = causal.generate(ids1, params, images=[[im]])[0]
        print(f"causal vs bidirectional: first logprob {c1.logprobs[0].logprob:.4f} vs "
              f"{a1.logprobs[0].logprob:.4f}, tokens {c1.token_ids} vs {a1.token_ids}")
        assert abs(c1.logprobs[0].logprob - a1.logprobs[0].logprob) > 1e-3 or c1.token_ids != a1.token_ids
