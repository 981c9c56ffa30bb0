"""Benchmark workloads: pure, seeded generators of chat sessions grouped into phases.

A workload is a sequence of phases run one after the other; the sessions of a phase run concurrently
(subject to the request rate and the concurrency cap). A session is a system prompt plus user turns
sent in order; the client appends each assistant reply (content only, thinking dropped) before the
next turn. Lengths are in tokens, converted to words with `tokens_per_word` (measured by the caller
with the server's /tokenize endpoint); the real prompt sizes come back in the usage of each response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# The seed's filler sentence (its reproduction builds the shared prefix from it).
SEED_FILLER = (
    "Operational note: the routing network selects a small subset of experts per token, "
    "so the working set touched during one decode step is far smaller than the count. "
)

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their been has will would more if no when can "
    "what so out up said about into than them only other time new some could these two may first "
    "then do any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three states himself few house use during without again place around "
    "however home small found thought went say part once general high upon school every does got "
    "united left number course war until always away something fact though water less public put "
    "think almost hand enough far took head yet government system better set told nothing night end "
    "why called didn eyes find going look asked later knew point next city business give group "
    "toward young days let room president side social present given several order national possible "
    "rather second face per among form important often things looking large early white case become"
).split()

Tag = str  # "first", "non-first", "follow-up", "sweep-a", "sweep-b", "random"


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    tag: Tag
    image: str | None = None  # a data: URL sent as an image_url part before the text (fanout-image)


@dataclass(frozen=True)
class Session:
    key: str  # stable across configurations: outputs are compared by (key, turn index)
    system: str | None
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Phase:
    name: str
    sessions: tuple[Session, ...]


@dataclass(frozen=True)
class Workload:
    name: str  # "fanout" | "append" | "sweep" | "random"
    phases: tuple[Phase, ...]
    focus_tag: Tag  # the requests whose TTFT shows reuse (compared across configurations)
    params: dict = field(default_factory=dict)
    sweep_n: dict[str, int] = field(default_factory=dict)  # sweep: session key -> N

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for ph in self.phases for s in ph.sessions)


def random_image_url(rng: random.Random, size: int) -> str:
    """A seeded random PNG (blocks of colour) as a data: URL."""
    import base64
    import io

    from PIL import Image

    img = Image.new("RGB", (size, size))
    step = max(1, size // 8)
    for y in range(0, size, step):
        for x in range(0, size, step):
            rgb = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
            img.paste(rgb, (x, y, x + step, y + step))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def words_for(n_tokens: int, tokens_per_word: float) -> int:
    """Number of words that make about `n_tokens` tokens (at least 1)."""
    if tokens_per_word <= 0:
        raise ValueError(f"tokens_per_word must be positive, got {tokens_per_word}")
    return max(1, round(n_tokens / tokens_per_word))


def random_text(rng: random.Random, n_tokens: int, tokens_per_word: float) -> str:
    """Random words from a fixed vocabulary, about `n_tokens` tokens long."""
    return " ".join(rng.choice(_WORDS) for _ in range(words_for(n_tokens, tokens_per_word)))


def filler_text(n_tokens: int, tokens_per_word: float, header: str = "Notes.") -> str:
    """The seed's prefix: a header then its filler sentence repeated to about `n_tokens` tokens."""
    per_sentence = len(SEED_FILLER.split()) * tokens_per_word
    reps = max(1, round(n_tokens / per_sentence))
    return f"{header}\n\n" + SEED_FILLER * reps


def _check_pos(**kw: int) -> None:
    for k, v in kw.items():
        if v < 1:
            raise ValueError(f"{k.replace('_', '-')} must be at least 1, got {v}")


def fanout(
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    tokens_per_word: float = 1.0,
    seed: int = 0,
    image_size: int = 0,
) -> Workload:
    """Generated shared prefix: each group shares a system prompt; every prompt has its own question.
    With image_size, each group also shares one random image_size x image_size PNG (fanout-image).

    Phase 1 sends the first prompt of every group (cold), phase 2 the others (the siblings that
    should reuse the shared system prompt).
    """
    _check_pos(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_len,
        question_len=question_len,
        output_len=output_len,
    )
    rng = random.Random(seed)
    first, rest = [], []
    for g in range(num_groups):
        system = f"Group {g}. " + random_text(rng, system_len, tokens_per_word)
        for p in range(prompts_per_group):
            q = f"Question {p}: " + random_text(rng, question_len, tokens_per_word)
            tag = "first" if p == 0 else "non-first"
            s = Session(f"fanout/g{g}/p{p}", system, (Turn(q, output_len, tag),))
            (first if p == 0 else rest).append(s)
    rng.shuffle(rest)
    phases = [Phase("first", tuple(first))]
    if rest:
        phases.append(Phase("non-first", tuple(rest)))
    params = dict(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_len,
        question_len=question_len,
        output_len=output_len,
        seed=seed,
    )
    if image_size:  # each group's prompts share one image (its own per group), before the question
        imgs = [random_image_url(random.Random(seed * 1000 + g), image_size) for g in range(num_groups)]

        def with_image(s: Session) -> Session:
            img = imgs[int(s.key.split("/")[1][1:])]  # fanout/g<group>/p<prompt>
            return Session(s.key, s.system, tuple(Turn(t.user, t.max_tokens, t.tag, img) for t in s.turns))

        phases = [Phase(ph.name, tuple(with_image(s) for s in ph.sessions)) for ph in phases]
        params["image_size"] = image_size
        return Workload("fanout-image", tuple(phases), "non-first", params)
    return Workload("fanout", tuple(phases), "non-first", params)


