"""The house rules of the package layout, measured on the import graph (issue #26).

The graph: one node per module of cnr (with models/ and readers/ as cnr.models and cnr.readers,
as the build installs them), one edge per ``import`` anywhere in a module: at the top, inside a
function, or under ``TYPE_CHECKING``; a lazy import still ties the two modules together.
A *unit* is a subpackage of cnr (cnr.write, cnr.restore, ...) or a top-level module
(cnr.api, cnr.options, ...; ``cnr/__init__.py`` is the unit ``cnr``). The *floor* of a unit is 1
plus the highest floor among the units it imports: the number of layers below and including it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {"cnr": "cnr", "cnr.models": "models", "cnr.readers": "readers"}
MAX_FLOORS = 9
APP_UNITS = {"cnr.app", "cnr.bench", "cnr.systest", "cnr.__main__"}


def _modules() -> Dict[str, str]:
    """Module name -> file path, for every module of the installed package."""
    found = {}
    for package, folder in SOURCES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and (package != "cnr" or dirpath != base
                                                                            or d not in ("models", "readers"))]
            rel = os.path.relpath(dirpath, base)
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for name in filenames:
                if name.endswith(".py"):
                    found[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(dirpath, name)
    return found


def _targets(node: ast.AST, module: str, is_package: bool) -> List[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        parts = module.split(".")
        parts = parts[:len(parts) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the cnr modules it imports (the longest importable prefix of each name)."""
    modules = _modules()
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _targets(node, module, path.endswith("__init__.py")):
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges[module].add(name)
        edges.setdefault(module, set())
    return edges


def unit_of(module: str) -> str:
    parts = module.split(".")
    return "cnr" if len(parts) == 1 else ".".join(parts[:2])


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def unit_graph(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    units: Dict[str, Set[str]] = defaultdict(set)
    for module, targets in edges.items():
        units[unit_of(module)].update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    return units


def floors(units: Dict[str, Set[str]]) -> Dict[str, int]:
    """Floor of every unit of an acyclic unit graph."""
    floor: Dict[str, int] = {}

    def of(unit: str) -> int:
        if unit not in floor:
            floor[unit] = 1 + max((of(t) for t in units.get(unit, ())), default=0)
        return floor[unit]

    for unit in units:
        of(unit)
    return floor


def test_no_module_imports_another_that_imports_it_back():
    assert circles(import_graph()) == []


def test_units_form_at_most_nine_floors_without_circles():
    units = unit_graph(import_graph())
    assert circles(units) == []
    floor = floors(units)
    assert max(floor.values()) <= MAX_FLOORS, sorted(floor.items(), key=lambda kv: kv[1])


def test_the_library_imports_nothing_from_the_app_or_the_benchmarks():
    edges = import_graph()
    leaks = sorted((m, t) for m, targets in edges.items() if unit_of(m) not in APP_UNITS
                   for t in targets if unit_of(t) in APP_UNITS)
    assert leaks == []


def test_importing_the_api_loads_no_yaml_and_no_app_module():
    code = ("import sys, cnr.api; bad = sorted(m for m in sys.modules if m == 'yaml' or m.startswith(('cnr.app', "
            "'cnr.bench', 'cnr.systest'))); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_measurement_sees_a_circle_and_counts_floors():
    # the rules above would pass vacuously on a graph builder that found no edges
    edges = import_graph()
    assert "cnr.write.engine" in edges["cnr.api"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floors({"top": {"mid"}, "mid": {"low"}, "low": set()}) == {"low": 1, "mid": 2, "top": 3}


PACKAGES = sorted(m for m, path in _modules().items() if path.endswith("__init__.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_listed_for_the_wheel(package):
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert f'"{package}"' in text, f"{package} is missing from [tool.setuptools] packages in pyproject.toml"
