"""The layout rules of docs/ARCHITECTURE.md, checked on the source: no import circle among
kvsched's modules (lazy imports inside functions and TYPE_CHECKING imports count too: a circle
is a circle to the reader), no hand-written module over 500 lines, and nothing in the package
that reaches outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kvsched"
MAX_LINES = 500


def _modules(root: Path = PKG) -> dict[str, Path]:
    """Every hand-written module of the package by dotted name (generated code excluded)."""
    mods: dict[str, Path] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent)
        if rel.parts[:2] == ("kvsched", "v1"):
            continue
        name = ".".join(rel.with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvsched modules it imports anywhere in its text. A submodule importing its
    own parent package is not an edge (that is how packages load)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                cands = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            edges[m] |= {c for c in cands if c in mods and c != m and not m.startswith(c + ".")}
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_checker_sees_a_circle(tmp_path: Path) -> None:
    """The checker itself: a two-module circle through a lazy import is found, a chain is not."""
    pkg = tmp_path / "kvsched"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from kvsched.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from kvsched.sub.a import x\n")
    mods = _modules(pkg)
    assert find_cycles(import_graph(mods)) == [["kvsched.sub.a", "kvsched.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert find_cycles(import_graph(_modules(pkg))) == []


def test_no_import_circles() -> None:
    cycles = find_cycles(import_graph(_modules()))
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_the_size_limit() -> None:
    big = {
        m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines (split along a seam): {big}"


@pytest.mark.parametrize("needle", ["../shared", "shared/data", "DESIGN section", "STYLE rule"])
def test_the_package_stands_on_its_own(needle: str) -> None:
    """No module reads or cites a file outside the repository (our own docs live in docs/)."""
    hits = [str(p) for p in _modules().values() if needle in p.read_text()]
    assert not hits, f"{needle!r} in {hits}"


DAEMON_PACKAGES = ("kvsched.server", "kvsched.core", "kvsched.cluster", "kvsched.durability")


def _imports_of(p: Path) -> set[str]:
    """Every module name `p` imports, anywhere in its text (absolute imports)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def _reach(edges: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
        for w in edges[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_daemon_never_imports_vllm() -> None:
    """vLLM is the `vllm` extra's, for the worker only: no daemon module reaches the vLLM worker
    package or vLLM itself, through any chain of kvsched imports (lazy ones included)."""
    mods = _modules()
    daemon = {m for m in mods if m.startswith(DAEMON_PACKAGES)}
    assert daemon, "no daemon modules found"
    reached = _reach(import_graph(mods), daemon)
    assert not [m for m in reached if m.startswith("kvsched.worker_vllm")], sorted(reached)
    bad = {m for m in reached if any(n.split(".")[0] == "vllm" for n in _imports_of(mods[m]))}
    assert not bad, f"daemon modules reaching an `import vllm`: {sorted(bad)}"


def test_the_vllm_worker_imports_vllm_lazily() -> None:
    """kvsched.worker_vllm imports vLLM only inside functions: the package and `kvsched worker
    --help` load without the extra."""
    for m, p in _modules().items():
        if not m.startswith("kvsched.worker_vllm"):
            continue
        tree = ast.parse(p.read_text(), str(p))
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not [n for n in names if n.split(".")[0] in ("vllm", "torch")], (m, names)
