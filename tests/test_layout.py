"""The repository's layout: module sizes, the architecture doc, no import cycle at import time."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "shmap"

#: Small modules with one job (issue 9): every module stays within ~500 lines; one that grows past
#: it is split along its seams (as tensor.py / special.py / recording.py, shard_map.py /
#: spec_tree.py, collectives.py / operands.py were).
MAX_LINES = 500


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_within_the_line_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    assert sizes, "no modules found under shmap/"
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_readme_links_the_architecture_doc():
    doc = ROOT / "docs" / "architecture.md"
    assert doc.is_file(), "docs/architecture.md is missing"
    readme = (ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in readme, "README.md should link docs/architecture.md"
    assert "../shared/" not in readme, "README.md links a file outside the repository"
    # the doc walks through the core modules, and every file path it names exists
    text = doc.read_text()
    for name in ("tensor.py", "batching.py", "collectives.py", "simulated.py", "distributed.py", "shard_map.py"):
        assert name in text, f"docs/architecture.md does not mention {name}"
    paths = set(re.findall(r"\b(?:shmap|tests|docs)/[\w/]*\w\.(?:py|md)\b", text))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


# --------------------------------------------------------------------------
# Import-time module graph of shmap/*.py and shmap/backends/*.py
# --------------------------------------------------------------------------
def _graph_modules() -> dict[str, pathlib.Path]:
    files = sorted(PKG.glob("*.py")) + sorted((PKG / "backends").glob("*.py"))
    out = {}
    for p in files:
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _import_time_statements(nodes):
    """Statements executed when the module is imported: module level, including class bodies and
    `if`/`try` blocks, but not function bodies or `if TYPE_CHECKING:` blocks."""
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            yield from _import_time_statements(n.orelse)
            continue
        yield n
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(n, field, None)
            if isinstance(sub, list):
                yield from _import_time_statements(sub)


def import_graph() -> dict[str, set]:
    """module -> the shmap modules it imports at import time (relative and absolute imports)."""
    mods = _graph_modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for n in _import_time_statements(ast.parse(path.read_text()).body):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = package.split(".")
                    base = base[: len(base) - (n.level - 1)]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                for alias in n.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:  # `from . import x`: the submodule x
                        edges.add(sub)
                    elif target in mods:  # `from .x import y`: module x
                        edges.add(target)
            elif isinstance(n, ast.Import):
                edges.update(a.name for a in n.names if a.name in mods)
        edges.discard(name)
        graph[name] = edges
    return graph


def _find_cycle(graph):
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_import_graph_sees_the_core_edges():
    graph = import_graph()
    assert "shmap.tensor" in graph["shmap.collectives"]
    assert "shmap.backends" in graph["shmap.shard_map"]
    assert "shmap.tensor" in graph["shmap.backends.simulated"]


def test_no_import_cycle_at_import_time():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import cycle at import time: " + " -> ".join(cycle)


def test_the_core_does_not_import_the_kernel_package():
    """Transports plug in (`backends.config.register_transport`); only the package root re-exports
    `shmap.kernels`, whose modules may import the core, not the other way round."""
    offenders = []
    for p in sorted(PKG.glob("*.py")) + sorted((PKG / "backends").glob("*.py")):
        if p.name == "__init__.py" and p.parent == PKG:
            continue
        for n in ast.walk(ast.parse(p.read_text())):  # anywhere, function bodies included
            if isinstance(n, ast.ImportFrom):
                mod = ("." * n.level) + (n.module or "")
                names = [a.name for a in n.names]
                if "kernels" in mod.split(".") or (mod.strip(".") == "" and "kernels" in names):
                    offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}")
            elif isinstance(n, ast.Import) and any(a.name.startswith("shmap.kernels") for a in n.names):
                offenders.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert not offenders, f"core modules import shmap.kernels: {offenders}"
