"""The package's shape: layers import downward only, no import cycles, modules of one idea."""

from __future__ import annotations

import ast
import re
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


# The C++ kernels: files of one idea too, and functions short enough to read. A body is a `{` that
# follows a `)` (a function, method or lambda with parameters; `const`, `noexcept`, `override`,
# `final`, `mutable` or a `-> type` may stand between) or a `]` (a lambda without parameters); a
# constructor's initializer list ends in `)`. The `)` of `if`, `for`, `while`, `switch` and `catch`
# opens a block, not a body.
CSRC = ROOT / "kernels" / "csrc"
MAX_CPP_BODY_LINES = 80
_CONTROL = {"if", "for", "while", "switch", "catch"}
_QUALIFIER = re.compile(r"(?:\s*\b(?:const|noexcept|override|final|mutable)\b)*\s*(?:->\s*[\w:<>,*&\s]+?)?\s*$")


def _strip_cpp(text: str) -> str:
    """``text`` with comments, string and char literals and preprocessor lines blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and text[i:].lstrip(" \t").startswith("#"):
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j, n - 1) + 1 - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
        line_start = c == "\n" or (line_start and c in " \t")
    return "".join(out)


def _name_before(code: str, open_: int) -> tuple[str, int]:
    """The identifier before the ``(`` at ``open_``, and where it starts."""
    word = re.search(r"([\w~:<>]*)\s*$", code[:open_])
    return word.group(1), word.start(1)


def _opens_body(code: str, brace: int, parens: dict[int, int]) -> str | None:
    """The name of the function (or "lambda") whose body the ``{`` at ``brace`` opens, else None."""
    head = code[max(0, brace - 300):brace]
    m = _QUALIFIER.search(head)
    before = head[:m.start()].rstrip() if m else head.rstrip()
    if before.endswith("]") and not (m and m.group(0).strip()):
        return "lambda"
    if not before.endswith(")"):
        return None
    close = brace - (len(head) - len(before)) - 1
    open_ = parens.get(close)
    if open_ is None:
        return None
    name, at = _name_before(code, open_)
    if name in _CONTROL:
        return None
    # a constructor's initializer list: back over its `member(...)` and `member{...}`, to the constructor's name
    while True:
        prev = code[:at].rstrip()
        if not prev.endswith((",", ":")) or prev.endswith("::") or not prev[:-1].rstrip().endswith((")", "}")):
            break
        open_ = parens.get(len(prev[:-1].rstrip()) - 1)
        if open_ is None:
            break
        name, at = _name_before(code, open_)
        if prev.endswith(":"):
            break
    if code[:open_].rstrip().endswith("]"):
        return "lambda"
    return name or "?"


def cpp_bodies(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function, method and lambda body in C++ source ``text``."""
    code = _strip_cpp(text)
    parens, stacks = {}, {")": [], "}": []}  # where each ) and } opens
    for i, c in enumerate(code):
        if c in "({":
            stacks[")" if c == "(" else "}"].append(i)
        elif c in ")}" and stacks[c]:
            parens[i] = stacks[c].pop()
    bodies, braces = [], []
    for i, c in enumerate(code):
        if c == "{":
            braces.append((i, _opens_body(code, i, parens)))
        elif c == "}" and braces:
            start, name = braces.pop()
            if name is not None:
                first, last = code.count("\n", 0, start) + 1, code.count("\n", 0, i) + 1
                bodies.append((name, first, last - first + 1))
    return bodies


def _cpp_files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h"))


def test_cpp_files_stay_small():
    big = {p.relative_to(CSRC).as_posix(): n for p in _cpp_files()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"C++ files over {MAX_MODULE_LINES} lines: {big}"


def test_cpp_functions_stay_short():
    long = [f"{p.relative_to(CSRC).as_posix()}:{line} {name} ({n} lines)" for p in _cpp_files()
            for name, line, n in cpp_bodies(p.read_text()) if n > MAX_CPP_BODY_LINES]
    assert not long, f"C++ function bodies over {MAX_CPP_BODY_LINES} lines: {long}"


def test_cpp_sources_have_distinct_names():
    # torch's extension build names each object file after its source's file name alone
    names = [p.name for p in _cpp_files() if p.suffix == ".cpp"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_cpp_includes_are_written_from_csrc():
    # the build's one include path is csrc/: a kvserve header is named by its folder there
    bad = [f"{p.relative_to(CSRC).as_posix()}: {m.group(0)}" for p in _cpp_files()
           for m in re.finditer(r'#include "([^"]+)"', p.read_text()) if not (CSRC / m.group(1)).is_file()]
    assert not bad, bad


def test_the_cpp_scanner_finds_bodies_and_skips_blocks():
    src = '''
    int f(int a) const noexcept {  // a { in a comment
      if (a) { return 1; }
      auto g = [&](int x) -> int {
        const char* s = "}{";
        return x;
      };
      auto h = [] { return '{'; };
      return g(a);
    }
    #define X(a) { a }
    struct S : B {
      S(int v) : v_(v), u_{v}, w_(v) {}
      int v_, u_, w_;
    };
    '''
    got = {(name, line, n) for name, line, n in cpp_bodies(src)}
    assert got == {("f", 2, 9), ("lambda", 4, 4), ("lambda", 8, 1), ("S", 13, 1)}, got
