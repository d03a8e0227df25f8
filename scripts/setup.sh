#!/usr/bin/env bash
# Create .venv and install k3deploy with the given extras (default: rtx,serve,test). Skips the install when
# .venv already holds these extras for this pyproject.toml (a stamp file records both).
# torch==2.13.0 is pinned first so pip takes the CPU build where one is on local disk; on a GPU host pip
# takes the CUDA build of the same version.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-rtx,serve,test}"
STAMP=".venv/.k3deploy-installed"
WANT="$(sha256sum pyproject.toml | cut -c1-16) ${EXTRAS}"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
if [ -f "$STAMP" ] && grep -qxF "$WANT" "$STAMP"; then exit 0; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# setuptools tells every editable install of a package-dir mapping to mind same-named folders (pip shows it as a
# BuildBackendWarning): k3deploy/ is the package itself, so that one notice is filtered; other warnings still show
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
echo "$WANT" >> "$STAMP"
