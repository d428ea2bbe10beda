"""The import rules of the packages: the layer order of docs/design.md (imports go down, never up
or sideways, function-level imports included), no module imports another's private names,
module-level imports form no cycle, detectors never import reports, and analysis/ imports at
module level only (function-level imports once hid a cycle: detect/gpu -> detect/growth ->
detect/gpu). sampler/ may import inside a function, to keep a command's start-up light, but not to
go against the layer order."""

from __future__ import annotations

import ast
from pathlib import Path

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

# sampler/'s sub-packages, lowest first (docs/design.md "Layers"): a module imports only from lower
# layers and its own sub-package. "base" is the top-level modules (sampler/errors.py, files.py, ...).
LAYERS = [
    {"base"},
    {"binary", "bpf", "dataset"},          # files, kernel objects, the dataset contract
    {"proc"},                              # /proc of one process
    {"probes", "python"},                  # where to probe; a CPython's layout
    {"stacks", "control", "gpu", "inprocess"},
    {"record"},                            # the recording loop
    {"service"},                           # the daemon
    {"cli"},
]
# analysis/ reads the dataset contract (and the base helpers), nothing of the recording side; of
# sampler/, only the service and the CLI run it.
ANALYSIS_READS = {"base", "dataset"}
RUNS_ANALYSIS = {"service", "cli"}


def stage(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] == "analysis":
        return "analysis"
    return parts[1] if len(parts) > 1 and (ROOT / "sampler" / parts[1]).is_dir() else "base"


RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def test_every_sub_package_has_a_layer():
    packages = {p.name for p in (ROOT / "sampler").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANK) - {"base"}


def test_imports_go_down_the_layers():
    wrong = []
    for mod, tree in ALL.items():
        src = stage(mod)
        for _, target, _ in imports(tree, set(ALL)):
            dst = stage(target)
            if dst == src:
                continue
            if src == "analysis":
                ok = dst in ANALYSIS_READS
            elif dst == "analysis":
                ok = src in RUNS_ANALYSIS
            else:
                ok = RANK[dst] < RANK[src]
            if not ok:
                wrong.append(f"{mod} ({src}) imports {target} ({dst})")
    assert not wrong, "imports against the layer order (docs/design.md):\n" + "\n".join(sorted(set(wrong)))


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


def readme_rows() -> dict[str, str]:
    """The README's Layout table: path -> what."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout"):]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            path, what = line[2:].split("|", 1)
            rows[path.strip().strip("`")] = what
    return rows


def test_the_readme_layout_names_every_module():
    rows = readme_rows()
    missing = []
    for mod in ALL:
        parts = mod.split(".")
        name = parts[-1]
        if name in ("__main__",) or (ROOT / Path(*parts)).is_dir():
            continue                                     # a package's __init__, a command's entry
        if parts[0] == "analysis":
            row = rows["analysis/"]
        else:
            row = rows["sampler/" + (parts[1] + "/" if len(parts) > 2 else "")]
        if f"`{name}`" not in row and f"`{name}.py`" not in row:
            missing.append(mod)
    assert not missing, "modules the README's Layout table does not name: " + ", ".join(sorted(missing))


def test_every_python_child_is_isolated():
    """Every interpreter the tool starts runs with -I (nothing imported from its working directory or
    PYTHON* variables: root's commands run from directories others can write): children are started
    through sampler.environ.python_module, or with -I written beside sys.executable."""
    bad = []
    for path in sorted([*ROOT.glob("sampler/**/*.py"), *ROOT.glob("analysis/**/*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "sys.executable" in line and '"-I"' not in line and not line.lstrip().startswith("#"):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "interpreters started without -I:\n" + "\n".join(bad)
