"""Image soft tokens for the model runner: the encoder's rows of each image a batch's chunks cover,
encoded once per image content (an LRU keyed by ImageInput.key), placed at the chunk's rows."""

from __future__ import annotations

import collections
from typing import Any

import torch

from swaserve.engine.core import Batch


class ImageEmbedder:
    """Runs the image encoder (models/gemma4_vision.py Gemma4Vision.encode) for the images of a batch and
    keeps its outputs by content (`capacity` images, least recently used dropped first): a fan-out over
    one image encodes it once, and a prompt prefilled over several chunks encodes each image once."""

    def __init__(self, encoder: Any, device: torch.device, capacity: int = 64):
        self.encoder = encoder
        self.device = device
        self.capacity = capacity
        self._cache: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self.encoder_runs = 0  # images encoded
        self.hits = 0  # images found encoded

    def features(self, im: Any) -> torch.Tensor:
        """fp32 [im.length, H]: the image's soft-token rows, from the cache or encoded now."""
        rows = self._cache.get(im.key)
        if rows is not None and rows.shape[0] == im.length:
            self._cache.move_to_end(im.key)
            self.hits += 1
            return rows
        pv = torch.as_tensor(im.pixel_values, dtype=torch.float32, device=self.device)  # [P, 3 * ps * ps]
        pos = torch.as_tensor(im.position_ids, dtype=torch.int64, device=self.device)  # [P, 2]
        rows = self.encoder.encode(pv, pos).float()  # [n_soft, H]
        self.encoder_runs += 1
        if rows.shape[0] != im.length:
            raise ValueError(f"the image encoder gave {rows.shape[0]} soft tokens for an image the prompt "
                             f"holds {im.length} for")
        if self.capacity > 0:
            self._cache[im.key] = rows
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return rows

    def rows_for(self, batch: Batch, failed: dict[Any, Exception]
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat row index [M], rows [M, H]) of the image positions the batch computes, or None. An image
        the encoder cannot take fails its request alone (into `failed`; its rows are left as embedded)."""
        idx: list[int] = []
        parts: list[torch.Tensor] = []
        start = 0
        for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
            for im in r.images:
                lo, hi = max(im.offset, p), min(im.offset + im.length, p + q)
                if lo < hi:
                    try:
                        rows = self.features(im)
                    except Exception as e:  # noqa: BLE001 - this request's image: it fails alone
                        failed.setdefault(r, e)
                        continue
                    parts.append(rows[lo - im.offset:hi - im.offset])  # [hi - lo, H]
                    idx.extend(range(start + lo - p, start + hi - p))
            start += q
        if not idx:
            return None
        return torch.tensor(idx, dtype=torch.int64, device=self.device), torch.cat(parts)

    def stats(self) -> dict[str, int]:
        return {"image_encoder_runs": self.encoder_runs, "image_cache_hits": self.hits,
                "images_cached": len(self._cache)}
