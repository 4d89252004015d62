#!/usr/bin/env bash
# Fill deploy/wheelhouse/ with wheels of every dependency of the image (esa-pipeline[server,
# postgres,sim]) and of its build backend (setuptools, wheel), using this machine's pip and its
# configuration (index, local mirrors, find-links, a proxy's CA in PIP_CERT/pip.conf).
# deploy/Dockerfile then installs them with `pip --no-index`: the image build needs no network.
#
#   deploy/make-wheelhouse.sh            # with .venv/bin/python, else python3.11 / python3
#   PYTHON=/usr/bin/python3.11 deploy/make-wheelhouse.sh
#
# The Python must be CPython 3.11 on Linux x86_64 (the images' Python; wheels are cp311
# manylinux). The project's own wheel is not kept: the image builds it from the sources.
# Refill after changing dependencies in pyproject.toml; `--clean` empties the directory
# (the image build then installs from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
out=deploy/wheelhouse
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
rm -f "$out"/*.whl
if [ "${1:-}" = --clean ]; then
    echo "emptied $out"
    exit 0
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
    for candidate in .venv/bin/python python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
    done
fi
"$python" - <<'PY'
import platform, sys
if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64":
    sys.exit(f"need CPython 3.11 on x86_64 for the images' wheels, not {sys.version} on {platform.machine()}")
PY
"$python" -m pip wheel --quiet --wheel-dir "$out" '.[server,postgres,sim]' 'setuptools>=77' wheel
rm -f "$out"/esa_pipeline-*.whl
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
