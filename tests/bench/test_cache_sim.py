"""bench/cache_sim.py: the retention invariant on every row of smaller traces (lazy with anchors never
loses to its ablations, nor does lazy without message anchors to no anchors at all), the multi-turn
targets on the full-size trace, KV correctness of the simulation (the fake model checks every read),
and the command line (`python -m swaserve.bench.cache_sim` and `swaserve bench cache`)."""

from __future__ import annotations

import json

import pytest

from swaserve.bench.cache_sim import (
    KEEP_EVERYTHING,
    NO_ANCHORS,
    NO_MESSAGE_ANCHORS,
    POLICIES,
    Geometry,
    kv_page_scale,
    main,
    pool_pages,
    run_table,
    simulate,
)
from swaserve.bench.cache_traces import WORKLOADS, TraceShape, make_trace

SMALL = TraceShape(groups=8, per_group=6, system_len=256, question_len=16, fanout_answer_len=8,
                   conversations=6, turns=4, opening_len=128, turn_answer_len=32, user_len=16)
SMALL_GEO = Geometry(page_size=4, window=64, chunk=128)


@pytest.fixture(scope="module")
def small_rows():
    return run_table(WORKLOADS, POLICIES, [1, 2, 4, 8, "roomy"], SMALL_GEO, shape=SMALL)


def test_lazy_never_loses_to_its_ablations(small_rows) -> None:
    cells: dict[tuple[str, str], dict[str, int]] = {}
    for r in small_rows:
        if r.policy != KEEP_EVERYTHING:
            cells.setdefault((r.workload, str(r.swa_pool_windows)), {})[r.policy] = r.reused_tokens
    assert len(cells) == len(WORKLOADS) * 5
    for key, c in cells.items():
        assert c["lazy"] >= c[NO_ANCHORS], (key, c)
        assert c["lazy"] >= c["eager-512"], (key, c)
        # a raw-prompt client (no message starts): the anchors the cache finds never lose to none
        assert c[NO_MESSAGE_ANCHORS] >= c[NO_ANCHORS], (key, c)
    # the comparison is not vacuous: pressure makes the policies differ somewhere
    assert any(c["lazy"] > c[NO_ANCHORS] for c in cells.values())
    assert any(c[NO_MESSAGE_ANCHORS] > c[NO_ANCHORS] for c in cells.values())


def test_keep_everything_is_the_upper_bound(small_rows) -> None:
    for r in small_rows:
        assert r.reused_tokens <= r.reusable_tokens, r
        if r.policy == KEEP_EVERYTHING:
            assert r.ratio == 1.0 and r.evicted_swa_pages == r.evicted_full_pages == 0
        if r.swa_pool_windows == "roomy" and not r.policy.startswith("eager"):
            assert r.ratio == 1.0, r


@pytest.mark.parametrize(("windows", "target"), [(8, 0.8), (16, 0.95)])
def test_multiturn_targets(windows: int, target: float) -> None:
    """The issue's targets on the full-size multi-turn trace (8 conversations x 6 turns, page 16,
    window 1024, 2048-token chunks)."""
    trace = make_trace("multiturn")
    upper = simulate("multiturn", trace, KEEP_EVERYTHING, "roomy", Geometry())
    row = simulate("multiturn", trace, "lazy", windows, Geometry())
    assert row.reused_tokens >= target * upper.reused_tokens, (row.reused_tokens, upper.reused_tokens)


def test_cache_aware_admission_reads_only_correct_kv() -> None:
    """Requests that wait and are passed by later ones still read exactly their own KV, and the rows count
    the steps, waits and modelled time."""
    trace = make_trace("mixed-rr", SMALL)[:80]
    geo = Geometry(page_size=4, window=64, chunk=128, concurrency=4, admission="cache-aware")
    row = simulate("mixed-rr", trace, "lazy", 1, geo, check=True)
    assert row.reused_tokens > 0 and max(row.waits) > 0 and row.steps > 0 and row.modelled_s > 0
    out = row.to_json()
    assert {"steps", "modelled_s", "mean_wait_steps", "max_wait_steps"} <= set(out)


@pytest.mark.parametrize("workload", ["mixed-seq", "multiturn"])
def test_simulation_reads_only_correct_kv(workload: str) -> None:
    """With check=True the fake model verifies every position each step attends to, and the cache
    invariants hold after every step, under heavy eviction."""
    trace = make_trace(workload, SMALL)[:60]
    row = simulate(workload, trace, "lazy", 1, SMALL_GEO, check=True)
    assert row.evicted_swa_pages > 0 and row.reused_tokens > 0


