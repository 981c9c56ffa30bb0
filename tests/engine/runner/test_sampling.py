"""Sampling vs brute-force reference implementations (pure Python loops over one row)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from swaserve.engine.core import SamplingParams
from swaserve.engine.runner.sampling import (
    SampleRow,
    apply_penalties,
    apply_token_bitmask,
    make_generator,
    min_p_mask,
    sample,
    top_k_mask,
    top_p_mask,
    unpack_bitmask,
    unpack_bitmask_torch,
)

NEG = float("-inf")


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(v - m) if v != NEG else 0.0 for v in row]
    s = sum(e)
    return [v / s for v in e]


def ref_top_k(row: list[float], k: int) -> list[float]:
    if k <= 0 or k >= len(row):
        return row
    kth = sorted(row, reverse=True)[k - 1]
    return [v if v >= kth else NEG for v in row]


def ref_top_p(row: list[float], p: float) -> list[float]:
    probs = _softmax(row)
    order = sorted(range(len(row)), key=lambda i: (-probs[i], i))
    keep, mass = set(), 0.0
    for i in order:
        if keep and mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return [v if i in keep else NEG for i, v in enumerate(row)]


def ref_min_p(row: list[float], mp: float) -> list[float]:
    probs = _softmax(row)
    t = max(probs) * mp
    return [v if probs[i] >= t else NEG for i, v in enumerate(row)]


def ref_penalties(row, prompt, output, rep, freq, pres, bias):
    row = list(row)
    seen = set(prompt) | set(output)
    for t in seen:
        if rep != 1.0:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        c = output.count(t)
        row[t] -= freq * c + pres
    for t, b in bias:
        row[t] += b
    return row


def _close(a: list[float], b: list[float]) -> bool:
    return all((x == y == NEG) or (x != NEG and y != NEG and abs(x - y) < 1e-4) for x, y in zip(a, b))


def _rand_logits(rng: random.Random, B: int, V: int, ties: bool = False) -> torch.Tensor:
    if ties:  # few distinct values -> many ties at the cut points
        return torch.tensor([[float(rng.randint(-3, 3)) for _ in range(V)] for _ in range(B)])
    return torch.tensor([[rng.gauss(0, 2) for _ in range(V)] for _ in range(B)])


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_min_p_match_reference(ties):
    rng = random.Random(1)
    for trial in range(30):
        B, V = rng.randint(1, 6), rng.randint(2, 40)
        x = _rand_logits(rng, B, V, ties)
        ks = [rng.choice([-1, 1, 2, 3, V - 1, V, V + 5]) for _ in range(B)]
        ps = [rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6]) for _ in range(B)]
        mps = [rng.choice([0.0, 0.05, 0.3, 0.9, 1.0]) for _ in range(B)]
        got_k = top_k_mask(x, torch.tensor(ks)).tolist()
        got_p = top_p_mask(x, torch.tensor(ps)).tolist()
        got_m = min_p_mask(x, torch.tensor(mps)).tolist()
        for b in range(B):
            row = x[b].tolist()
            assert _close(got_k[b], ref_top_k(row, ks[b])), (trial, b, ks[b])
            assert _close(got_p[b], ref_top_p(row, ps[b])), (trial, b, ps[b])
            assert _close(got_m[b], ref_min_p(row, mps[b])), (trial, b, mps[b])


def test_penalties_match_reference():
    rng = random.Random(2)
    for _ in range(30):
        B, V = rng.randint(1, 5), rng.randint(3, 30)
        x = _rand_logits(rng, B, V)
        rows, refs = [], []
        for b in range(B):
            prompt = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
            output = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
            rep = rng.choice([1.0, 1.3, 0.7])
            freq = rng.choice([0.0, 0.5, -1.0])
            pres = rng.choice([0.0, 1.5, -0.5])
            bias = tuple((rng.randrange(V), rng.uniform(-5, 5)) for _ in range(rng.randint(0, 3)))
            bias = tuple({t: (t, v) for t, v in bias}.values())  # unique ids
            params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                                    logit_bias=bias)
            rows.append(SampleRow(params, None, prompt, output))
            refs.append(ref_penalties(x[b].tolist(), prompt, output, rep, freq, pres, bias))
        got = apply_penalties(x.clone(), rows).tolist()
        for b in range(B):
            assert _close(got[b], refs[b])


def test_greedy_is_argmax_after_penalties():
    x = torch.tensor([[1.0, 5.0, 4.9, 0.0], [3.0, 3.0, 1.0, 0.0]])
    rows = [
        SampleRow(SamplingParams(temperature=0.0, presence_penalty=1.0), None, (), (1,)),
        SampleRow(SamplingParams(temperature=0.0), None),  # tie -> first index
    ]
    assert sample(x, rows).token_ids == [2, 0]


def test_seed_gives_same_tokens_whatever_the_batch():
    V = 50
    rng = random.Random(3)
    target = torch.tensor([rng.gauss(0, 1) for _ in range(V)])
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234)

    def run(batch_size: int, pos: int) -> list[int]:
        g = make_generator(1234)
        others = [make_generator(rng.randrange(1 << 30)) for _ in range(batch_size)]
        toks = []
        for _ in range(20):
            x = torch.randn(batch_size, V)
            x[pos] = target
            noise = SamplingParams(temperature=1.0, min_p=0.1)
            rows = [SampleRow(noise, others[i]) for i in range(batch_size)]
            rows[pos] = SampleRow(params, g)
            toks.append(sample(x, rows).token_ids[pos])
        return toks

    a = run(1, 0)
    assert a == run(5, 3) == run(9, 8)
    assert len(set(a)) > 1  # it really samples
    g2 = make_generator(99)
    other = [sample(target.unsqueeze(0), [SampleRow(params, g2)]).token_ids[0] for _ in range(20)]
    assert other != a


def test_sampling_frequencies_follow_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.95, min_p=0.05)
    z = logits[0].div(0.7).tolist()
    expect = _softmax(ref_min_p(ref_top_p(ref_top_k(z, 5), 0.95), 0.05))
    n = 20000
    g = make_generator(7)
    x = logits.expand(n, -1).contiguous()
    rows = [SampleRow(params, g)] * n
    toks = sample(x, rows).token_ids
    for t, p in enumerate(expect):
        freq = toks.count(t) / n
        if p == 0:
            assert freq == 0, t
        else:
            assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (t, freq, p)


def test_logprobs_are_raw_log_softmax():
    x = torch.tensor([[0.5, 2.0, -1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0), None, (), (1,)),
        SampleRow(SamplingParams(temperature=0.0), None),
    ]
    res = sample(x, rows)
    lp = torch.log_softmax(x, dim=-1)
    assert res.token_ids == [3, 3]
    assert res.logprobs[1] is None
    tl = res.logprobs[0]
    assert tl.token_id == 3 and abs(tl.logprob - float(lp[0, 3])) < 1e-6
    assert [t for t, _ in tl.top] == [1, 3]
    assert abs(tl.top[0][1] - float(lp[0, 1])) < 1e-6


def _bitmask(allowed: list[list[bool]]) -> torch.Tensor:
    """Reference packing: bit t % 32 of int32 word t // 32."""
    words = (len(allowed[0]) + 31) // 32
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, row in enumerate(allowed):
        for t, ok in enumerate(row):
            if ok:
                out[r, t // 32] |= 1 << (t % 32)
    out = torch.where(out >= 2**31, out - 2**32, out)  # two's complement into int32
    return out.to(torch.int32)


@pytest.mark.parametrize("V", [70, 96, 100])
def test_bitmask_touches_only_constrained_rows(V):
    rng = random.Random(V)
    logits = _rand_logits(rng, 5, V)
    rows = [1, 3]
    allowed = [[rng.random() < 0.3 for _ in range(V)] for _ in rows]
    allowed[0][V - 1] = True  # the last id (inside the last, partial word) is kept
    bitmask = _bitmask(allowed)
    if V == 100:  # a bitmask narrower than the logits: ids past 32 * words are disallowed
        bitmask = bitmask[:, :2]
    x = logits.clone()
    apply_token_bitmask(x, rows, bitmask)
    every = logits[rows].clone()  # every row constrained: one masked_fill_ over the batch
    apply_token_bitmask(every, [0, 1], bitmask)
    assert torch.equal(every, x[rows])
    for b in range(5):
        for t in range(V):
            if b in rows:
                ok = t < 32 * bitmask.shape[1] and allowed[rows.index(b)][t]
                assert x[b, t].item() == (logits[b, t].item() if ok else NEG), (b, t)
            else:
                assert x[b, t].item() == logits[b, t].item()
    res = sample(logits, [SampleRow(SamplingParams(temperature=0.0), None) for _ in range(5)], rows, bitmask)
    for j, b in enumerate(rows):
        ok = [t for t in range(V) if t < 32 * bitmask.shape[1] and allowed[j][t]]
        assert res.token_ids[b] == max(ok, key=lambda t: logits[b, t].item())


def test_banned_ids_are_never_sampled():
    rng = random.Random(5)
    logits = _rand_logits(rng, 2, 50)
    top = int(logits[0].argmax())
    rows = [SampleRow(SamplingParams(temperature=0.0), None, banned_ids=[top]),
            SampleRow(SamplingParams(temperature=1.0), make_generator(1), banned_ids=list(range(1, 50)))]
    res = sample(logits, rows)
    assert res.token_ids[0] != top and res.token_ids[1] == 0


def test_bitmask_unpacking_paths_agree():
    """The CPU (numpy) and device (torch bit operations, run here on CPU tensors) paths agree."""
    rng = random.Random(9)
    allowed = [[rng.random() < 0.5 for _ in range(300)] for _ in range(3)]
    bitmask = _bitmask(allowed)
    cpu = unpack_bitmask(bitmask, 300)
    assert cpu.tolist() == allowed
    assert unpack_bitmask(bitmask, 310, invert=True).tolist() == [[not a for a in row] + [True] * 10
                                                                  for row in allowed]
    assert unpack_bitmask_torch(bitmask, 300).tolist() == allowed
    assert unpack_bitmask_torch(~bitmask, 300).tolist() == [[not a for a in row] for row in allowed]


def test_candidate_path_draws_what_the_full_vocabulary_path_draws():
    """With every row's top_k set, the sampler filters and draws over the top-k candidates only; the
    tokens must be those of the whole-vocabulary path with the same seeds (ties included)."""
    from swaserve.engine.runner.sampling import _sample_candidates, _sample_full

    rng = torch.Generator().manual_seed(7)
    V = 5000
    ties = 0
    for trial in range(60):
        S = 1 + trial % 5
        z = torch.randn(S, V, generator=rng) * (0.5 + trial % 4)
        if trial % 3 == 0:  # ties: coarse logits
            z = torch.round(z * 2) / 2
        if trial % 7 == 0:  # a grammar-like mask leaving fewer tokens than top_k
            z[:, 40:] = float("-inf")
        sp = [SamplingParams(temperature=1.0, top_k=int(torch.randint(1, 300, (), generator=rng)),
                             top_p=[1.0, 0.95, 0.5, 0.1][(trial + b) % 4],
                             min_p=[0.0, 0.05][(trial + b) % 2]) for b in range(S)]
        kmax = max(p.top_k for p in sp)
        seeds = [trial * 10 + b for b in range(S)]
        full = _sample_full(z.clone(), sp, [make_generator(s) for s in seeds])
        cand, tie = _sample_candidates(z.clone(), sp, kmax, [make_generator(s) for s in seeds])
        if tie.any():  # a tie across the candidates' edge: sample() redraws on the full path
            ties += 1
            continue
        assert full.tolist() == cand.tolist(), (trial, [p.top_k for p in sp])
    assert 0 < ties < 30  # both paths were exercised


def test_tie_at_the_candidate_edge_redraws_over_the_vocabulary() -> None:
    """sample() with a tie across the top-k edge gives the full-vocabulary draw, with the row's
    generator advanced exactly as the full path advances it."""
    from swaserve.engine.runner.sampling import _sample_full

    z = torch.zeros(1, 64)
    z[0, :3] = 2.0
    z[0, 3:9] = 1.0  # top_k = 5 ends inside a run of equal logits
    p = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    want = _sample_full(z.clone(), [p], [make_generator(11)]).tolist()
    g = make_generator(11)
    got = sample(z.clone(), [SampleRow(p, g)]).token_ids
    ref = make_generator(11)
    _sample_full(z.clone(), [p], [ref])
    assert got == want and torch.equal(g.get_state(), ref.get_state())
