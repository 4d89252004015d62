#!/usr/bin/env bash
# A Docker engine for docker-compose.yml on a Debian machine that has none running (ours: the
# static `docker` client only). Idempotent; every step is skipped when already done:
#
#   1. installs Debian's docker.io (dockerd 20.10), docker-compose (1.29) and debootstrap
#      (deploy/build-base-images.sh) when missing: apt-get, as root;
#   2. starts a plain `dockerd` in the background when `docker info` gets no answer
#      (log: $ESA_DOCKERD_LOG, default /tmp/esa-dockerd.log), and waits until it answers;
#   3. with --base-images, builds the stand-in base images the compose build needs (python,
#      postgres, and the profiles' prometheus and haproxy) when the pinned official ones are
#      not present locally (deploy/build-base-images.sh; nothing is pulled from an image
#      registry), and prints the variables that select them;
#   4. with --wheelhouse, fills deploy/wheelhouse/ when stale (deploy/make-wheelhouse.sh), so
#      the image build needs no network.
#
#   deploy/engine.sh                                   # 1 and 2
#   eval "$(deploy/engine.sh --base-images --wheelhouse)"   # all, then export the images
#
# The engine keeps images and volumes in /var/lib/docker: a second run on the same machine
# builds nothing. .ci/run calls this before `make test`; tests/deploy/ calls it too.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
LOG=${ESA_DOCKERD_LOG:-/tmp/esa-dockerd.log}
BASE=0
WHEELS=0
for arg in "$@"; do
    case "$arg" in
        --base-images) BASE=1 ;;
        --wheelhouse) WHEELS=1 ;;
        -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "engine.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done
log() { printf '[engine] %s\n' "$*" >&2; }

compose_present() {
    command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1
}

install_missing() {
    local want=()
    command -v dockerd >/dev/null 2>&1 || want+=(docker.io)
    compose_present || want+=(docker-compose)
    if [ "$BASE" = 1 ]; then command -v debootstrap >/dev/null 2>&1 || want+=(debootstrap); fi
    [ ${#want[@]} -gt 0 ] || return 0
    [ "$(id -u)" = 0 ] || { log "need root to install ${want[*]}"; exit 1; }
    log "apt-get install ${want[*]}"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${want[@]}" \
        iptables ca-certificates; } >/tmp/esa-engine-apt.log 2>&1 \
        || { tail -20 /tmp/esa-engine-apt.log >&2; exit 1; }
}

start_engine() {
    docker info >/dev/null 2>&1 && return 0
    [ "$(id -u)" = 0 ] || { log "no Docker engine answers and only root can start dockerd"; exit 1; }
    log "starting dockerd (log: $LOG)"
    setsid nohup dockerd >"$LOG" 2>&1 </dev/null 9>&- &   # not holding the lock
    local i
    for i in $(seq 1 120); do
        docker info >/dev/null 2>&1 && { log "dockerd up after $((i / 4)) s"; return 0; }
        sleep 0.25
    done
    tail -20 "$LOG" >&2
    log "dockerd did not answer within 30 s"
    exit 1
}

# The FROM defaults of the Dockerfiles (deploy/Dockerfile, deploy/postgres/, the monitoring
# profile's deploy/prometheus/ and the replicas profile's deploy/haproxy/), when present here;
# else the stand-ins, built once. Printed as `export ...` for eval.
IMAGES=(python:PYTHON_IMAGE:Dockerfile postgres:POSTGRES_IMAGE:postgres/Dockerfile
        prometheus:PROMETHEUS_IMAGE:prometheus/Dockerfile haproxy:HAPROXY_IMAGE:haproxy/Dockerfile)
base_images() {
    local entry name var file official missing=() exports=()
    for entry in "${IMAGES[@]}"; do
        IFS=: read -r name var file <<<"$entry"
        official=$(sed -n "s/^ARG $var=//p" "$here/$file")
        if docker image inspect "$official" >/dev/null 2>&1; then
            log "official base image present: $official"
            exports+=("$var=$official")
        else
            missing+=("$name")
            exports+=("$var=$("$here/build-base-images.sh" --print "$name")")
        fi
    done
    if [ ${#missing[@]} -gt 0 ]; then "$here/build-base-images.sh" "${missing[@]}" >&2; fi
    echo "export ${exports[*]}"
}

# One preparation at a time (.ci/run starts one in the background; the test waits for it).
exec 9>"${ESA_ENGINE_LOCK:-/tmp/esa-engine.lock}"
flock 9
install_missing
start_engine
if [ "$WHEELS" = 1 ]; then "$here/make-wheelhouse.sh" --if-stale >&2; fi
if [ "$BASE" = 1 ]; then base_images; fi
