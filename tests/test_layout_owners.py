"""docs/ARCHITECTURE.md's module map, checked on the source: every row's "may import" cell
holds every kvsched module that row's module imports (lazily and for type checking too), and
each field of a request's record (`Tracked`, server/requests/record.py) is written by the one module
the map names as its owner."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvsched.core.lifecycle import LIFECYCLE_FIELDS
from tests.test_layout import PKG, ROOT, _modules, import_graph

DOC = ROOT / "docs" / "ARCHITECTURE.md"
THIRD_PARTY = {"vllm", "torch", "transformers", "tokenizers", "v1"}  # v1: generated, unmapped
NOTHING = {"—", "-", "", "nothing of kvsched"}


def doc_rows(text: str) -> list[tuple[str, str, str]]:
    """(package, module cell, may-import cell) of every table row of the map's sections
    `### kvsched/<pkg>/` and `### The rest` (package "")."""
    pkg: str | None = None
    rows = []
    for line in text.splitlines():
        if m := re.match(r"### `kvsched/([\w/]+)/`", line):
            pkg = m.group(1).replace("/", ".")
        elif line.startswith("### "):
            pkg = "" if line.strip() == "### The rest" else None
        elif pkg is not None and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((pkg, cells[0], cells[-1]))
    return rows


def row_modules(cell: str, pkg: str) -> list[str]:
    """The dotted modules (or packages) a row's first cell names; outside kvsched: none."""
    out = []
    for name in re.findall(r"`([^`]+)`", cell):
        name = name.removesuffix(".py").removesuffix("/").removesuffix("/__init__")
        name = name.replace("/", ".")
        if pkg:
            out.append(f"kvsched.{pkg}.{name}")
        elif name.startswith("kvsched."):
            out.append(name)
    return out


def allowed_imports(
    cell: str, row: str, pkg: str, above: list[str], mods: dict[str, Path]
) -> set[str] | None:
    """The modules a may-import cell allows (each entry: itself and what is inside it); None
    for "everything" (cli). Parenthesised text is a comment. A name is looked up beside the
    row's module, then in its package, then in kvsched; "everything above" / "the parts
    above": the rows above in the same table; a name that is no module fails the test."""
    text = re.sub(r"\([^)]*\)", "", cell).strip()
    if text in NOTHING:
        return set()
    allowed: set[str] = set()
    for tok in (t.strip() for t in text.split(",")):
        tok = tok.removesuffix(" below").removeprefix("everything in ").strip().rstrip("/")
        if tok == "everything":
            return None
        if tok in ("everything above", "the parts above"):
            allowed |= set(above)
            continue
        if tok in THIRD_PARTY:
            continue
        here = row.rsplit(".", 1)[0]
        for cand in (f"{here}.{tok}", f"kvsched.{pkg}.{tok}", f"kvsched.{tok}"):
            if cand in mods or any(m.startswith(cand + ".") for m in mods):
                allowed.add(cand)
                break
        else:
            raise AssertionError(f"ARCHITECTURE.md row {row}: {tok!r} names no module")
    return allowed


def undeclared_imports(text: str, mods: dict[str, Path]) -> list[str]:
    graph = import_graph(mods)
    bad: list[str] = []
    above: list[str] = []
    last = None
    for pkg, mcell, icell in doc_rows(text):
        if pkg != last:
            above, last = [], pkg
        names = row_modules(mcell, pkg)
        for name in names:
            inside = [m for m in mods if m == name or m.startswith(name + ".")]
            if not inside:
                bad.append(f"{name}: a row of the map names no module")
                continue
            allowed = allowed_imports(icell, name, pkg, above, mods)
            if allowed is None:
                continue
            for m in inside:
                for imp in sorted(graph[m]):
                    if imp == name or imp.startswith(name + ".") or name.startswith(imp + "."):
                        continue  # within the row's own package, or the package it is in
                    if not any(imp == a or imp.startswith(a + ".") for a in allowed):
                        bad.append(f"{m} imports {imp}; its row allows {sorted(allowed)}")
        above += names
    return bad


def test_the_import_checker_sees_an_undeclared_import(tmp_path: Path) -> None:
    """The checker itself: an import its row does not list is found; one it lists is not."""
    pkg = tmp_path / "kvsched"
    (pkg / "server").mkdir(parents=True)
    for f in ("__init__.py", "server/__init__.py", "server/a.py"):
        (pkg / f).write_text("")
    (pkg / "server" / "b.py").write_text("from kvsched.server import a\n")
    mods = _modules(pkg)
    table = "### `kvsched/server/` — x\n\n| module | owns | may import |\n|---|---|---|\n"
    rows = "| `a.py` | a | — |\n| `b.py` | b | {} |\n"
    assert undeclared_imports(table + rows.format("—"), mods) == [
        "kvsched.server.b imports kvsched.server.a; its row allows []"
    ]
    assert undeclared_imports(table + rows.format("a"), mods) == []
    assert undeclared_imports(table + rows.format("everything above"), mods) == []


