"""The package's shape, checked from its source: no import circle, no module takes another's private names, no
function takes more than six parameters, and the engine's wire protocol is spelled only where it is defined."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "spark_llm"
MAX_PARAMETERS = 6


def modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (in a function too), each with the packages whose
    ``__init__`` the import runs; not its own packages, which are imported before it."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            named = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
        else:
            continue
        for name in named:
            parts = name.split(".")
            found.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return {m for m in found & known if m != me and not me.startswith(m + ".")}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                circle = []
                while True:
                    member = stack.pop()
                    circle.append(member)
                    if member == node:
                        break
                if len(circle) > 1:
                    circles.append(sorted(circle))
    return circles


def test_no_modules_import_each_other_in_a_circle_in_function_imports_included():
    parsed = modules()
    known = {module_name(p) for p, _ in parsed}
    graph = {module_name(p): imports(p, tree, known) for p, tree in parsed}
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle_through_a_function_s_import():
    source = {"a.py": "def f():\n    from . import b\n", "b.py": "from .c import x\n", "c.py": "from .a import f\n",
              "d.py": "from . import a\n"}
    trees = {ROOT / "pkg" / name: ast.parse(text) for name, text in source.items()}
    known = {module_name(p) for p in trees} | {"pkg"}
    graph = {module_name(p): imports(p, tree, known) for p, tree in trees.items()}
    assert graph["pkg.d"] == {"pkg.a"}
    assert import_circles(graph | {"pkg": set()}) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_module_imports_another_module_s_private_names():
    taken = [f"{p.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
             for p, tree in modules() for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("spark_llm"))
             for alias in node.names if alias.name.startswith("_") and alias.name != "__version__"]
    assert taken == []


def test_no_function_takes_more_than_six_parameters():
    wide = []
    for p, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMETERS:
                    wide.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({len(names)})")
    assert wide == []


def test_the_engine_s_messages_are_spelled_only_in_its_protocol():
    from spark_llm.engine_host.protocol import Ask, Reply

    words = {v for cls in (Ask, Reply) for k, v in vars(cls).items() if k.isupper()}
    spelled = []
    for name in ("client.py", "server.py"):
        tree = ast.parse((PACKAGE / "engine_host" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant) \
                    and node.elts[0].value in words:
                spelled.append(f"{name}:{node.lineno} {node.elts[0].value!r}")
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in words
                                                     for c in node.comparators):
                spelled.append(f"{name}:{node.lineno}")
    assert spelled == []
