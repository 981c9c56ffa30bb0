"""Request traces for the cache-level benchmark (bench/cache_sim.py): fan-out (sequential and
round-robin), multi-turn append, and the two mixed. Every request carries its prompt, the answer the
(fake) model will produce, and the chat-message starts a server would pass as anchors. Deterministic
for a given seed; token ids are random and distinct per group / conversation."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 50_000

WORKLOADS = ("fanout-seq", "fanout-rr", "multiturn", "mixed-seq", "mixed-rr")


@dataclass(frozen=True)
class TraceRequest:
    prompt: tuple[int, ...]
    answer: tuple[int, ...]  # the tokens the fake model samples, in order (len = max_tokens)
    anchors: tuple[int, ...]  # chat-message starts inside the prompt
    group: str  # fan-out group or conversation (for reports)


@dataclass(frozen=True)
class TraceShape:
    """Lengths of the traces (the issue's defaults; tests use smaller ones)."""

    groups: int = 16  # fan-out: distinct system prompts
    per_group: int = 16  # fan-out: requests per system prompt
    system_len: int = 4096
    question_len: int = 64
    fanout_answer_len: int = 16
    conversations: int = 8
    turns: int = 6
    opening_len: int = 2048  # multi-turn: the first turn's context
    turn_answer_len: int = 128
    user_len: int = 64


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, VOCAB) for _ in range(n))


def fanout(shape: TraceShape, order: str, seed: int = 0) -> list[TraceRequest]:
    """groups x per_group requests: a system prompt per group plus a question each; order "seq" (one
    group after the other) or "rr" (round-robin over the groups)."""
    rng = random.Random(seed * 7919 + 1)
    systems = [_tokens(rng, shape.system_len) for _ in range(shape.groups)]
    by_group = [[TraceRequest(systems[g] + _tokens(rng, shape.question_len),
                              _tokens(rng, shape.fanout_answer_len), (shape.system_len,), f"g{g}")
                 for _ in range(shape.per_group)] for g in range(shape.groups)]
    if order == "seq":
        return [r for group in by_group for r in group]
    if order == "rr":
        return [by_group[g][i] for i in range(shape.per_group) for g in range(shape.groups)]
    raise ValueError(f"unknown fan-out order {order!r}")


def multiturn(shape: TraceShape, seed: int = 0) -> list[TraceRequest]:
    """conversations x turns, interleaved (turn 1 of every conversation, then turn 2, ...). Turn t's
    prompt is turn t-1's prompt + its answer + a new user message; message starts are anchors."""
    rng = random.Random(seed * 7919 + 2)
    convs: list[list[TraceRequest]] = []
    for c in range(shape.conversations):
        prompt = _tokens(rng, shape.opening_len)
        anchors: list[int] = []
        turns = []
        for _ in range(shape.turns):
            answer = _tokens(rng, shape.turn_answer_len)
            turns.append(TraceRequest(prompt, answer, tuple(anchors), f"c{c}"))
            anchors += [len(prompt), len(prompt) + len(answer)]  # starts of the answer and the next message
            prompt = prompt + answer + _tokens(rng, shape.user_len)
        convs.append(turns)
    return [convs[c][t] for t in range(shape.turns) for c in range(shape.conversations)]


def mixed(shape: TraceShape, order: str, seed: int = 0) -> list[TraceRequest]:
    """The fan-out trace (in `order`) and the multi-turn trace merged evenly, keeping each one's order."""
    a, b = fanout(shape, order, seed), multiturn(shape, seed)
    out: list[TraceRequest] = []
    i = j = 0
    while i < len(a) or j < len(b):
        # take from the trace that is further behind its share
        if j >= len(b) or (i < len(a) and i * len(b) <= j * len(a)):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


def make_trace(name: str, shape: TraceShape | None = None, seed: int = 0) -> list[TraceRequest]:
    shape = shape or TraceShape()
    if name == "fanout-seq":
        return fanout(shape, "seq", seed)
    if name == "fanout-rr":
        return fanout(shape, "rr", seed)
    if name == "multiturn":
        return multiturn(shape, seed)
    if name == "mixed-seq":
        return mixed(shape, "seq", seed)
    if name == "mixed-rr":
        return mixed(shape, "rr", seed)
    raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}")