def test_every_module_imports_only_what_its_row_allows() -> None:
    """Each row of docs/ARCHITECTURE.md's module map is a contract: the kvsched modules its
    module imports are among those its "may import" cell names."""
    bad = undeclared_imports(DOC.read_text(), _modules())
    assert not bad, "imports docs/ARCHITECTURE.md does not allow:\n" + "\n".join(bad)


def _docstring_only(p: Path) -> bool:
    """A package's `__init__.py` that holds its one-line docstring and nothing else."""
    body = ast.parse(p.read_text()).body
    return p.name == "__init__.py" and all(
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body
    )


def test_every_module_has_a_row() -> None:
    """Every hand-written module of the daemon's packages is in the map."""
    named: set[str] = set()
    for pkg, cell, _ in doc_rows(DOC.read_text()):
        named |= set(row_modules(cell, pkg))
    mods = _modules()
    missing = sorted(
        m
        for m in mods
        if m.count(".") >= 2
        and m.split(".")[1] in ("core", "server", "cluster", "durability", "daemon", "codec")
        and not any(m == n or m.startswith(n + ".") for n in named)
        and not _docstring_only(mods[m])
    )
    assert not missing, f"modules without a row in docs/ARCHITECTURE.md: {missing}"


# ---- one writer per field of a request's record ---------------------------------------------

RECORD = PKG / "server" / "requests" / "record.py"
# The owner of each field of `Tracked` (docs/ARCHITECTURE.md, server/requests/record.py's docstring);
# a field not listed here is set at construction and never written again.
TRACKED_OWNERS = {
    "req": "server/requests/table.py",
    "location": "server/requests/table.py",
    "sink": "server/requests/table.py",
    "decode_engine": "server/requests/table.py",
    "finished": "server/requests/table.py",
    "out_at_place": "server/requests/table.py",
    "pd_msg": "server/requests/table.py",
    "journal_state": "durability/journal.py",
    "journaled": "durability/journal.py",
    "span": "server/telemetry/tracing.py",
    "losses": "server/requests/poison.py",
}
RECORD_TYPES = {"Tracked", "Journaled"}
RECORD_NAME = "tr"  # the package's name for a request record wherever it is not annotated


def record_fields(path: Path = RECORD) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    (cls,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Tracked"]
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def _record_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names that hold a record in `fn`: `tr`, parameters annotated with a record type,
    and names bound to `Tracked(...)`."""
    names = {RECORD_NAME}
    args = fn.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        ann = a.annotation
        label = ann.id if isinstance(ann, ast.Name) else getattr(ann, "value", None)
        if label in RECORD_TYPES:
            names.add(a.arg)
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name)
            and n.value.func.id == "Tracked"
        ):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def record_field_writers(root: Path = PKG, fields: set[str] | None = None) -> dict[str, set[str]]:
    """field -> the modules (paths relative to the package) that assign it on a record after
    construction: `tr.f = ...`, `a, tr.f = ...`, `tr.f += ...`, `del tr.f`, `setattr(tr, "f",
    ...)`, or a record's own method assigning `self.f`."""
    fields = record_fields() if fields is None else fields
    out: dict[str, set[str]] = {}
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        tree = ast.parse(p.read_text(), str(p))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            names = _record_names(fn)
            if p.name == "record.py":
                names.add("self")

            def target(t: ast.AST, names: set[str] = names, rel: str = rel) -> None:
                if isinstance(t, ast.Tuple | ast.List):
                    for e in t.elts:
                        target(e)
                elif (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in names
                    and t.attr in fields
                ):
                    out.setdefault(t.attr, set()).add(rel)

            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        target(t)
                elif isinstance(n, ast.AugAssign | ast.AnnAssign):
                    target(n.target)
                elif isinstance(n, ast.Delete):
                    for t in n.targets:
                        target(t)
                elif (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name)
                    and n.func.id == "setattr"
                    and len(n.args) >= 2
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id in names
                    and isinstance(n.args[1], ast.Constant)
                    and n.args[1].value in fields
                ):
                    out.setdefault(str(n.args[1].value), set()).add(rel)
    return out


