#!/usr/bin/env bash
# The whole test suite: installs what it needs (vm-lab/setup.sh), then lint and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
vm-lab/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/pytest -q -rs --durations=20 "$@"
