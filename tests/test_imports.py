"""The package's modules import in one direction: no import circle, function-level imports included (CPU, no import
of the package itself: every module is read with ``ast``)."""

import ast
from pathlib import Path

PACKAGE = "mhc_cute"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_files() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package (a package's ``__init__`` under its own name)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file (top level, functions, classes): ``from X
    import y`` counts as X.y where that is a module, else as X; relative imports resolved against ``name``."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None (depth-first search)."""
    state, stack = {}, []  # state: 1 on the current path, 2 done

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "mhc_cute.problem" in graph["mhc_cute.api"]  # top level, relative
    assert "mhc_cute.kernels.big_fuse" in graph["mhc_cute.kernels.fma"]  # from a sibling module
    assert "mhc_cute.reference" in graph["mhc_cute.backends"]  # inside a function
    assert "mhc_cute.tactics" in graph["mhc_cute.kernels"]  # from a package's __init__, one level up


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
