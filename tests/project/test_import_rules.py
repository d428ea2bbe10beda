"""The import rules of the packages: no module imports another's private names, module-level
imports form no cycle, detectors never import reports, and analysis/ imports at module level only
(function-level imports once hid a cycle: detect/gpu -> detect/growth -> detect/gpu). sampler/
may import inside a function, to keep a command's start-up light, but not to hide a cycle."""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT


def modules(package: str) -> dict[str, ast.Module]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): ast.parse(p.read_text())
            for p in (ROOT / package).rglob("*.py")}


def imports(tree: ast.Module, known: set[str]) -> list[tuple[ast.stmt, str, list[str]]]:
    """(statement, project module, names taken from it) of every import in `tree`."""
    out: list[tuple[ast.stmt, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in known:
            out.append((node, node.module, [a.name for a in node.names]))
        if isinstance(node, ast.ImportFrom) and node.module:
            # `from analysis.report import gpu` imports the module analysis.report.gpu
            out += [(node, f"{node.module}.{a.name}", []) for a in node.names if f"{node.module}.{a.name}" in known]
        elif isinstance(node, ast.Import):
            out += [(node, a.name, []) for a in node.names if a.name in known]
    return out


ALL = {**modules("sampler"), **modules("analysis")}


@pytest.mark.parametrize("package", ["sampler", "analysis"])
def test_imports_follow_the_layout(package):
    edges: dict[str, set[str]] = {}
    for mod, tree in ALL.items():
        edges[mod] = set()
        for node, target, names in imports(tree, set(ALL)):
            at_top = node in tree.body
            if mod.startswith(package + "."):
                assert not [n for n in names if n.startswith("_") and n != "__version__"], \
                    f"{mod} imports private names of {target}"
                assert at_top or package != "analysis", f"{mod} imports {target} inside a function"
                assert not (mod.startswith("analysis.detect") and target.startswith("analysis.report")), \
                    f"detector {mod} imports report {target}"
            if at_top and target != mod and not mod.startswith(target + "."):   # its own package aside
                edges[mod].add(target)

    done: set[str] = set()

    def visit(path: list[str]) -> None:
        for nxt in sorted(edges.get(path[-1], ())):
            assert nxt not in path, "import cycle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in done:
                visit([*path, nxt])
        done.add(path[-1])

    for mod in sorted(m for m in edges if m.startswith(package)):
        visit([mod])
