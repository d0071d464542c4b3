"""The package's shape, checked from its source: no module takes another's private names, no function takes more
than six parameters, and the engine's wire protocol is spelled only where it is defined."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "spark_llm"
MAX_PARAMETERS = 6


def modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


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
