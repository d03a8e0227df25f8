#!/usr/bin/env bash
# The whole test suite: set up .venv (extras rtx, serve, test), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rtx,serve,test
exec .venv/bin/python -m pytest -q "$@"
