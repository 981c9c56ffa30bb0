from __future__ import annotations

import statistics

import pytest

from swaserve.bench import workloads as W


def test_fanout_shape_and_sharing():
    wl = W.fanout(3, 4, system_len=200, question_len=20, output_len=8, tokens_per_word=1.0, seed=7)
    assert [p.name for p in wl.phases] == ["first", "non-first"]
    first, rest = wl.phases
    assert len(first.sessions) == 3 and len(rest.sessions) == 9 and wl.num_requests == 12
    assert all(s.turns[0].tag == "first" for s in first.sessions)
    assert all(s.turns[0].tag == "non-first" for s in rest.sessions)
    by_group: dict[str, set[str]] = {}
    questions = set()
    for s in first.sessions + rest.sessions:
        g = s.key.split("/")[1]
        by_group.setdefault(g, set()).add(s.system)
        questions.add(s.turns[0].user)
        assert len(s.turns) == 1 and s.turns[0].max_tokens == 8
        # ~200 tokens at 1 token/word (+ "Group g." header)
        assert 200 <= len(s.system.split()) <= 203
        assert 20 <= len(s.turns[0].user.split()) <= 23
    assert len(by_group) == 3 and all(len(v) == 1 for v in by_group.values())  # one system prompt per group
    assert len({next(iter(v)) for v in by_group.values()}) == 3  # distinct across groups
    assert len(questions) == 12
    assert wl.focus_tag == "non-first"


def test_fanout_deterministic_and_seeded():
    a = W.fanout(2, 3, 50, 10, 4, seed=1)
    b = W.fanout(2, 3, 50, 10, 4, seed=1)
    c = W.fanout(2, 3, 50, 10, 4, seed=2)
    assert a == b
    assert a != c


def test_tokens_per_word_scales_lengths():
    wl = W.fanout(1, 1, system_len=300, question_len=30, output_len=1, tokens_per_word=1.5)
    assert abs(len(wl.phases[0].sessions[0].system.split()) - 200) <= 3


def test_fanout_single_prompt_per_group_has_one_phase():
    wl = W.fanout(2, 1, 10, 5, 2)
    assert len(wl.phases) == 1 and wl.num_requests == 2


def test_multi_turn_shape():
    wl = W.multi_turn(2, 3, 100, 10, 5, seed=3)
    (ph,) = wl.phases
    assert len(ph.sessions) == 2 and wl.num_requests == 6
    for s in ph.sessions:
        assert s.system is not None
        assert [t.tag for t in s.turns] == ["first", "follow-up", "follow-up"]
    assert wl.focus_tag == "follow-up"


def test_divergence_sweep_matches_the_seed_shape():
    ns = [3, 7, 64]
    wl = W.divergence_sweep(ns, prefix_len=300, output_len=16)
    assert len(wl.phases) == 2 * len(ns)
    systems = set()
    for i, n in enumerate(ns):
        a, b = wl.phases[2 * i].sessions[0], wl.phases[2 * i + 1].sessions[0]
        assert wl.sweep_n[a.key] == wl.sweep_n[b.key] == n
        assert a.system == b.system
        systems.add(a.system)
        ua, ub = a.turns[0].user.split(), b.turns[0].user.split()
        assert len(ua) == len(ub)
        diff = [j for j, (x, y) in enumerate(zip(ua, ub)) if x != y]
        assert diff == [len(ua) - n - 1]  # one differing token, then N identical ones
        assert ua[-n:] == ub[-n:] == ["the"] * n
        assert (a.turns[0].tag, b.turns[0].tag) == ("sweep-a", "sweep-b")
        assert W.SEED_FILLER.strip() in a.system
    assert len(systems) == len(ns)  # each N has its own prefix


def test_random_prompts_lengths_in_range():
    wl = W.random_prompts(50, input_len=40, output_len=10, range_ratio=0.5, seed=0)
    assert wl.num_requests == 50 and wl.phases[0].sessions[0].system is None
    for s in wl.phases[0].sessions:
        assert 20 <= len(s.turns[0].user.split()) <= 40
        assert 5 <= s.turns[0].max_tokens <= 10
    assert len({s.turns[0].max_tokens for s in wl.phases[0].sessions}) > 1


def test_arrival_offsets_poisson():
    assert W.arrival_offsets(5, float("inf")) == [0.0] * 5
    offs = W.arrival_offsets(4000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 0.1) < 0.01  # exponential with mean 1/rate
    assert abs(statistics.stdev(gaps) - 0.1) < 0.015
    assert W.arrival_offsets(10, 3.0, seed=2) == W.arrival_offsets(10, 3.0, seed=2)


@pytest.mark.parametrize(
    "call",
    [
        lambda: W.fanout(0, 1, 10, 10, 1),
        lambda: W.multi_turn(1, 0, 10, 10, 1),
        lambda: W.divergence_sweep([-1], 10, 1),
        lambda: W.random_prompts(1, 10, 1, range_ratio=0.0),
        lambda: W.arrival_offsets(1, 0.0),
        lambda: W.words_for(10, 0.0),
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_fanout_image_shares_one_image_per_group():
    wl = W.fanout(3, 3, 32, 8, 4, seed=1, image_size=32)
    assert wl.name == "fanout-image" and wl.params["image_size"] == 32
    by_group: dict[str, set] = {}
    for ph in wl.phases:
        for s in ph.sessions:
            (turn,) = s.turns
            assert turn.image is not None and turn.image.startswith("data:image/png;base64,")
            by_group.setdefault(s.key.split("/")[1], set()).add(turn.image)
    assert all(len(v) == 1 for v in by_group.values())  # one image per group ...
    assert len({next(iter(v)) for v in by_group.values()}) == 3  # ... its own
    assert W.fanout(3, 3, 32, 8, 4, seed=1, image_size=32).phases == wl.phases  # seeded
