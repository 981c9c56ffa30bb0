"""Gemma 4 image preprocessing (models/gemma4_image.py) against transformers' Gemma4ImageProcessor (PIL
backend; torchvision is not installed, so that is the processor transformers picks) and Gemma4Processor's
placeholder count. Our arrays hold only the image's patches; the processor's padding rows (zero pixels,
position (-1, -1)) are checked to be exactly that, and the vision tests show they do not change the
encoder's output."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

from swaserve.models.gemma4_image import (
    PreparedImage,
    content_hash,
    num_soft_tokens_for,
    prepare_image,
    target_size,
)

SIZES = [(20, 30), (224, 224), (1000, 300), (1, 2000), (2000, 1), (640, 480), (37, 1999)]  # (width, height)


def _random_image(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _check_against_hf(img: Image.Image, max_soft_tokens: int = 280) -> PreparedImage:
    ref = Gemma4ImageProcessorPil()(images=[img], return_tensors="np", max_soft_tokens=max_soft_tokens)
    got = prepare_image(img, max_soft_tokens=max_soft_tokens)
    n = got.pixel_values.shape[0]
    pv, pos = ref["pixel_values"][0], ref["image_position_ids"][0]
    assert got.pixel_values.dtype == np.float32 and got.position_ids.dtype == np.int64
    assert got.pixel_values.shape == (n, 768) and got.position_ids.shape == (n, 2)
    np.testing.assert_allclose(got.pixel_values, pv[:n], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got.position_ids, pos[:n])
    assert (pos[n:] == -1).all() and (pv[n:] == 0).all()  # the rest is the processor's padding
    assert got.num_soft_tokens == ref["num_soft_tokens_per_image"][0] == n // 9
    return got


@pytest.mark.parametrize("w,h", SIZES)
def test_pixels_positions_and_count_match_transformers(w: int, h: int) -> None:
    _check_against_hf(_random_image(w, h))


def test_smaller_budget() -> None:
    got = _check_against_hf(_random_image(333, 500, seed=3), max_soft_tokens=70)
    assert got.num_soft_tokens <= 70


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "PA", "L", "CMYK", "1", "I;16"])
def test_every_mode_converts_like_transformers(mode: str) -> None:
    rng = np.random.default_rng(1)
    base = Image.fromarray(rng.integers(0, 256, (70, 90, 4), dtype=np.uint8), "RGBA")
    img = base.convert(mode) if mode not in ("P", "PA") else base.convert("RGB").convert(mode)
    _check_against_hf(img)


def test_palette_with_transparency_is_composited_on_white() -> None:
    img = Image.new("P", (48, 48), 0)
    img.putpalette([10, 20, 30] + [200, 0, 0] * 255)
    img.info["transparency"] = 0  # palette entry 0 is transparent: the whole image is white
    got = _check_against_hf(img)
    assert np.all(got.pixel_values == 1.0)


def test_count_equals_what_the_processor_inserts() -> None:
    """Gemma4Processor's placeholder expansion and its size-only count, run on stand-ins for the parts a
    real processor needs a tokenizer for."""
    ip = Gemma4ImageProcessorPil()
    stub = SimpleNamespace(
        image_processor=ip, boi_token="<boi>", eoi_token="<eoi>", image_token="<img>",
        _merge_kwargs=lambda **kw: {"images_kwargs": {}},
    )
    sizes = [(h, w) for w, h in SIZES]
    counts = Gemma4Processor._get_num_multimodal_tokens(stub, image_sizes=sizes)["num_image_tokens"]
    for (w, h), n in zip(SIZES, counts):
        img = _random_image(w, h)
        inputs = ip(images=[img], return_tensors="np")
        text = Gemma4Processor.replace_image_token(stub, inputs, 0)
        assert text.count("<img>") == n == prepare_image(img).num_soft_tokens == num_soft_tokens_for(h, w)


def test_already_sized_image_is_not_resized() -> None:
    th, tw = target_size(480, 640)
    img = _random_image(tw, th, seed=5)
    got = _check_against_hf(img)
    first = (np.asarray(img)[:16, :16] / 255).astype(np.float32)  # [16, 16, 3]
    np.testing.assert_array_equal(got.pixel_values[0].reshape(16, 16, 3), first)


def test_content_hash() -> None:
    a, b = prepare_image(_random_image(100, 80, 0)), prepare_image(_random_image(100, 80, 0))
    c = prepare_image(_random_image(100, 80, 1))
    assert content_hash(a) == content_hash(b) != content_hash(c)
    assert -(2**63) <= content_hash(a) < 2**63 and isinstance(content_hash(a), int)
    moved = PreparedImage(a.pixel_values, a.position_ids[::-1].copy(), a.num_soft_tokens)
    assert content_hash(moved) != content_hash(a)


def test_zero_sized_resize_is_refused() -> None:
    with pytest.raises(ValueError):
        target_size(0, 10)
