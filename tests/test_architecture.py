"""The house rules the code keeps, checked over the source's syntax trees: the simulator and
the replay driver are built from collaborators, not mixins, and each piece of their mutable
state has one owner, the module that defines its class; packages import down, never in a
cycle; no module grows past the line limit; the simulator side imports no torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(os.environ.get("SLICESCHED_SRC") or Path(__file__).resolve().parents[1] / "src") / "slicesched"
OWNED = ("sim", "replay")  # packages whose classes' attributes must have a single writer
MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
                      "add", "discard", "sort", "reverse", "fill"})
HEAP_WRITERS = frozenset({"heappush", "heappop", "heapify", "heapreplace", "heappushpop"})


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py"))}


def _package(module: str) -> str:
    return module.split("/")[0]


def _owned(module: str) -> bool:
    return _package(module) in OWNED


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    """Names a class gives its instances: annotated class fields and `self.X` targets."""
    names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_name(node.value, "self"):
            names.add(node.attr)
    return names


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _written(node: ast.AST) -> ast.Attribute | None:
    """The attribute a statement or call writes (through assignment, subscripts or a mutator)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def _writes(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(attribute, class name when written through `self` in that class's methods, else None)."""
    out: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = [node.target]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS:
                targets = [f.value]
            elif (isinstance(f, ast.Attribute) and f.attr in HEAP_WRITERS or _is_name(f, "heappush")
                  or isinstance(f, ast.Name) and f.id in HEAP_WRITERS) and node.args:
                targets = [node.args[0]]
            elif _is_name(f, "setattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                out.append((str(node.args[1].value), None))
        for t in targets:
            for el in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                el = el.value if isinstance(el, ast.Starred) else el
                a = _written(el)
                if a is not None:
                    out.append((a.attr, cls if _is_name(a.value, "self") else None))
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return out


def _owned_classes(mods: dict[str, ast.Module]) -> dict[str, tuple[str, set[str]]]:
    """"module:Class" -> (defining module, attributes) for every class in the owned packages."""
    out = {}
    for name, tree in mods.items():
        if _owned(name):
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    out[f"{name}:{node.name}"] = (name, _class_attrs(node))
    return out


def single_writer_violations() -> list[str]:
    mods = _modules()
    classes = _owned_classes(mods)
    by_attr: dict[str, list[str]] = defaultdict(list)
    for cls, (_, attrs) in classes.items():
        for a in attrs:
            by_attr[a].append(cls)
    attrs_of = {m: set().union(*(_class_attrs(n) for n in ast.walk(t) if isinstance(n, ast.ClassDef)))
                for m, t in mods.items()}
    writers: dict[tuple[str, str], set[str]] = defaultdict(set)  # (class, attr) -> modules writing it
    for module, tree in mods.items():
        package = _package(module)
        near = set().union(*(a for m, a in attrs_of.items() if _package(m) == package))
        reachable = _imported_units(module, tree) | {package}  # objects it can hold come from these
        for attr, cls in _writes(tree):
            if cls is None and (attr in attrs_of[module] or not _owned(module) and attr in near):
                continue  # through another object, of a name this module's (package's) own classes have
            cls = None if cls is None else f"{module}:{cls}"
            if cls in classes and attr not in classes[cls][1]:
                cls = None  # through self, an attribute its class does not set: whoever has that name
            owners = [cls] if cls in classes else ([] if cls is not None else by_attr.get(attr, []))
            if cls is None:  # a class of a package this module does not import is not what it writes
                owners = [c for c in owners if _unit(classes[c][0]) in reachable]
                if _owned(module):
                    owners = [c for c in owners if _package(classes[c][0]) == package] or owners
            for c in owners:
                if attr in classes[c][1]:
                    writers[(c, attr)].add(module)
    return sorted(f"{c}.{a} written in {sorted(m - {classes[c][0]})}"
                  for (c, a), m in writers.items() if m - {classes[c][0]})


def mixin_classes() -> list[str]:
    """Classes in the owned packages that hold no state of their own and exist to be bases."""
    mods = _modules()
    out = []
    for name, tree in mods.items():
        if not _owned(name):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin"):
                out.append(f"{name}:{node.name}")
    bases = defaultdict(list)
    for name, tree in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and len(node.bases) > 1:
                for b in node.bases:
                    if isinstance(b, ast.Name):
                        bases[b.id].append(node.name)
    for name, tree in mods.items():
        if _owned(name):
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name in bases and f"{name}:{node.name}" not in out:
                    out.append(f"{name}:{node.name} (a base of {bases[node.name]} beside others)")
    return out


@pytest.mark.parametrize("package", ["replay", "sim"])
def test_no_mixins(package: str) -> None:
    assert [m for m in mixin_classes() if m.startswith(package + "/")] == []


@pytest.mark.parametrize("package", ["replay", "sim"])
def test_state_has_one_writer(package: str) -> None:
    assert [v for v in single_writer_violations() if v.startswith(package + "/")] == []


@pytest.mark.parametrize("source, expected", [
    ("class A:\n    def f(self):\n        self.x = 1\n", [("x", "A")]),
    ("def f(o):\n    o.x[1][2] += 1\n", [("x", None)]),
    ("def f(o):\n    o.q.append(1)\n", [("q", None)]),
    ("import heapq\ndef f(o):\n    heapq.heappush(o.h, 1)\n", [("h", None)]),
    ("def f(o):\n    del o.d[3]\n", [("d", None)]),
    ("def f(o):\n    o.a, o.b = 1, 2\n", [("a", None), ("b", None)]),
    ("def f(o):\n    setattr(o, 'z', 1)\n", [("z", None)]),
    ("def f(o):\n    return o.x.get(1)\n", []),
])
def test_writes_are_found(source: str, expected: list) -> None:
    assert _writes(ast.parse(source)) == expected


# ---- layers ---------------------------------------------------------------------------------
MAX_MODULE_LINES = 600


def _unit(module: str) -> str:
    """The layer a module belongs to: its top-level package, or itself for a top-level module."""
    return module.split("/")[0].removesuffix(".py")


def _imported_units(module: str, tree: ast.Module) -> set[str]:
    """Top-level packages of slicesched a module imports (at the top or inside functions)."""
    out = set()
    parent = module.split("/")[:-1]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = parent[:len(parent) - node.level + 1]
                names = [".".join(["slicesched", *base, *([node.module] if node.module else [])])]
            elif node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "slicesched" and len(parts) > 1:
                out.add(parts[1])
    return out


def import_graph() -> dict[str, set[str]]:
    units = {_unit(m) for m in _modules()}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, tree in _modules().items():
        graph[_unit(module)] |= {u for u in _imported_units(module, tree) if u in units and u != _unit(module)}
    return graph


def import_cycles() -> list[list[str]]:
    """Every elementary cycle's smallest rotation, found by depth-first search from each unit."""
    graph, cycles = import_graph(), set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                i = path.index(min(path))
                cycles.add(tuple(path[i:] + path[:i]))
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return [list(c) for c in sorted(cycles)]


def test_packages_import_without_cycles() -> None:
    assert import_cycles() == []


def test_cycle_finder_sees_a_two_package_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: {"a": {"b"}, "b": {"a", "c"}, "c": set()})
    assert import_cycles() == [["a", "b"]]


def test_no_module_over_the_line_limit() -> None:
    long = {m: len((SRC / m).read_text(encoding="utf-8").splitlines()) for m in _modules()}
    assert {m: n for m, n in long.items() if n > MAX_MODULE_LINES} == {}


@pytest.mark.parametrize("module", ["slicesched.gmg", "slicesched.sim", "slicesched.replay", "slicesched.sched",
                                    "slicesched.replay.capacity", "slicesched.cli"])
def test_core_imports_without_torch(module: str) -> None:
    """The simulator side runs where torch is not installed (a plain `pip install slicesched`)."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            f"import {module}\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert done.returncode == 0, done.stderr[-1500:]
