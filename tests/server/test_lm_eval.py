"""lm-evaluation-harness's `local-completions` model against the server, end to end, on tiny local tasks
(a multiple-choice loglikelihood task, a generate_until task, a loglikelihood_rolling task; their data
written here, nothing downloaded). Its tokenizer is the server's (`/tokenizer_info`, `/tokenize`). The
choices' loglikelihoods it reports are checked against the exact forward.

Optional: lm-eval is not a dependency (with its `api` extra it took 3.5 min to install here). Set
SWASERVE_LM_EVAL_PYTHON to a Python that has `lm-eval[api]`, or install it beside the tests; skipped
otherwise. The command it runs is in docs/api.md#lm-evaluation-harness."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.models.hf_oracle import PagedRunner
from tests.server.conftest import SERVED, LiveServer, wait_idle

PYTHON = os.environ.get("SWASERVE_LM_EVAL_PYTHON") or (
    sys.executable if importlib.util.find_spec("lm_eval") is not None else None)
pytestmark = pytest.mark.skipif(PYTHON is None, reason="lm-evaluation-harness not installed (set "
                                "SWASERVE_LM_EVAL_PYTHON to a Python with lm-eval[api])")

CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin", "Madrid"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "seven"], "label": 0},
    {"question": "A prefix cache reuses the", "choices": ["keys and values", "weights"], "label": 0},
]
GEN = [{"question": "What is the capital of France?", "answer": "Paris"},
       {"question": "What colour is the sky?", "answer": "blue"}]
ROLL = [{"text": "The sliding window keeps the last tokens close; the cache keeps the rest. " * 3}]
TASKS = {
    "tiny_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                   "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
                "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
                "  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
    "tiny_roll": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                 "metric_list:\n  - metric: word_perplexity\n",
}


def write_tasks(root: Path) -> None:
    for name, rows in (("tiny_choice", CHOICE), ("tiny_gen", GEN), ("tiny_roll", ROLL)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{TASKS[name]}")


def test_lm_eval_local_completions(server: LiveServer, engine: Any, tmp_path: Path) -> None:
    write_tasks(tmp_path)
    out = tmp_path / "out"
    cmd = [PYTHON, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", f"model={SERVED}",
           f"base_url={server.url}/v1/completions", "num_concurrent=1", "max_retries=1",
           "--include_path", str(tmp_path), "--tasks", "tiny_choice", "tiny_gen", "tiny_roll",
           "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remote tokenizer" in run.stderr  # lm-eval tokenized through /tokenizer_info + /tokenize
    (results,) = glob.glob(str(out / "*" / "results_*.json"))
    got = json.loads(Path(results).read_text())["results"]
    assert set(got) == {"tiny_choice", "tiny_gen", "tiny_roll"}
    (samples,) = glob.glob(str(out / "*" / "samples_tiny_choice_*.jsonl"))
    wait_idle(engine)
    core = engine.core

    def enc(text: str) -> list[int]:
        with httpx.Client(base_url=server.url) as h:
            return h.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    checked = 0
    for line in Path(samples).read_text().splitlines():
        d = json.loads(line)
        for k, args in enumerate(d["arguments"].values()):
            ctx, cont = args["arg_0"], args["arg_1"]  # lm-eval's context / continuation split
            ctx_ids = enc(ctx)
            ids = ctx_ids + enc(ctx + cont)[len(ctx_ids):]
            pr = PagedRunner(core.runner.model, core.model_config, core.config.cache.page_size,
                             len(ids) + 16, 1)
            with torch.no_grad():
                lp = torch.log_softmax(pr.step([(0, ids)])[0].double(), dim=-1)
            ref = sum(lp[t - 1, ids[t]].item() for t in range(len(ctx_ids), len(ids)))
            assert abs(float(d["resps"][k][0][0]) - ref) <= 1e-3, (ctx, cont)
            checked += 1
    assert checked == sum(len(c["choices"]) for c in CHOICE)
