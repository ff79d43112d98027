"""The package's shape: layers import downward only, no import cycles, modules of one idea."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent
MAX_MODULE_LINES = 420  # "no module over ~400 lines"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """kvserve modules ``path`` imports anywhere (function bodies included), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in modules and name != "kvserve":
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_no_import_cycles_between_modules():
    graph = _graph()
    # iterative DFS (three colours); a package's __init__ importing its own modules is not a cycle
    colour: dict[str, int] = {}
    for start in graph:
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = 1
        path = [start]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
                continue
            if colour.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))


def test_engine_and_kv_import_neither_torch_nor_the_server():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith(("kvserve.engine", "kvserve.kv")):
            bad = {d for d in deps if d.startswith(("kvserve.server", "kvserve.runner", "kvserve.model", "kvserve.build",
                                                     "kvserve.llm", "kvserve.text"))}
            assert not bad, f"{name} imports {sorted(bad)}"
    mods = sorted(n for n in graph if n.startswith(("kvserve.engine", "kvserve.kv")))
    code = f"import sys; import {', '.join(mods)}; print(sorted(m for m in ('torch', 'fastapi', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_modules_stay_small():
    big = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_every_module_says_what_it_owns():
    missing = [name for name, path in _modules().items()
               if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None]
    assert not missing, f"modules without a docstring: {missing}"


def test_only_kvserve_kernels_calls_the_native_ops():
    """The native kernels are reached through kvserve.kernels.ops, one wrapper per op with its fallback:
    no other module names ``torch.ops.kvserve`` or ``torch.classes.kvserve``."""
    kernels = ROOT / "kernels"
    direct = sorted(str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")
                    if kernels not in path.parents
                    and any(name in path.read_text() for name in ("torch.ops.kvserve", "torch.classes.kvserve")))
    assert not direct, f"call the native ops through kvserve.kernels.ops, not directly: {direct}"
