#!/usr/bin/env bash
# Run the lint checks and the test suite (sets up .venv first if needed).
#   bash scripts/test.sh            every test (the check before a commit)
#   bash scripts/test.sh --fast     leaves out the tests marked slow (multi-process and long runs) for day-to-day work
# Any other argument goes to pytest, e.g. bash scripts/test.sh --fast -x tests/inference
# The tests run in one pytest-xdist worker per available CPU (at most 4: each test may start several processes of
# its own; a third worker on 2 cores took 538 s against 490 s for two); TEST_WORKERS=N sets the number,
# TEST_WORKERS=1 runs them in one process (for pdb).
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
cpus=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())')
workers="${TEST_WORKERS:-$((cpus < 4 ? cpus : 4))}"
if [[ "$workers" -gt 1 ]]; then
    # worksteal: an idle worker takes tests queued on a busy one (the slow tests are long and uneven).
    pytest_args=(-n "$workers" --dist worksteal ${pytest_args[@]+"${pytest_args[@]}"})
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The +-form keeps an empty argument list working under set -u in bash 3 (macOS).
.venv/bin/python -m pytest ${pytest_args[@]+"${pytest_args[@]}"}
