#!/usr/bin/env bash
# The whole test suite, from a fresh Linux machine: a virtualenv with the project and its
# test extra, the llama-server fixture (built once, cached outside the repo), then lint,
# types, layering and pytest under coverage, whose report ends the run; the core modules'
# floors (tools/coverage_floor.py) are checked when the whole suite ran. Extra arguments
# go to pytest (then no floors); VACANCYD_COVERAGE=0 runs pytest without coverage.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VACANCYD_VENV:-.venv}
PY=$VENV/bin/python

need_packages=()
command -v cmake >/dev/null || need_packages+=(cmake)
command -v g++ >/dev/null || need_packages+=(g++)
command -v make >/dev/null || need_packages+=(make)
# systemd-analyze verifies conf/vacancyd.service (tests/test_systemd_unit.py).
command -v systemd-analyze >/dev/null || need_packages+=(systemd)
# Debian's chromium drives the owner console in a real browser (tests/test_console.py).
command -v chromium >/dev/null || need_packages+=(chromium)
# The session agent's X11 tests (tests/test_agent_x11.py): an X server with a real
# window manager, the tools that act as the owner (a window, fullscreen, pointer input),
# and libXss, which the agent loads through ctypes. desktop-file-validate checks the
# agent's autostart entry (tests/test_agent_units.py).
command -v Xvfb >/dev/null || need_packages+=(xvfb)
command -v openbox >/dev/null || need_packages+=(openbox)
command -v wmctrl >/dev/null || need_packages+=(wmctrl)
command -v xdotool >/dev/null || need_packages+=(xdotool)
command -v xlogo >/dev/null || need_packages+=(x11-apps)
command -v xprop >/dev/null || need_packages+=(x11-utils)
ldconfig -p 2>/dev/null | grep 'libXss\.so\.1' >/dev/null || need_packages+=(libxss1)
command -v desktop-file-validate >/dev/null || need_packages+=(desktop-file-utils)
# The installed daemon is asked over HTTP from inside a container (tests/test_real_agent.py).
command -v curl >/dev/null || need_packages+=(curl)
if [ ${#need_packages[@]} -gt 0 ]; then
  echo "test.sh: installing ${need_packages[*]} (to build llama-server, to verify the units," \
    "to drive the console, to run an X11 desktop for the agent)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
# Playwright drives the system chromium (executable_path): it never downloads a browser.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
"$PY" -m pip install -q --disable-pip-version-check --upgrade pip
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

# Each fixture script builds (or finds in its cache) what it provides and prints
# KEY=VALUE lines; they become the environment the tests run in.
for script in tools/fixtures/ensure_*.sh; do
  output=$(PYTHON="$PY" bash "$script")
  while IFS='=' read -r key value; do
    [[ $key =~ ^[A-Z_][A-Z0-9_]*$ ]] && export "$key=$value"
  done <<<"$output"
done

echo "== ruff" && "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check .
echo "== mypy" && "$VENV/bin/mypy"
echo "== import contracts" && "$VENV/bin/lint-imports" --no-cache
if [ "${VACANCYD_COVERAGE:-1}" = 0 ]; then
  echo "== pytest" && "$VENV/bin/pytest" "$@"
  exit
fi

# pytest under coverage (configured in pyproject.toml); the daemons the tests start as
# subprocesses write their own data files next to this one, combined afterwards.
export COVERAGE_FILE="$PWD/.coverage"
"$VENV/bin/coverage" erase
echo "== pytest (with coverage)" && "$VENV/bin/coverage" run -m pytest "$@"
echo "== coverage (files not fully covered, least covered first)"
"$VENV/bin/coverage" combine -q
"$VENV/bin/coverage" report
"$VENV/bin/coverage" json -q -o coverage.json
if [ $# -eq 0 ]; then
  "$PY" tools/coverage_floor.py coverage.json
else
  echo "coverage floors not checked: pytest ran on a selection ($*)"
fi
