"""The measures of tools/trace_calls.py: the static import graph of the traced tree, and the
run-time recorder that counts calls, cross-module calls, upcalls, re-entries and the writers of
each class's instances (every definition is in trace_calls.py's docstring)."""

from __future__ import annotations

import ast
import enum
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

WORKER = "kvsched.worker_stub"
EXCLUDED = (WORKER, "kvsched.client", "kvsched.v1")
# Observability: the kvsched.server.telemetry package, and on the flat server/ layout (before
# 7831caf) the modules that moved into it (the rename map's telemetry rows).
OBS_PACKAGE = "kvsched.server.telemetry"
OBS_FLAT = frozenset(
    "kvsched.server." + m
    for m in [
        "metrics",
        "cluster_metrics",
        "host_metrics",
        "step_cost_metrics",
        "tenant_metrics",
        "histograms",
        "tracing",
        "tracing_setup",
        "spans",
        "otlp",
        "otlp_wire",
        "logs",
        "refusals",
    ]
)
_CONSTRUCTORS = frozenset({"__init__", "__post_init__", "__new__", "__setstate__"})


def module_of(frame: FrameType | None) -> str | None:
    """The daemon-side kvsched module a frame's code belongs to (None: not counted)."""
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    if not isinstance(name, str) or not (name == "kvsched" or name.startswith("kvsched.")):
        return None
    return None if name.startswith(EXCLUDED) else name


def daemon_stack(frame: FrameType | None) -> list[str] | None:
    """The counted kvsched modules of `frame` and the frames below it, nearest first, runs of
    one module collapsed; None if a worker frame is among them (the sim worker runs in this
    process: its calls into shared modules such as the codec are worker-side, not counted)."""
    mods: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith("kvsched"):
            if name.startswith(WORKER):
                return None
            if not name.startswith(EXCLUDED) and (not mods or mods[-1] != name):
                mods.append(name)
        frame = frame.f_back
    return mods


def is_observability(mod: str) -> bool:
    return mod == OBS_PACKAGE or mod.startswith(OBS_PACKAGE + ".") or mod in OBS_FLAT


