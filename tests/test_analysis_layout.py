"""The import rules of analysis/: detectors never import reports, no module imports another's private
names, imports are at module level, and they form no cycle (function-level imports once hid one:
detect/gpu -> detect/growth -> detect/gpu, and detect/gpu -> report/html -> detect/gpu)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> dict[str, ast.Module]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): ast.parse(p.read_text())
            for p in (ROOT / "analysis").rglob("*.py")}


def imports(tree: ast.Module, known: set[str]) -> list[tuple[ast.stmt, str, list[str]]]:
    """(statement, analysis module, names taken from it) of every import in `tree`."""
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


def test_analysis_imports_follow_the_layout():
    trees = modules()
    edges: dict[str, set[str]] = {}
    for mod, tree in trees.items():
        edges[mod] = set()
        for node, target, names in imports(tree, set(trees)):
            assert node in tree.body, f"{mod} imports {target} inside a function"
            assert not [n for n in names if n.startswith("_")], f"{mod} imports private names of {target}"
            assert not (mod.startswith("analysis.detect") and target.startswith("analysis.report")), \
                f"detector {mod} imports report {target}"
            if target != mod:
                edges[mod].add(target)

    done: set[str] = set()

    def visit(path: list[str]) -> None:
        for nxt in sorted(edges[path[-1]]):
            assert nxt not in path, "import cycle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in done:
                visit([*path, nxt])
        done.add(path[-1])

    for mod in sorted(edges):
        visit([mod])
