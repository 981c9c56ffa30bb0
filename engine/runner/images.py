"""Image soft tokens for the model runner: the encoder's rows of each image a batch's chunks cover,
encoded once per image content (an LRU keyed by ImageInput.key), placed at the chunk's rows.

The images a step needs that are not cached are encoded before the forward, together: those of one
patch count in one batched forward (`encode_batch`, at most `max_batch` images: 8 on CUDA, 1 on the CPU,
where a batch measured no faster), one forward per patch count. How many a step may start is the
scheduler's (engine/scheduler/encoder_budget.py)."""

from __future__ import annotations

import collections
from typing import Any

import torch

from swaserve.engine.core import Batch, ImageInput


class ImageEmbedder:
    """Runs the image encoder (models/gemma4_vision.py Gemma4Vision.encode / encode_batch) for the images of
    a batch and keeps its outputs by content (`capacity` images, least recently used dropped first): a
    fan-out over one image encodes it once, and a prompt prefilled over several chunks encodes each image
    once."""

    def __init__(self, encoder: Any, device: torch.device, capacity: int = 64, max_batch: int | None = None):
        self.encoder = encoder
        self.device = device
        self.capacity = capacity
        # images a forward: on the CPU batching measured no faster (docs/images.md), so one at a time there
        self.max_batch = max_batch if max_batch is not None else (8 if device.type == "cuda" else 1)
        self._cache: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self.encoder_runs = 0  # images encoded
        self.encoder_forwards = 0  # encoder calls (a batched one counts once)
        self.hits = 0  # images found encoded

    def has(self, im: ImageInput) -> bool:
        """Whether the image's rows are cached (the scheduler's encoder budget asks; no LRU update)."""
        rows = self._cache.get(im.key)
        return rows is not None and rows.shape[0] == im.length

    def _keep(self, key: int, rows: torch.Tensor) -> None:
        if self.capacity > 0:
            self._cache[key] = rows
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def _run(self, group: list[ImageInput]) -> list[torch.Tensor]:
        """fp32 [im.length, H] per image of one patch count: one forward (encode_batch where the encoder
        has it), the outputs checked against the prompt's span lengths."""
        pv = [torch.as_tensor(im.pixel_values, dtype=torch.float32, device=self.device) for im in group]
        pos = [torch.as_tensor(im.position_ids, dtype=torch.int64, device=self.device) for im in group]
        batched = getattr(self.encoder, "encode_batch", None)
        if len(group) > 1 and batched is not None:
            out = batched(list(zip(pv, pos)))  # B x [n_soft, H]
        else:
            out = [self.encoder.encode(pv[0], pos[0])]
        self.encoder_forwards += 1
        self.encoder_runs += len(group)
        for im, rows in zip(group, out):
            if rows.shape[0] != im.length:
                raise ValueError(f"the image encoder gave {rows.shape[0]} soft tokens for an image the "
                                 f"prompt holds {im.length} for")
        return [rows.float() for rows in out]

    def encode_all(self, images: list[ImageInput]) -> tuple[dict[int, torch.Tensor], dict[int, Exception]]:
        """Rows by key of every image given (cached or encoded now, each distinct content once), and the
        keys whose encode failed. Uncached images are grouped by patch count, `max_batch` a forward; a
        failed batch is retried one image at a time so that a bad image fails alone."""
        rows: dict[int, torch.Tensor] = {}
        todo: dict[int, ImageInput] = {}
        for im in images:
            if im.key in rows or im.key in todo:
                continue
            if self.has(im):
                self._cache.move_to_end(im.key)
                self.hits += 1
                rows[im.key] = self._cache[im.key]
            else:
                todo[im.key] = im
        groups: dict[int, list[ImageInput]] = {}
        for im in todo.values():
            groups.setdefault(len(im.pixel_values), []).append(im)
        failed: dict[int, Exception] = {}
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                part = group[i:i + self.max_batch]
                try:
                    done = list(zip(part, self._run(part)))
                except Exception as e:  # noqa: BLE001 - one image's data: a batch is retried image by image
                    if len(part) == 1:
                        failed[part[0].key] = e
                        continue
                    done = self._run_each(part, failed)
                for im, r in done:
                    rows[im.key] = r
                    self._keep(im.key, r)
        return rows, failed

    def _run_each(self, part: list[ImageInput], failed: dict[int, Exception]
                  ) -> list[tuple[ImageInput, torch.Tensor]]:
        """The images of a failed batch one forward each: (image, rows) of those that encode, the others'
        errors into `failed` (a bad image fails its requests alone)."""
        done = []
        for im in part:
            try:
                done.append((im, self._run([im])[0]))
            except Exception as e:  # noqa: BLE001 - this image's data
                failed[im.key] = e
        return done

    def rows_for(self, batch: Batch, failed: dict[Any, Exception]
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat row index [M], rows [M, H]) of the image positions the batch computes, or None. An image
        the encoder cannot take fails its request alone (into `failed`; its rows are left as embedded)."""
        spans: list[tuple[Any, ImageInput, int, int, int]] = []  # (req, image, lo, hi, first flat row)
        start = 0
        for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
            for im in r.images:
                lo, hi = max(im.offset, p), min(im.offset + im.length, p + q)
                if lo < hi:
                    spans.append((r, im, lo, hi, start + lo - p))
            start += q
        if not spans:
            return None
        rows, bad = self.encode_all([s[1] for s in spans])
        idx: list[int] = []
        parts: list[torch.Tensor] = []
        for r, im, lo, hi, row in spans:
            if im.key in bad:
                failed.setdefault(r, bad[im.key])
                continue
            parts.append(rows[im.key][lo - im.offset:hi - im.offset])  # [hi - lo, H]
            idx.extend(range(row, row + hi - lo))
        if not idx:
            return None
        return torch.tensor(idx, dtype=torch.int64, device=self.device), torch.cat(parts)

    def stats(self) -> dict[str, int]:
        return {"image_encoder_runs": self.encoder_runs, "image_encoder_forwards": self.encoder_forwards,
                "image_cache_hits": self.hits, "images_cached": len(self._cache)}
