#!/usr/bin/env bash
# The whole test suite, from a fresh Linux machine: a virtualenv with the project and its
# test extra, the llama-server fixture (built once, cached outside the repo), then lint,
# types, layering and pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VACANCYD_VENV:-.venv}
PY=$VENV/bin/python

need_packages=()
command -v cmake >/dev/null || need_packages+=(cmake)
command -v g++ >/dev/null || need_packages+=(g++)
command -v make >/dev/null || need_packages+=(make)
if [ ${#need_packages[@]} -gt 0 ]; then
  echo "test.sh: installing ${need_packages[*]} (needed to build llama-server)" >&2
  apt-get update -qq && apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --disable-pip-version-check --upgrade pip
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

fixture=$(PYTHON="$PY" bash tools/fixtures/ensure_llama_server.sh)
LLAMA_SERVER_BIN=$(sed -n 's/^LLAMA_SERVER_BIN=//p' <<<"$fixture")
LLAMA_MODEL=$(sed -n 's/^LLAMA_MODEL=//p' <<<"$fixture")
export LLAMA_SERVER_BIN LLAMA_MODEL

echo "== ruff" && "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check .
echo "== mypy" && "$VENV/bin/mypy"
echo "== import contracts" && "$VENV/bin/lint-imports" --no-cache
echo "== pytest" && "$VENV/bin/pytest" "$@"
