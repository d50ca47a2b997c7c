#!/usr/bin/env bash
# Run the lint checks and the test suite (sets up .venv first if needed).
#   bash scripts/test.sh            every test (the check before a commit)
#   bash scripts/test.sh --fast     leaves out the tests marked slow (multi-process and long runs) for day-to-day work
# Any other argument goes to pytest, e.g. bash scripts/test.sh --fast -x tests/inference
set -euo pipefail
cd "$(dirname "$0")/.."
pytest_args=()
for arg in "$@"; do
    if [[ "$arg" == "--fast" ]]; then
        pytest_args+=(-m "not slow")
    else
        pytest_args+=("$arg")
    fi
done
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The +-form keeps an empty argument list working under set -u in bash 3 (macOS).
.venv/bin/python -m pytest ${pytest_args[@]+"${pytest_args[@]}"}