def test_the_record_checker_sees_a_second_writer(tmp_path: Path) -> None:
    """The checker itself: writes through `tr`, an annotated parameter, a tuple target and
    setattr are found; reading a field or writing another object's attribute is not."""
    (tmp_path / "a.py").write_text(
        "def f(tr):\n    tr.sink = 1\n    x.sink = 2\n    y = tr.req\n"
        "def g(rec: Tracked):\n    a, rec.req = 1, 2\n"
    )
    (tmp_path / "b.py").write_text("def h(tr):\n    setattr(tr, 'sink', 3)\n")
    got = record_field_writers(tmp_path, {"sink", "req"})
    assert got == {"sink": {"a.py", "b.py"}, "req": {"a.py"}}


def test_each_record_field_has_one_writer() -> None:
    """A request record's fields are each written by the one module that owns them (the old
    `Tracked` had 14 fields written from 6 modules in 3 packages)."""
    fields = record_fields()
    assert set(TRACKED_OWNERS) <= fields, sorted(set(TRACKED_OWNERS) - fields)
    writers = record_field_writers(PKG, fields)
    wrong = {
        f: sorted(mods)
        for f, mods in writers.items()
        if mods != {TRACKED_OWNERS.get(f, "(set at construction only)")}
    }
    assert not wrong, f"record fields written outside their owner: {wrong}"


def test_locations_are_tagged_values() -> None:
    """A record's location is one of three tagged values, never an engine or a sentinel:
    nothing in the package builds a `Tracked` with anything but `LocalEngine(...)`,
    `RemotePeer(...)` or `Parked(...)` as its location (positional or keyword)."""
    tags = {"LocalEngine", "RemotePeer", "Parked"}
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if not (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Tracked"):
                continue
            loc = n.args[1] if len(n.args) > 1 else None
            loc = next((k.value for k in n.keywords if k.arg == "location"), loc)
            if not (isinstance(loc, ast.Call) and getattr(loc.func, "id", "") in tags):
                bad.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert not bad, f"records built with an untagged location: {bad}"


# ---- packages point down, and who owns the engines --------------------------------------------

# docs/ARCHITECTURE.md section 1, bottom to top: a package imports only packages of lower levels.
LEVELS = [
    {"core"},
    {"codec", "tls", "heap", "event_loop", "data", "traces", "tinymodel", "storage"},
    {"durability", "client"},
    {"server", "worker_stub", "replay", "http"},
    {"worker_vllm"},
    {"cluster"},
    {"daemon"},
    {"cli_generate", "demo", "demo_args"},
    {"cli"},
]
# The upward imports the map declares (each lazy, inside a function): the reference worker's
# `--executor vllm` branch, and a replay of several daemons starting a local nats-server.
UPWARD = {
    ("kvsched.worker_stub.client", "kvsched.worker_vllm.cli"),
    ("kvsched.replay.launch", "kvsched.cluster.natsd"),
}


def _package(m: str) -> str:
    return m.split(".")[1]


def test_packages_import_down_only() -> None:
    """Section 1's layers: every import between two of kvsched's packages points to a lower
    level, but for the two lazy upward imports the map names."""
    level = {p: i for i, ps in enumerate(LEVELS) for p in ps}
    mods = _modules()
    assert {_package(m) for m in mods if m.count(".")} <= set(level), "a package has no level"
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in import_graph(mods).items()
        if m.count(".")
        for t in targets
        if _package(t) != _package(m)
        and level[_package(t)] >= level[_package(m)]
        and (m, t) not in UPWARD
    )
    assert not bad, f"imports that do not point down: {bad}"


def test_only_the_registry_writes_the_engines() -> None:
    """`InstanceRegistry` owns the engines (one per instance): no other module adds, replaces
    or removes an entry of an `engines` mapping (others read the registry's)."""
    writers = set()
    for p in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            targets: list[ast.AST] = []
            if isinstance(n, ast.Assign | ast.Delete):
                targets = list(n.targets)
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("pop", "clear", "update", "setdefault", "popitem")
            ):
                targets = [n.func.value]
            for t in targets:
                t = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(t, ast.Attribute) and t.attr == "engines":
                    writers.add(str(p.relative_to(PKG)))
    assert writers == {"server/instances/registry.py"}, sorted(writers)


# ---- one writer per field of a core request ------------------------------------------------

