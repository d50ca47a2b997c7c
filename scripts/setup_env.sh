#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install the runtime and test dependencies.
# Idempotent: a second run with everything installed only checks the requirements.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ ! -x .venv/bin/python ]; then
    echo "Creating virtual environment .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
# Skip pip entirely when the installed set already satisfies the requirements (fast repeated runs).
if ! .venv/bin/python - <<'PY' 2>/dev/null
import importlib.metadata as md, re, sys
for line in open("requirements-dev.txt").read().splitlines() + open("requirements.txt").read().splitlines():
    line = line.split("#")[0].strip()
    if not line or line.startswith("-r"):
        continue
    name = re.split(r"[<>=!~ ]", line, maxsplit=1)[0]
    md.version(name)
sys.exit(0)
PY
then
    echo "Installing dependencies (torch is large: this takes a few minutes the first time)"
    .venv/bin/python -m pip install --quiet -r requirements-dev.txt
fi
