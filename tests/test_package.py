"""The package as a user installs it: the wheel built from this checkout, installed in a clean venv (no site
packages of ours) with its extras, and the installed command and import working there."""

from __future__ import annotations

import json
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from drills import drill

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.package


@drill("package")
def package(ctx) -> dict:
    """The wheel built and installed (with its extras) in a clean venv; what the installed package then says."""
    def run(*args: str | Path, cwd: Path | None = None) -> str:
        done = ctx.run(args, timeout=900, cwd=cwd)
        assert done.returncode == 0, f"{' '.join(map(str, args))}: {done.stderr[-3000:]}"
        return done.stdout

    out = ctx.out("package")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out / "dist", ROOT)
    [wheel] = (out / "dist").glob("*.whl")
    venv.create(out / "venv", with_pip=True)  # clean: none of this venv's packages
    bin = out / "venv" / "bin"
    run(bin / "pip", "install", "--quiet", f"{wheel}[serve,connect]")
    # the vllm extra is the CUDA build (gigabytes, and no GPU here): resolved against the index, not unpacked
    run(bin / "pip", "install", "--quiet", "--dry-run", "--report", out / "report.json", f"{wheel}[vllm]")
    elsewhere = out / "elsewhere"  # not the checkout: the installed package, not ./spark_llm, is imported
    elsewhere.mkdir()
    return {
        "venv": out / "venv", "wheel": wheel.name,
        "resolved": {i["metadata"]["name"].lower(): i["metadata"]["version"]
                     for i in json.loads((out / "report.json").read_text())["install"]},
        "where": run(bin / "python", "-c", "import spark_llm, importlib.metadata as m; "
                     "print(spark_llm.__file__); print(m.version('spark-llm-batch'))", cwd=elsewhere).split(),
        # what the serve extra promises: the service's modules import, webhook delivery's client with them
        "serve_imports": run(bin / "python", "-c", "import httpx, spark_llm.service.server, "
                             "spark_llm.service.delivery; print('ok')", cwd=elsewhere).strip(),
        "help": run(bin / "spark-llm", "--help", cwd=elsewhere),
        "serve_help": run(bin / "spark-llm", "serve", "--help", cwd=elsewhere),
        "heavy": run(bin / "python", "-c", "import importlib.util as u; print(u.find_spec('torch'), "
                     "u.find_spec('vllm'))", cwd=elsewhere).split(),
    }


@pytest.mark.drill("package")
def test_the_wheel_installs_with_its_extras_in_a_clean_venv_under_its_own_name(lane):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "spark-llm-batch"  # spark-llm on PyPI is another project
    got = lane.result("package")
    assert got["wheel"].startswith("spark_llm_batch-")
    assert "vllm" in got["resolved"] and "torch" in got["resolved"]
    assert got["where"][0].startswith(str(got["venv"])) and got["where"][1] == project["version"]
    assert got["serve_imports"] == "ok"
    assert "usage: spark-llm" in got["help"] and "--webhook-hosts" in got["serve_help"]
    # the help above worked with neither vLLM nor torch installed: heavy imports stay lazy
    assert got["heavy"] == ["None", "None"]
