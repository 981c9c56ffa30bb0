"""Folder-to-folder import graph of the installed package (every import, lazy ones included), from the source.

    python -m tools.layout.import_graph
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "models", "bench")


def _folder(mod: str) -> str:
    parts = mod.split(".")[1:]
    path = ROOT.joinpath(*parts)
    if path.is_dir():
        return "/".join(parts) + "/"
    return ("/".join(parts[:-1]) + "/") if len(parts) > 1 else parts[0] + ".py"


def _is_module(package: Path, name: str) -> bool:
    return (package / f"{name}.py").exists() or (package / name).is_dir()


def main() -> int:
    files = [ROOT / f for f in ("cli.py", "llm.py")] + [f for p in PACKAGES for f in (ROOT / p).rglob("*.py")]
    edges: dict[str, set[str]] = defaultdict(set)
    for f in files:
        rel = f.relative_to(ROOT)
        src = (str(rel.parent) + "/") if len(rel.parts) > 1 else rel.name
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                base = ROOT.joinpath(*node.module.split(".")[1:])
                mods = [f"{node.module}.{a.name}" if _is_module(base, a.name) else node.module
                        for a in node.names]
            for m in mods:
                if m.startswith("swaserve."):
                    dst = _folder(m)
                    if dst != src:
                        edges[src].add(dst)
    for src in sorted(edges):
        print(f"{src:24s} -> {', '.join(sorted(edges[src]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
