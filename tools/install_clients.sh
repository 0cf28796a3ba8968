#!/usr/bin/env bash
# The load generators the compatibility suite drives `tokenos serve` with that cannot share the test
# environment: guidellm pins older click / multidict than the rest of it needs. It goes into its own
# virtual environment (.venv-clients/, ignored by git) that sees this interpreter's packages, so only
# what guidellm needs on top (and the pins it differs on) is installed there; nothing here is changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
VENV=.venv-clients
"$PY" -m venv --system-site-packages "$VENV"
# When this interpreter is itself a venv, --system-site-packages reaches the base one, not this one:
# a .pth file puts this interpreter's site-packages behind the new venv's own.
"$PY" - "$VENV" <<'PY'
import pathlib, sys, sysconfig
venv = pathlib.Path(sys.argv[1])
if sys.prefix != sys.base_prefix:
    purelib = next(venv.glob("lib/python*/site-packages"))
    (purelib / "_tokenos_outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
PY
"$VENV/bin/pip" install -q guidellm==0.8.1
"$VENV/bin/guidellm" --version
