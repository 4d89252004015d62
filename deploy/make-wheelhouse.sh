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
# Refill after changing dependencies in pyproject.toml: `--if-stale` does so only when they
# (or the Python) changed since the last fill (deploy/wheelhouse/.stamp). `--clean` empties the
# directory (the image build then installs from PyPI). Each fill is copied to
# $ESA_WHEELHOUSE_CACHE (default /var/cache/esa/wheelhouse, when writable), from which
# `--if-stale` refills an empty wheelhouse of the same stamp (a fresh clone, CI) without pip.
set -euo pipefail
script=$(readlink -f "$0")
cd "$(dirname "$script")/.."
out=deploy/wheelhouse
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,16p' "$script" | sed 's/^# \{0,1\}//'
    exit 0
fi
if [ "${1:-}" = --clean ]; then
    rm -f "$out"/*.whl "$out/.stamp"
    echo "emptied $out"
    exit 0
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
    for candidate in .venv/bin/python python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
    done
fi
# What the wheelhouse must serve: the image's requirements and build backend, for this Python.
stamp=$("$python" - <<'PY'
import hashlib, platform, sys, tomllib
if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64":
    sys.exit(f"need CPython 3.11 on x86_64 for the images' wheels, not {sys.version} on {platform.machine()}")
with open("pyproject.toml", "rb") as f:
    data = tomllib.load(f)
extras = data["project"]["optional-dependencies"]
wanted = [*data["project"]["dependencies"], *extras["server"], *extras["postgres"], *extras["sim"],
          *data["build-system"]["requires"], sys.implementation.cache_tag]
print(hashlib.sha256("\n".join(wanted).encode()).hexdigest())
PY
)
# A copy outside the work tree ($ESA_WHEELHOUSE_CACHE), so a fresh clone on the same machine
# (CI) refills from disk; keyed by the stamp.
cache=${ESA_WHEELHOUSE_CACHE:-/var/cache/esa/wheelhouse}
if [ "${1:-}" = --if-stale ] && [ "$(cat "$out/.stamp" 2>/dev/null)" != "$stamp" ] \
        && [ "$(cat "$cache/.stamp" 2>/dev/null)" = "$stamp" ]; then
    rm -f "$out"/*.whl "$out/.stamp"
    cp -p "$cache"/*.whl "$cache/.stamp" "$out/"
    echo "$out filled from $cache"
fi
if [ "${1:-}" = --if-stale ] && [ "$(cat "$out/.stamp" 2>/dev/null)" = "$stamp" ] \
        && ls "$out"/*.whl >/dev/null 2>&1; then
    echo "$out is up to date ($(ls "$out"/*.whl | wc -l) wheels)"
    exit 0
fi
rm -f "$out"/*.whl "$out/.stamp"
"$python" -m pip wheel --quiet --wheel-dir "$out" '.[server,postgres,sim]' 'setuptools>=77' wheel \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
rm -f "$out"/esa_pipeline-*.whl
echo "$stamp" >"$out/.stamp"
if mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ]; then
    rm -f "$cache"/*.whl "$cache/.stamp"
    cp -p "$out"/*.whl "$cache/" && cp -p "$out/.stamp" "$cache/"
fi
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
