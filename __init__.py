"""swaserve: an OpenAI-compatible Gemma 4 server with a sliding-window-aware prefix cache.

The repository root is this package (pyproject maps it to `swaserve`): `swaserve.server`,
`swaserve.engine`, `swaserve.models`, `swaserve.cli`, `swaserve.bench`. The offline API is
re-exported here, imported on first use so that `import swaserve` stays light.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads sleep at barriers instead of spinning (unless the user says otherwise): with a neighbour
# on a core, spinning threads wait for a descheduled one (2-thread decode on a busy 2-core box: 268 ms a
# token spinning, 16 ms passive; docs/benchmarks.md). libgomp reads this once, when torch loads it, so it is
# set here, before anything of swaserve imports torch; a program that imported torch first keeps its policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from swaserve.engine.core import SamplingParams
    from swaserve.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from swaserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from swaserve.engine.core import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'swaserve' has no attribute {name!r}")
