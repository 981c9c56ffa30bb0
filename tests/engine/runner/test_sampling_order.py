"""The order of the sampling filters, top-k -> top-p -> min-p, pinned by cases where the order changes the
tokens that can be drawn (each filter alone is checked against brute force in test_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from swaserve.engine.core import SamplingParams
from swaserve.engine.runner.sampling import SampleRow, make_generator, sample


@pytest.mark.parametrize("top_k,top_p,min_p,kept", [
    # top-k first: renormalised over {0, 1} token 0 has 0.625 >= 0.6, so top-p keeps it alone
    # (top-p first: 0.5 < 0.6 before token 1, so {0, 1})
    (2, 0.6, 0.0, {0}),
    # top-p first: 0.7 < 0.75 before token 2 keeps {0, 1, 2}, and min-p 0.4 (p >= 0.16) keeps them
    # (min-p first keeps {0, 1, 2}, renormalised 0.778 >= 0.75 before token 2: top-p then drops it)
    (-1, 0.75, 0.4, {0, 1, 2}),
    (4, 0.75, 0.4, {0, 1, 2}),
])
@pytest.mark.parametrize("path", ["candidates", "full"])
def test_filter_order_top_k_then_top_p_then_min_p(top_k, top_p, min_p, kept, path):
    """Cases where the order of the filters changes the tokens that can be drawn: 100 seeded draws give
    exactly the set that top-k, then top-p, then min-p keeps (each over the renormalised survivors)."""
    probs = [0.5, 0.3, 0.1, 0.1, 1e-9] if top_k == 2 else [0.4, 0.3, 0.2, 0.1, 1e-9]
    x = torch.log(torch.tensor([probs]))
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    seen = set()
    for s in range(100):
        rows = [SampleRow(params, make_generator(s))]
        if path == "full":  # a row without top-k in the batch: every row is filtered over the vocabulary
            rows.append(SampleRow(SamplingParams(temperature=1.0), make_generator(10_000 + s)))
        seen.add(sample(x.expand(len(rows), -1), rows).token_ids[0])
    assert seen == kept
