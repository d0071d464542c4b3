"""Docs that cannot drift: the generated pages are what the code says, and every command line shown in README.md and
docs/ uses flags its command has (parsed with the command's own parser)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Commands a page may show whose flags are not ours to check.
FOREIGN = ("pip", "bash", "git", "cd", "export", "curl", "python -m vllm", "vllm", "databricks", "kubectl",
           "venv-pack", "tar", "docker", "psql", "ls", "cat", "head", "spark-submit --version", "nvidia-smi", "sudo",
           "mkdir", "rm", "cp", "echo", "sbin/", "$SPARK_HOME", "uvicorn", "prometheus", "jq", "source", "for ")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_generated_pages_are_up_to_date():
    make_docs = _load("make_docs")
    for path, make in make_docs.PAGES.items():
        assert (ROOT / path).read_text() == make(), f"{path} is stale: run python scripts/make_docs.py"


def command_lines(text: str) -> list[str]:
    """The shell command lines of a page: the lines of its bash code blocks (continuations joined, comments cut),
    and inline code that starts like one of our commands."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.match(r"(\.venv/bin/)?(spark-llm |python (-m spark_llm\.cli |scripts/)|(bench_\w+|profile_run)\.py )",
                    span):
            found.append(span)
    return found


class _Parsed(Exception):
    def __init__(self, extra: list[str]):
        self.extra = extra


def _flags_unknown_to(parse, argv: list[str], monkeypatch) -> list[str]:
    """What ``parse`` (a parser's ``parse_args``, or a script's ``main``) does not know in ``argv``; a value of the
    wrong type or choice fails the test as argparse says it."""
    def known(self, args=None, namespace=None):
        _, extra = argparse.ArgumentParser.parse_known_args(self, args, namespace)
        raise _Parsed(extra)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", known)
    try:
        parse(argv)
    except _Parsed as parsed:
        return parsed.extra
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return []
        pytest.fail(f"{argv}: argparse exited with {exc.code}")
    pytest.fail(f"{argv}: the command parsed no arguments")


def _argv(line: str) -> list[str]:
    line = re.sub(r"^(\w+=\S+\s+)+", "", line.strip())  # leading VAR=value assignments
    return shlex.split(line)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_command_line_shown_uses_flags_that_exist(page, monkeypatch):
    from spark_llm.cli import build_parser
    from spark_llm.flags import add_run_arguments
    from spark_llm.service.server import add_serve_arguments

    checked = 0
    for line in command_lines(page.read_text(encoding="utf-8")):
        if line.startswith(FOREIGN):
            continue
        argv = _argv(line)
        if argv[0].endswith("spark-llm"):
            extra = _flags_unknown_to(lambda a: build_parser().parse_args(a), argv[1:], monkeypatch)
        elif argv[:3] == ["python", "-m", "spark_llm.cli"]:
            extra = _flags_unknown_to(lambda a: build_parser().parse_args(a), argv[3:], monkeypatch)
        elif argv[0] == "spark-submit":
            job = next((i for i, a in enumerate(argv) if a.endswith(("jobs/run_batch.py", "jobs/serve.py"))), None)
            assert job is not None, f"{page.name}: a spark-submit line without jobs/run_batch.py or serve.py: {line}"
            parser = argparse.ArgumentParser()
            (add_serve_arguments if argv[job].endswith("serve.py") else add_run_arguments)(parser)
            extra = _flags_unknown_to(lambda a: parser.parse_args(a), argv[job + 1:], monkeypatch)
        else:
            script = next((a for a in argv if a.endswith(".py")), None)
            if script is None:
                continue
            name = Path(script).stem
            if not (ROOT / "scripts" / f"{name}.py").exists():
                continue  # a user's own script, say
            module = _load(name)
            if "argv" not in inspect.signature(getattr(module, "main", lambda: None)).parameters:
                continue  # no flags to check (show_results.py takes a directory)
            extra = _flags_unknown_to(module.main, argv[argv.index(script) + 1:], monkeypatch)
        assert not extra, f"{page.name}: {line}\n  not flags of its command: {extra}"
        checked += 1
    if page.name in ("README.md", "running.md", "gpu.md", "service.md", "benchmarks.md"):
        assert checked, f"{page.name} shows no command line to check"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_links_between_the_pages_lead_somewhere(page):
    for target in re.findall(r"\]\(([^)#\s:]+\.(?:md|png))(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