def package_modules(root: Path) -> dict[str, Path]:
    """Every hand-written module of the package at `root` by dotted name (as tests/test_layout.py
    `_modules`: generated kvsched/v1 left out)."""
    mods: dict[str, Path] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent)
        if rel.parts[:2] == ("kvsched", "v1"):
            continue
        mods[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvsched modules it imports anywhere in its text (lazy imports inside
    functions and TYPE_CHECKING imports too); a submodule importing its own parent package is
    not an edge. A copy of tests/test_layout.py's `import_graph`, so that the tool reads any
    tree's graph without that tree's tests."""
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


def reachable(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> every module it imports directly or transitively."""
    out: dict[str, set[str]] = {}
    for start in edges:
        seen: set[str] = set()
        todo = list(edges[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges.get(m, ()))
        out[start] = seen
    return out


class Writers:
    """Attribute stores into instances of kvsched classes, by writing module, while started.

    Each class defined in a loaded daemon-side kvsched module (enums and protocols left out)
    gets a `__setattr__` that does the store (through the class's own `__setattr__` or the next
    one in its MRO) and then, if the store succeeded, records (class, writing module,
    attribute): `obj.f = v`, `obj.f += v` and `setattr(obj, "f", v)` alike, whatever the
    expression. The writing module is the nearest counted frame's at the store (a stdlib
    helper's kvsched caller); a store with a worker frame on its stack is worker-side, not
    recorded. A store by the object's own constructor (a frame of `__init__`, `__post_init__`,
    `__new__` or `__setstate__` whose first argument is that object) is construction, not a
    write. Not seen: stores bypassing `__setattr__` (`object.__setattr__` in frozen dataclasses,
    `obj.__dict__[k] = v`) and in-place changes of a container a field holds
    (`obj.xs.append(v)` writes the list, not a kvsched object)."""

    def __init__(self) -> None:
        self.fields: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
        self._patched: dict[type, Any] = {}
        self._first: dict[type, type | None] = {}

    def _first_patched(self, t: type) -> type | None:
        if t not in self._first:
            self._first[t] = next((c for c in t.__mro__ if c in self._patched), None)
        return self._first[t]

    def _record(self, obj: object, cls: type, name: str, frame: FrameType | None) -> None:
        if self._first_patched(type(obj)) is not cls:
            return  # a subclass's wrapper records it
        code = frame.f_code if frame is not None else None
        if (
            frame is not None
            and code is not None
            and code.co_name in _CONSTRUCTORS
            and code.co_argcount
            and frame.f_locals.get(code.co_varnames[0]) is obj
        ):
            return
        stack = daemon_stack(frame)
        if stack:
            self.fields[f"{cls.__module__}.{cls.__qualname__}"][stack[0]][name] += 1

    def _wrapper(self, cls: type, own: Any) -> Callable[[object, str, Any], None]:
        record = self._record

        def __setattr__(obj: object, name: str, value: Any) -> None:
            if own is not None:
                own(obj, name, value)
            else:
                super(cls, obj).__setattr__(name, value)  # type: ignore[misc]
            record(obj, cls, name, sys._getframe(1))

        return __setattr__

    def start(self) -> None:
        for modname, mod in list(sys.modules.items()):
            if module_of_name(modname) is None or mod is None:
                continue
            for obj in list(vars(mod).values()):
                if not isinstance(obj, type) or obj.__module__ != modname:
                    continue
                if issubclass(obj, enum.Enum) or getattr(obj, "_is_protocol", False):
                    continue  # enum members are fixed; protocols have no instances
                if obj in self._patched:
                    continue
                own = obj.__dict__.get("__setattr__")
                try:
                    type.__setattr__(obj, "__setattr__", self._wrapper(obj, own))
                except (TypeError, AttributeError):
                    continue
                self._patched[obj] = own
        self._first.clear()

    def stop(self) -> None:
        for cls, own in self._patched.items():
            if own is None:
                type.__delattr__(cls, "__setattr__")
            else:
                type.__setattr__(cls, "__setattr__", own)
        self._patched.clear()
        self._first.clear()

    def result(self) -> dict[str, Any]:
        per_class = {c: sorted(w) for c, w in sorted(self.fields.items())}
        worst = max(per_class.items(), key=lambda kv: (len(kv[1]), kv[0]), default=None)
        return {
            "classes_written": len(per_class),
            "extra_writers": sum(len(w) - 1 for w in per_class.values()),
            "worst_class": None if worst is None else {"class": worst[0], "writers": worst[1]},
            "writers": {
                c: {m: dict(sorted(f.items())) for m, f in sorted(w.items())}
                for c, w in sorted(self.fields.items())
            },
        }


def module_of_name(name: str) -> str | None:
    if not (name == "kvsched" or name.startswith("kvsched.")) or name.startswith(EXCLUDED):
        return None
    return name


class Recorder:
    """A sys.setprofile hook counting calls, modules, edges, upcalls and re-entries, with a
    `Writers` patch on for the same windows."""

    def __init__(self, reach: dict[str, set[str]]) -> None:
        self.reach = reach
        self.calls = self.cross = self.upcalls = self.reentries = self.obs = 0
        self.modules: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()
        self.up_edges: Counter[tuple[str, str]] = Counter()
        self.reentered: Counter[str] = Counter()
        self.writers = Writers()
        self.tokens = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        mod = module_of(frame)
        if mod is None:
            return
        below = daemon_stack(frame.f_back)
        if below is None:
            return
        self.calls += 1
        self.modules[mod] += 1
        caller = module_of(frame.f_back)
        if caller is not None and caller != mod:
            self.cross += 1
            self.edges[(caller, mod)] += 1
            if caller in self.reach.get(mod, ()):
                self.upcalls += 1
                self.up_edges[(caller, mod)] += 1
            if is_observability(caller) or is_observability(mod):
                self.obs += 1
        if below and below[0] != mod and mod in below:
            self.reentries += 1
            chain = [mod, *reversed(below[: below.index(mod)]), mod]
            self.reentered[" -> ".join(chain)] += 1

    def start(self) -> None:
        self.writers.start()
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        self.writers.stop()

    def result(self) -> dict[str, Any]:
        w = self.writers.result()
        return {
            "calls": self.calls,
            "modules": len(self.modules),
            "cross": self.cross,
            "edges": len(self.edges),
            "upcalls": self.upcalls,
            "reentries": self.reentries,
            "classes_written": w["classes_written"],
            "extra_writers": w["extra_writers"],
            "worst_class": w["worst_class"],
            "tokens": self.tokens,
            "cross_per_token": round(self.cross / self.tokens, 2) if self.tokens else None,
            "obs_cross": self.obs,
            "obs_share": round(self.obs / self.cross, 3) if self.cross else None,
            "per_module": dict(self.modules.most_common()),
            "per_edge": {f"{a} -> {b}": n for (a, b), n in self.edges.most_common()},
            "per_upcall": {f"{a} -> {b}": n for (a, b), n in self.up_edges.most_common()},
            "per_reentry": dict(self.reentered.most_common()),
            "writers": w["writers"],
        }
