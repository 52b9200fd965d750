#!/usr/bin/env bash
# The lab demo: installs what it needs, then boots lab VMs from `layerpy serve`.
# `vm-lab/demo.sh --until-ready` exits 0 once every node is ready (non-zero on failure).
# `vm-lab/demo.sh --slurm [--until-ready]`: the Slurm cluster demo (vm-lab/slurm_lab.py).
# `vm-lab/demo.sh --ha [--until-failover]`: two instances on a 3-member etcd, one killed
# (vm-lab/ha_session.py).
set -euo pipefail
cd "$(dirname "$0")/.."
vm-lab/setup.sh
if [ "${1:-}" = --slurm ]; then
    shift
    exec .venv/bin/python vm-lab/slurm_lab.py "$@"
fi
if [ "${1:-}" = --ha ]; then
    shift
    exec .venv/bin/python vm-lab/ha_session.py "$@"
fi
exec .venv/bin/python vm-lab/session.py "$@"
