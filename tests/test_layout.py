"""The layout rules: one installed name (`swaserve`), imports that run one way, no import circles, and a
cache and scheduler that import no heavy library (the KV tier's byte movers excepted). Read from the source
(every import statement, lazy and TYPE_CHECKING ones included) and checked by importing in a fresh
interpreter."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "models", "bench")  # folders installed under swaserve.
TOP_MODULES = ("__init__.py", "cli.py", "llm.py")
BARE_NAMES = {"engine", "server", "models", "bench", "cli", "llm", "tools", "tests"}


def _modules() -> dict[str, Path]:
    """swaserve module name -> file, for every module the package installs."""
    out = {"swaserve": ROOT / "__init__.py"}
    for name in TOP_MODULES[1:]:
        out["swaserve." + name.removesuffix(".py")] = ROOT / name
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["swaserve." + ".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[str]:
    """Every module `name` imports (absolute names; `from a import b` counts a.b when b is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            out += subs or [mod]
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "swaserve"


def test_no_bare_top_level_imports() -> None:
    bad = [(m, i) for m, imps in GRAPH.items() for i in imps if i.split(".")[0] in BARE_NAMES]
    assert not bad, f"imports outside the swaserve namespace: {bad}"


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("engine", {"models", "server", "cli", "llm", "bench"}),
    ("models", {"server", "cli", "llm", "bench"}),
    ("server", {"cli", "llm", "bench"}),
])
def test_imports_run_one_way(layer: str, forbidden: set[str]) -> None:
    bad = [(m, i) for m, imps in GRAPH.items() if _layer(m) == layer
           for i in imps if i.startswith("swaserve.") and _layer(i) in forbidden]
    assert not bad, f"{layer}/ imports upward: {bad}"


def test_no_import_circles() -> None:
    edges = {m: {i for i in imps if i in MODULES and i != m} for m, imps in GRAPH.items()}
    # a package's __init__ re-exporting its own modules is not a circle: drop package -> own submodule
    edges = {m: {i for i in dst if not i.startswith(m + ".")} for m, dst in edges.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


HEAVY = {"torch", "triton", "transformers", "fastapi", "numpy", "jinja2", "gguf"}
LIGHT = ("swaserve.engine.kvcache", "swaserve.engine.scheduler")  # packages that import no heavy library
# ... but for the KV tier's byte movers, the only exception: they copy pages with torch
BYTE_MOVERS = {f"swaserve.engine.kvcache.tier.{m}" for m in ("host", "file", "copies", "build")}


def _heavy_chain(module: str) -> list[str]:
    """An import chain from `module` through swaserve modules to a HEAVY library ([]: none)."""
    via = {module: [module]}  # module reached -> the chain to it
    todo = [module]
    while todo:
        m = todo.pop()
        for i in GRAPH[m]:
            if i.split(".")[0] in HEAVY:
                return [*via[m], i]
            if i in MODULES and i not in via:
                via[i] = [*via[m], i]
                todo.append(i)
    return []


def test_cache_and_scheduler_source_imports_no_heavy_library() -> None:
    """Every import in the source (lazy ones too) of engine/kvcache and engine/scheduler stays clear of
    HEAVY, directly or through the other swaserve modules it reaches; the tier's byte movers excepted."""
    assert BYTE_MOVERS <= set(MODULES), f"named exceptions that do not exist: {BYTE_MOVERS - set(MODULES)}"
    light = {m for m in MODULES if any(m == pkg or m.startswith(pkg + ".") for pkg in LIGHT)} - BYTE_MOVERS
    assert {"swaserve.engine.kvcache.base", "swaserve.engine.kvcache.tier.promotion"} <= light
    bad = []
    for m in sorted(light):
        for i in GRAPH[m]:
            if i.split(".")[0] in HEAVY:
                bad.append(f"{m} imports {i}")
            elif i in MODULES and i not in light and (chain := _heavy_chain(i)):
                bad.append(f"{m} imports " + " -> ".join(chain))
    assert not bad, "engine/kvcache or engine/scheduler imports a heavy library:\n" + "\n".join(bad)


def test_cache_and_scheduler_import_no_heavy_library(tmp_path: Path) -> None:
    code = ("import sys, swaserve.engine.kvcache, swaserve.engine.scheduler\n"
            f"heavy = {sorted(HEAVY)!r}\n"
            "print(sorted(set(heavy) & set(sys.modules)))")
    p = _run(code, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", f"engine/kvcache or engine/scheduler pulls in {p.stdout.strip()}"


def test_one_namespace_from_outside_the_repository(tmp_path: Path) -> None:
    ok = _run("from swaserve import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__module__)",
              tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["swaserve.llm", "swaserve.engine.core"]
    for name in sorted(BARE_NAMES - {"tests"}):
        p = _run(f"import {name}", tmp_path)
        assert p.returncode != 0 and "ModuleNotFoundError" in p.stderr, f"`import {name}` works outside"


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                    reason="needs setuptools in the venv to build a wheel")
def test_wheel_installs_exactly_one_top_level_name(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy of the tracked files: the checkout stays untouched
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"swaserve", "swaserve-0.1.0.dist-info"}, top
    packaged = {n.removeprefix("swaserve/") for n in names if n.startswith("swaserve/") and n.endswith(".py")}
    expected = {str(p.relative_to(ROOT)) for p in MODULES.values()}
    assert packaged == expected, f"missing {expected - packaged}, extra {packaged - expected}"
    # the native kernels are compiled from the installed package: every C source and header must ship
    native = {str(p.relative_to(ROOT)) for p in (ROOT / "engine" / "quant").glob("*.[ch]")}
    shipped = {n.removeprefix("swaserve/") for n in names}
    assert native and native <= shipped, f"native sources missing from the wheel: {native - shipped}"