def test_command_line_json(capsys) -> None:
    assert main(["--json", "--workload", "multiturn", "--windows", "16", "--policy", "lazy,eager-16"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == [KEEP_EVERYTHING, "lazy", "eager-16"]
    for r in rows:
        fields = {"workload", "policy", "swa_pool_windows", "reused_tokens", "reusable_tokens", "ratio"}
        assert fields <= set(r)
        assert r["workload"] == "multiturn" and r["reusable_tokens"] == rows[0]["reused_tokens"]
    assert rows[1]["swa_pool_windows"] == 16 and rows[1]["ratio"] >= 0.95


def test_q8_0_pages_at_the_same_bytes(capsys) -> None:
    """--kv-dtype: the bytes of N bf16 windows hold 2 / 1.0625 as many q8_0 pages, and on a trace under
    pressure the extra windows reuse at least what bf16 reuses; the JSON rows name their type."""
    assert kv_page_scale("bf16") == kv_page_scale("fp16") == 1.0 and kv_page_scale("fp32") == 0.5
    assert kv_page_scale("q8_0") == pytest.approx(2 / 1.0625)
    q8 = Geometry(page_size=4, window=64, chunk=128, kv_dtype="q8_0", page_scale=kv_page_scale("q8_0"))
    trace = make_trace("mixed-rr", SMALL)[:60]
    full_b, swa_b = pool_pages(trace, 2, SMALL_GEO)
    full_q, swa_q = pool_pages(trace, 2, q8)
    assert swa_q == int(swa_b * 2 / 1.0625) and full_q == 4 * swa_q
    assert pool_pages(trace, "roomy", q8) == pool_pages(trace, "roomy", SMALL_GEO)
    for windows in (1, 2):
        bf = simulate("mixed-rr", trace, "lazy", windows, SMALL_GEO)
        q = simulate("mixed-rr", trace, "lazy", windows, q8, check=True)
        assert q.kv_dtype == "q8_0" and q.reused_tokens >= bf.reused_tokens, (windows, q, bf)
    assert main(["--json", "--workload", "multiturn", "--windows", "4", "--policy", "lazy",
                 "--kv-dtype", "bf16,q8_0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kv_dtype"], r["policy"]) for r in rows] == [
        ("bf16", KEEP_EVERYTHING), ("bf16", "lazy"), ("q8_0", KEEP_EVERYTHING), ("q8_0", "lazy")]
    assert rows[3]["ratio"] >= rows[1]["ratio"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "nope"], "--workload: unknown nope"),
    (["--windows", "0"], "--windows: expected positive integers or 'roomy'"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--kv-dtype", "q4_0"], "--kv-dtype: unknown q4_0"),
    (["--admission-max-wait", "-1"], "--admission-max-wait must be at least 0"),
    (["--step-costs", "40"], "expected PROMPT_TOK_S,STEP_S"),
    (["--step-costs", "40,0"], "both must be positive"),
    (["--admission-policy", "lpm"], "invalid choice"),
])
def test_command_line_errors(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["mixed-rr", "multiturn"])
def test_arena_serves_correct_kv_and_matches_split_memory(workload: str) -> None:
    """--arena: the same bytes as the split pools, shared by both kinds. Every KV read is checked and
    the arena's accounting holds after every step; a shared arena reuses at least what the fixed split
    of the same bytes reuses on these traces (memory the full pages do not use holds windows)."""
    trace = make_trace(workload, SMALL)[:60]
    arena_geo = Geometry(page_size=4, window=64, chunk=128, arena=True)
    for windows in (1, 4):
        split = simulate(workload, trace, "lazy", windows, SMALL_GEO)
        shared = simulate(workload, trace, "lazy", windows, arena_geo, check=True)
        assert shared.memory == "arena" and split.memory == "split"
        assert shared.reused_tokens >= split.reused_tokens, (windows, shared, split)


def test_swaserve_bench_cache(capsys) -> None:
    """`swaserve bench cache` is the same command: its --help lists the flags, a bad flag is exit 2."""
    from swaserve.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "cache", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: swaserve bench cache")
    for flag in ("--workload", "--policy", "--windows", "--concurrency", "--arena", "--check", "--json"):
        assert flag in out
    assert cli_main(["bench", "cache", "--concurrency", "0"]) == 2
    assert "--concurrency must be at least 1" in capsys.readouterr().err
