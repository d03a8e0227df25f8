#!/usr/bin/env bash
# The main job: set up .venv (extras rtx, serve), then `python export/build_engines.py` with any arguments
# (none: the embedded k3-tiny default, generated on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rtx,serve
exec .venv/bin/python export/build_engines.py "$@"
