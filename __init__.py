"""swaserve: an OpenAI-compatible Gemma 4 server with a sliding-window-aware prefix cache.

The repository root is this package (pyproject maps it to `swaserve`): `swaserve.server`,
`swaserve.engine`, `swaserve.models`, `swaserve.cli`, `swaserve.bench`. The offline API is
re-exported here, imported on first use so that `import swaserve` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
