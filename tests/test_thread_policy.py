"""`import swaserve` sets OpenMP's wait policy to passive before torch loads libgomp (which reads it once):
with a neighbour on a core, spinning threads wait for a descheduled one (docs/benchmarks.md, threads on a
busy machine). A policy the user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import swaserve, torch, os; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"


def _run(env: dict[str, str]) -> str:
    code = "import sys; " + PROBE
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_passive_by_default_and_the_users_policy_wins() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _run(env) == "PASSIVE True"
    assert _run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE True"


def test_the_package_sets_it_before_anything_imports_torch() -> None:
    """swaserve/__init__.py itself imports no torch: the policy is in place when torch first loads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import sys, os, swaserve; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    assert out == "PASSIVE False"
