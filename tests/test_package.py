"""The package as a user installs it: the wheel built from this checkout, installed in a clean venv (no site
packages of ours) with its extras, and the installed command and import working there."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.package


def run(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=900)
    assert done.returncode == 0, f"{' '.join(map(str, args))}: {done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_installs_with_its_extras_in_a_clean_venv_under_its_own_name(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "spark-llm-batch"  # spark-llm on PyPI is another project
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp_path / "dist", ROOT)
    [wheel] = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith("spark_llm_batch-")
    venv.create(tmp_path / "venv", with_pip=True)  # clean: none of this venv's packages
    bin = tmp_path / "venv" / "bin"
    run(bin / "pip", "install", "--quiet", f"{wheel}[serve,connect]")
    # the vllm extra is the CUDA build (gigabytes, and no GPU here): resolved against the index, not unpacked
    run(bin / "pip", "install", "--quiet", "--dry-run", "--report", tmp_path / "report.json", f"{wheel}[vllm]")
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert "vllm" in resolved and "torch" in resolved

    elsewhere = tmp_path / "elsewhere"  # not the checkout: the installed package, not ./spark_llm, is imported
    elsewhere.mkdir()
    where = run(bin / "python", "-c", "import spark_llm, importlib.metadata as m; "
                "print(spark_llm.__file__); print(m.version('spark-llm-batch'))", cwd=elsewhere).split()
    # what the serve extra promises: the service's modules import, webhook delivery's client with them
    run(bin / "python", "-c", "import httpx, spark_llm.service.server, spark_llm.service.delivery", cwd=elsewhere)
    assert where[0].startswith(str(tmp_path / "venv")) and where[1] == project["version"]
    assert "usage: spark-llm" in run(bin / "spark-llm", "--help", cwd=elsewhere)
    assert "--webhook-hosts" in run(bin / "spark-llm", "serve", "--help", cwd=elsewhere)
    # the help above worked with neither vLLM nor torch installed: heavy imports stay lazy
    assert run(bin / "python", "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('vllm'))",
               cwd=elsewhere).split() == ["None", "None"]
