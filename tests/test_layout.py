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


# ---- issue 22: one owner for each scheduler field ------------------------------------------

ROOT = PKG.parent
SCHED = PKG / "core" / "scheduler"
MAX_TOOL_LINES = 450  # bench/ and tools/: scripts, but read like the package
_MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "popleft",
    "push",
    "push_front",
    "remove",
    "reverse",
    "setdefault",
    "sort",
    "update",
}


def _self_attr(node: ast.AST, depth: int = 1) -> tuple[str, ...] | None:
    """(Y, X) for `self.Y.X` (depth 2), (X,) for `self.X` (depth 1); None otherwise."""
    path: list[str] = []
    for _ in range(depth):
        if not isinstance(node, ast.Attribute):
            return None
        path.append(node.attr)
        node = node.value
    return tuple(reversed(path)) if isinstance(node, ast.Name) and node.id == "self" else None


def _writes(cls: ast.ClassDef, depth: int) -> set[tuple[str, ...]]:
    """What a class's methods write through `self` (depth 1: its own fields) or through a
    reference it holds (depth 2: `self.other.X`): assigned, augmented, item-set or deleted, or
    changed by a mutating call."""
    out: set[tuple[str, ...]] = set()

    def target(t: ast.AST) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e)
            return
        if isinstance(t, ast.Subscript):
            t = t.value
        if (path := _self_attr(t, depth)) is not None:
            out.add(path)

    for n in ast.walk(cls):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                target(t)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            target(n.target)
        elif isinstance(n, ast.Delete):
            for t in n.targets:
                target(t)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in _MUTATORS
            and (path := _self_attr(n.func.value, depth))
        ):
            out.add(path)
    return out


def _held(cls: ast.ClassDef, classes: set[str]) -> dict[str, str]:
    """The class's references to other classes of the package: field -> class, from
    `self.f = param` (param annotated with the class) or `self.f = Class(...)`."""
    ann: dict[str, str] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for a in fn.args.args:
                if isinstance(a.annotation, ast.Name) and a.annotation.id in classes:
                    ann[a.arg] = a.annotation.id
    out: dict[str, str] = {}
    for n in ast.walk(cls):
        if not isinstance(n, ast.Assign):
            continue
        for t in n.targets:
            if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                pairs = list(zip(t.elts, n.value.elts, strict=False))
            else:
                pairs = [(t, n.value)]
            for tt, v in pairs:
                if (path := _self_attr(tt)) is None:
                    continue
                if isinstance(v, ast.Name) and v.id in ann:
                    out[path[0]] = ann[v.id]
                elif (
                    isinstance(v, ast.Call)
                    and isinstance(v.func, ast.Name)
                    and v.func.id in classes
                ):
                    out[path[0]] = v.func.id
    return out


def scheduler_field_writers(root: Path = SCHED) -> dict[str, set[str]]:
    """ "Class.field" -> the modules of the package that write it: the module of the class (its
    methods writing `self.field`), and any module whose class writes it through a reference
    to an object of that class (`self.other.field = ...`, `self.other.field.append(...)`)."""
    found = [
        (p.name, n)
        for p in sorted(root.glob("*.py"))
        for n in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(n, ast.ClassDef)
    ]
    classes = {cls.name for _, cls in found}
    writers: dict[str, set[str]] = {}
    for mod, cls in found:
        for (f,) in _writes(cls, 1):
            writers.setdefault(f"{cls.name}.{f}", set()).add(mod)
    for mod, cls in found:
        held = _held(cls, classes)
        for ref, f in _writes(cls, 2):
            if ref in held:
                writers.setdefault(f"{held[ref]}.{f}", set()).add(mod)
    return writers


