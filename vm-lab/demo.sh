#!/usr/bin/env bash
# The lab demo: installs what it needs, then boots lab VMs from `layerpy serve`.
# `vm-lab/demo.sh --until-ready` exits 0 once every node is ready (non-zero on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
vm-lab/setup.sh
exec .venv/bin/python vm-lab/session.py "$@"
