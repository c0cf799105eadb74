"""Static checks on the package's shape (issue #33): no import cycle among its modules, no branch on a class-name
string, and no function over 60 lines (argparse tables aside). They read the source with `ast`, so they see every
import, function-local ones included, and cost no import of torch or diffusers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "neuron_diffusers"

def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name a `from ... import` reads from (relative levels resolved against `module`)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, path: Path, known: set[str]) -> list[str]:
    """The package modules one import statement reads from: `from pkg import sub` reads `sub` (a submodule), `from
    pkg import name` reads `pkg` itself (a parent package's own `__init__` is not counted as read by its
    submodules: Python runs it first, but it is not what they depend on)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    source = _resolve(module, path, node)
    names = [f"{source}.{alias.name}" for alias in node.names]
    names += [source] if any(name not in known for name in names) else []
    return [name for name in names if name in known]


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`, which never run (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (inner for branch in node.orelse for inner in ast.walk(branch))
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """Every package module -> the package modules it imports anywhere it runs (function-local imports included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = {target for node in _runtime_nodes(tree) for target in _targets(node, module, path, set(modules))}
        graph[module] = {target for target in edges if target != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    """Control: the finder reports a cycle where there is one."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _is_name_of_class(node: ast.AST) -> bool:
    """`X.__name__` (`type(m).__name__`, `cls.__name__`, `base.__name__`)."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__"


def _is_string_side(node: ast.AST) -> bool:
    """A string, or a container / name that holds strings: anything but `"__main__"`-style module checks."""
    return not (isinstance(node, ast.Constant) and node.value == "__main__")


def class_name_comparisons(source: str, filename: str = "<source>") -> list[int]:
    """Lines of `source` that compare a `__name__` attribute (other than a module's `__name__ == "__main__"`)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_is_name_of_class(side) for side in sides) and all(
                _is_string_side(side) for side in sides if not _is_name_of_class(side)):
            if not (isinstance(node.left, ast.Name) and node.left.id == "__name__"):
                lines.append(node.lineno)
    return lines


def test_no_branch_on_class_name_strings():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in class_name_comparisons(path.read_text(), str(path))]
    assert not found, "compare classes with isinstance / issubclass, not by name: " + ", ".join(found)


def test_class_name_check_catches_comparisons():
    """Control: each spelling the check exists for is caught; a module's `__name__ == "__main__"` is not."""
    assert class_name_comparisons('if type(c).__name__ == "MagCacheConfig": pass') == [1]
    assert class_name_comparisons("x = type(m).__name__ in names") == [1]
    assert class_name_comparisons("x = base.__name__ == cls.__name__") == [1]
    assert class_name_comparisons('if __name__ == "__main__": pass') == []


#: The longest function the package may hold (issue #33): argparse tables aside, where one `add_argument` call per
#: option is the clearest form.
MAX_FUNCTION_LINES = 60


def _is_argparse_table(function: ast.FunctionDef) -> bool:
    """Whether most of the function's statements are `*.add_argument(...)` calls (an option table, not logic)."""
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"]
    statements = [node for node in ast.walk(function) if isinstance(node, ast.stmt) and node is not function]
    return len(calls) >= 0.6 * len(statements)


def long_functions(source: str, filename: str = "<source>") -> list[str]:
    """`name (lines)` of every function in `source` over `MAX_FUNCTION_LINES`, argparse tables aside."""
    return [f"{node.name}:{node.lineno} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not _is_argparse_table(node)]


def test_no_function_is_longer_than_sixty_lines():
    long = [f"{path.relative_to(PACKAGE.parent)}:{entry}" for path in sorted(PACKAGE.rglob("*.py"))
            for entry in long_functions(path.read_text(), str(path))]
    assert not long, "functions over 60 lines (split them into named steps):\n" + "\n".join(long)


def test_function_length_check_catches_a_long_function():
    """Control: 61 lines of logic are caught; an option table of the same length is not."""
    logic = "def f(x):\n" + "".join(f"    x = x + {i}\n" for i in range(60))
    table = "def g(parser):\n" + "".join(f"    parser.add_argument('--o{i}')\n" for i in range(60))
    assert long_functions(logic) == ["f:1 (61 lines)"] and long_functions(table) == []