# The owner of each of a core `Request`'s fields that change over its life (the issue's "one
# request, one state machine"): its lifecycle fields the lifecycle module, its tokens the slot
# table, its blocks the KV cache manager, its hashes the block hasher. A field not listed has
# several writers of one scheduler's placement (handle, slot, computed counts) or is set at
# construction.
REQUEST_OWNERS = {f: "core/lifecycle.py" for f in LIFECYCLE_FIELDS} | {
    "_out": "core/slots.py",
    "_rows": "core/slots.py",
    "_epoch": "core/slots.py",
    "_reported": "core/slots.py",
    "check_out": "core/slots.py",
    "output_token_ids": "core/slots.py",
    "num_reported_tokens": "core/slots.py",
    "block_ids": "core/kv_cache_manager.py",
    "num_cached_blocks": "core/kv_cache_manager.py",
    "block_hashes": "core/block_hash.py",
}
TOKEN_PRIVATES = {"_out", "_rows", "_epoch", "_reported"}
# The packages that hold core requests (the reference and vLLM workers have their own records).
REQUEST_PACKAGES = ("core", "server", "cluster", "durability", "daemon", "codec")
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "reverse", "sort"}


def _field_of(t: ast.AST, fields: set[str]) -> str | None:
    """The request field `t` names: `x.f` or `x.f[i]` where x is a plain name other than
    `self` (another class's own field) or a record's `.req` (`tr.req.f`); `a.b.f` is some
    other object's (a proto message's, the stats')."""
    if isinstance(t, ast.Subscript):
        t = t.value
    if not (isinstance(t, ast.Attribute) and t.attr in fields):
        return None
    base = t.value
    if isinstance(base, ast.Name) and base.id != "self":
        return t.attr
    if isinstance(base, ast.Attribute) and base.attr == "req":
        return t.attr
    return None


def request_field_writers(root: Path, fields: set[str]) -> dict[str, set[str]]:
    """field -> the modules (paths relative to `root`) that write it on another object: an
    assignment, augmented assignment or del of `x.f` / `x.f[i]`, `x.f.append(...)` and the
    list's other mutators, or `setattr(x, "f", ...)`."""
    out: dict[str, set[str]] = {}
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        if rel.split("/")[0] not in REQUEST_PACKAGES:
            continue
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            targets: list[ast.AST] = []
            if isinstance(n, ast.Assign | ast.Delete):
                for t in n.targets:
                    targets += t.elts if isinstance(t, ast.Tuple | ast.List) else [t]
            elif isinstance(n, ast.AugAssign | ast.AnnAssign):
                targets = [n.target]
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS
            ):
                targets = [n.func.value]
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "setattr"
                and len(n.args) >= 2
                and isinstance(n.args[1], ast.Constant)
                and n.args[1].value in fields
            ):
                out.setdefault(str(n.args[1].value), set()).add(rel)
            for t in targets:
                if (f := _field_of(t, fields)) is not None:
                    out.setdefault(f, set()).add(rel)
    return out


def private_token_readers(root: Path) -> set[str]:
    """Modules outside core/request.py and core/slots.py that touch a request's private token
    fields (`x._out`, `x._rows`, `x._epoch`, `x._reported`, x not `self`)."""
    bad = set()
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(root))
        if rel in ("core/request.py", "core/slots.py") or rel.split("/")[0] not in REQUEST_PACKAGES:
            continue
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if _field_of(n, TOKEN_PRIVATES) is not None:
                bad.add(rel)
    return bad


def test_the_request_checker_sees_a_second_writer(tmp_path: Path) -> None:
    """The checker itself: an assignment, a tuple target, a list mutator and setattr on a
    request are found; `self.f` (another class's own field) and reads are not."""
    core = tmp_path / "core"
    core.mkdir()
    (core / "a.py").write_text(
        "def f(req, r):\n"
        "    req.status = 1\n"
        "    x, r.finished_time = 1, 2\n"
        "    req.block_ids.extend([3])\n"
        "    setattr(req, 'demoted', True)\n"
        "    y = req._out\n"
    )
    (core / "b.py").write_text(
        "class C:\n    def g(self, req):\n        self.status = 2\n        return req.status\n"
    )
    fields = {"status", "finished_time", "block_ids", "demoted"}
    assert request_field_writers(tmp_path, fields) == {
        "status": {"core/a.py"},
        "finished_time": {"core/a.py"},
        "block_ids": {"core/a.py"},
        "demoted": {"core/a.py"},
    }
    assert private_token_readers(tmp_path) == {"core/a.py"}


def test_each_request_field_has_one_writer() -> None:
    """A core request's lifecycle fields are written by core/lifecycle.py alone, its tokens by
    core/slots.py, its blocks by core/kv_cache_manager.py, its hashes by core/block_hash.py;
    no other module reads its private token fields."""
    writers = request_field_writers(PKG, set(REQUEST_OWNERS))
    bad = {
        f: sorted(mods)
        for f, mods in writers.items()
        if mods - {REQUEST_OWNERS[f], "core/request.py"}
    }
    assert not bad, f"request fields written outside their owner module: {bad}"
    assert set(LIFECYCLE_FIELDS) <= set(writers), "a lifecycle field nobody writes?"
    assert not private_token_readers(PKG)