def test_the_field_checker_sees_a_second_writer(tmp_path: Path) -> None:
    """The checker itself: a field written through another owner's reference is found; a class
    writing only its own fields (or calling the owner) is not."""
    (tmp_path / "a.py").write_text(
        "class A:\n    def __init__(self):\n        self.n = 0\n        self.xs = []\n"
    )
    (tmp_path / "b.py").write_text(
        "class B:\n    def __init__(self, a: A):\n        self.a, self.n = a, 0\n"
        "    def go(self):\n        self.a.xs.append(1)\n        self.a.n += 1\n"
    )
    w = scheduler_field_writers(tmp_path)
    assert w["A.xs"] == w["A.n"] == {"a.py", "b.py"} and w["B.n"] == {"b.py"}
    (tmp_path / "b.py").write_text(
        "class B:\n    def __init__(self, a: A):\n        self.a = a\n"
        "    def go(self):\n        self.a.grow()\n"
    )
    assert all(len(m) == 1 for m in scheduler_field_writers(tmp_path).values())


def test_no_scheduler_field_written_from_two_modules() -> None:
    """Each field of the scheduler's parts is written by one module (the mixins wrote 14 fields
    from 2-3 modules each). This covers the records the owners share too: each list of the
    `Events` record and each counter of `SchedulerStats` has one writing module."""
    shared = {f: sorted(m) for f, m in scheduler_field_writers().items() if len(m) > 1}
    assert not shared, f"scheduler fields written from more than one module: {shared}"


def test_scheduler_parts_compose_not_inherit() -> None:
    """No class of core/scheduler inherits another class of that package: owners are handed
    to each other, never stacked as mixins over one object."""
    trees = [ast.parse(p.read_text(), str(p)) for p in sorted(SCHED.glob("*.py"))]
    classes = {n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    bad = [
        f"{n.name}({b.id})"
        for t in trees
        for n in ast.walk(t)
        if isinstance(n, ast.ClassDef)
        for b in n.bases
        if isinstance(b, ast.Name) and b.id in classes
    ]
    assert not bad, f"classes inheriting a class of the scheduler package: {bad}"


def test_only_the_engine_reads_a_scheduler() -> None:
    """Nothing but server/instances/engine.py reads `.sched`: the layers above read the facts an engine
    publishes (snapshot, load facts, epoch, counters, KV events)."""
    engine = PKG / "server" / "instances" / "engine.py"
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in _modules().values()
        if p != engine
        for n in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(n, ast.Attribute) and n.attr == "sched"
    )
    assert not readers, f"modules reading .sched besides server/instances/engine.py: {readers}"


def test_no_bench_or_tool_over_the_size_limit() -> None:
    files = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    big = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_TOOL_LINES
    }
    assert not big, f"bench/tools files over {MAX_TOOL_LINES} lines (split along a seam): {big}"


def test_server_imports_neither_cluster_nor_durability() -> None:
    """`server/` defines the seams (the engine listener, the journal port, the request table's
    and registry's hooks); the composition root `kvsched/daemon/` imports `server/`, `cluster/`
    and `durability/` and plugs the latter two in. No server module imports either of them,
    lazily or for type checking."""
    graph = import_graph(_modules())
    bad = {
        m: sorted(t for t in targets if t.startswith(("kvsched.cluster", "kvsched.durability")))
        for m, targets in graph.items()
        if m.startswith("kvsched.server")
    }
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"server modules importing cluster/ or durability/: {bad}"


def test_telemetry_reads_values() -> None:
    """Telemetry is handed values (server/telemetry/values.py): no telemetry module imports an
    engine, the request table or the composition root, lazily or for types, nor reads an
    `engines`, `daemon` or `sched` attribute to reach them."""
    mods = _modules()
    tele = {m: p for m, p in mods.items() if m.startswith("kvsched.server.telemetry")}
    assert tele, "no telemetry modules found"
    allowed = ("kvsched.core", "kvsched.server.config", "kvsched.server.telemetry")
    graph = import_graph(mods)
    bad = sorted(f"{m} -> {t}" for m in tele for t in graph[m] if not t.startswith(allowed))
    assert not bad, f"telemetry imports beyond core, config and itself: {bad}"
    reach = {"engines", "daemon", "sched"}
    reads = sorted(
        f"{m}:{n.lineno} .{n.attr}"
        for m, p in tele.items()
        for n in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(n, ast.Attribute) and n.attr in reach
    )
    assert not reads, f"telemetry reaching for the daemon's parts: {reads}"