def multi_turn(
    num_sessions: int,
    num_turns: int,
    system_len: int,
    question_len: int,
    output_len: int,
    tokens_per_word: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Multi-turn append: each session appends a user turn to its history after every reply.

    The client sends each earlier reply back as plain content (thinking dropped), so the next
    prompt diverges from the previous one a few tokens before its end.
    """
    _check_pos(
        num_sessions=num_sessions,
        num_turns=num_turns,
        system_prompt_len=system_len,
        question_len=question_len,
        output_len=output_len,
    )
    rng = random.Random(seed)
    sessions = []
    for s in range(num_sessions):
        system = f"Session {s}. " + random_text(rng, system_len, tokens_per_word)
        turns = tuple(
            Turn(
                f"Turn {t}: " + random_text(rng, question_len, tokens_per_word),
                output_len,
                "first" if t == 0 else "follow-up",
            )
            for t in range(num_turns)
        )
        sessions.append(Session(f"append/s{s}", system, turns))
    params = dict(
        num_sessions=num_sessions,
        num_turns=num_turns,
        system_prompt_len=system_len,
        question_len=question_len,
        output_len=output_len,
        seed=seed,
    )
    return Workload("append", (Phase("sessions", tuple(sessions)),), "follow-up", params)


def divergence_sweep(
    ns: list[int],
    prefix_len: int,
    output_len: int,
    tokens_per_word: float = 1.0,
    differ: tuple[str, str] = ("red", "blue"),
    same: str = "the",
) -> Workload:
    """The seed's sweep: per N, two requests over one prefix whose tails differ N tokens before the end.

    Request a ends with `differ[0]` then N copies of `same`; request b with `differ[1]` then the same
    N copies. Each N gets its own prefix (a distinct header), so earlier cases do not feed later ones.
    """
    _check_pos(sweep_prefix_len=prefix_len, output_len=output_len)
    if not ns or any(n < 0 for n in ns):
        raise ValueError(f"sweep N values must be >= 0, got {ns}")
    phases, sweep_n = [], {}
    for n in ns:
        system = filler_text(prefix_len, tokens_per_word, header=f"Notes for case {n}.")
        tail = "".join(f" {same}" for _ in range(n))
        for side, word, tag in (("a", differ[0], "sweep-a"), ("b", differ[1], "sweep-b")):
            key = f"sweep/n{n}/{side}"
            sweep_n[key] = n
            user = f"Answer briefly. {word}{tail}"
            phases.append(Phase(f"n{n}-{side}", (Session(key, system, (Turn(user, output_len, tag),)),)))
    params = dict(ns=list(ns), sweep_prefix_len=prefix_len, output_len=output_len)
    return Workload("sweep", tuple(phases), "sweep-b", params, sweep_n)


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    tokens_per_word: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Independent random prompts; lengths uniform in [range_ratio * len, len]."""
    _check_pos(num_prompts=num_prompts, random_input_len=input_len, random_output_len=output_len)
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"random-range-ratio must be in (0, 1], got {range_ratio}")
    rng = random.Random(seed)
    sessions = []
    for i in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        sessions.append(
            Session(f"random/{i}", None, (Turn(random_text(rng, n_in, tokens_per_word), n_out, "random"),))
        )
    params = dict(
        num_prompts=num_prompts,
        random_input_len=input_len,
        random_output_len=output_len,
        random_range_ratio=range_ratio,
        seed=seed,
    )
    return Workload("random", (Phase("all", tuple(sessions)),), "random", params)


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Start offsets (seconds) of n requests: Poisson arrivals at `request_rate`/s, all 0 when inf."""
    if request_rate <= 0:
        raise ValueError(f"request-rate must be positive, got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out
