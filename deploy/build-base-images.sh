#!/usr/bin/env bash
# Stand-in base images for machines that cannot pull from a public image registry.
#
# deploy/Dockerfile and deploy/postgres/Dockerfile start FROM the official images
# (python:3.11.x-slim-bookworm, postgres:16.x-bookworm; pinned there). Where no registry is
# reachable, this script builds two local images from Debian's own packages instead:
#
#   esa-base/python:3.11-bookworm    Debian bookworm minbase + python3 (3.11), python3-venv,
#                                    python-is-python3, ca-certificates
#   esa-base/postgres:15-bookworm    Debian bookworm minbase + postgresql-15, and an entrypoint
#                                    that does what our compose file needs of the official one:
#                                    POSTGRES_USER / POSTGRES_PASSWORD (/ POSTGRES_DB), runs
#                                    /docker-entrypoint-initdb.d/*.sql|*.sh once, on an empty
#                                    data directory, listens on TCP only once initialised (so
#                                    `pg_isready -h 127.0.0.1` is a real readiness check),
#                                    runs as the `postgres` user (`docker import` cannot
#                                    set STOPSIGNAL: deploy/postgres/Dockerfile sets SIGINT).
#   esa-base/prometheus:2.42-bookworm  Debian bookworm minbase + prometheus (2.42, with promtool):
#                                    the `monitoring` profile's deploy/prometheus/Dockerfile
#   esa-base/haproxy:2.6-bookworm    Debian bookworm minbase + haproxy (2.6): the `replicas`
#                                    profile's deploy/haproxy/Dockerfile
#
# Each one is `debootstrap --variant=minbase bookworm` + `apt-get install` in the chroot +
# `docker import` (about 45 s for both on 2 cores; needs root, debootstrap and a Debian
# mirror, nothing from an image registry). Images that already exist are skipped (--force
# rebuilds them). Then point the builds at them:
#
#   export PYTHON_IMAGE=esa-base/python:3.11-bookworm \
#          POSTGRES_IMAGE=esa-base/postgres:15-bookworm \
#          PROMETHEUS_IMAGE=esa-base/prometheus:2.42-bookworm \
#          HAPROXY_IMAGE=esa-base/haproxy:2.6-bookworm        # read by docker-compose.yml
#   docker compose build                                     # or docker-compose build
#
# Nothing else changes: the images provide what deploy/Dockerfile and the compose file use
# (python3 -m venv, useradd; pg_isready, the initdb.d convention, PGDATA at
# /var/lib/postgresql/data). PostgreSQL 15 instead of 16 is fine for a fresh data volume, not
# for one that a 16 server initialised (PostgreSQL refuses to start on it, it loses nothing).
set -euo pipefail

PYTHON_TAG=esa-base/python:3.11-bookworm
POSTGRES_TAG=esa-base/postgres:15-bookworm
PROMETHEUS_TAG=esa-base/prometheus:2.42-bookworm
HAPROXY_TAG=esa-base/haproxy:2.6-bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
FORCE=0
WANT=()

usage() {
    cat <<EOF
Usage: deploy/build-base-images.sh [--force] [--mirror URL] [python] [postgres] [prometheus] [haproxy]
       deploy/build-base-images.sh --print python|postgres|prometheus|haproxy

Builds local stand-ins for the official base images from Debian bookworm packages
(debootstrap --variant=minbase + apt-get + docker import), for machines that cannot pull
python:3.11-slim / postgres:16 from a registry:

  python    ${PYTHON_TAG}    (python3 3.11, python3-venv, ca-certificates)
  postgres  ${POSTGRES_TAG}  (postgresql-15 + an official-image-like entrypoint)
  prometheus ${PROMETHEUS_TAG} (prometheus 2.42 + promtool; profile monitoring)
  haproxy   ${HAPROXY_TAG}  (haproxy 2.6; profile replicas)

With no image named, builds python and postgres. An image that already exists is skipped.

  --force        rebuild even if the image exists
  --print NAME   print the tag of that stand-in and exit (deploy/engine.sh uses it)
  --mirror URL   Debian mirror (default: \$DEBIAN_MIRROR or ${MIRROR});
                 \$DEBIAN_SECURITY_MIRROR sets the security mirror (${SECURITY_MIRROR})
  -h, --help     this help

Needs root, debootstrap and a running Docker engine. Then:
  export PYTHON_IMAGE=${PYTHON_TAG} POSTGRES_IMAGE=${POSTGRES_TAG}
  docker compose build      # or: docker-compose build
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --force) FORCE=1 ;;
        --print)
            case "${2:-}" in
                python) echo "$PYTHON_TAG" ;;
                postgres) echo "$POSTGRES_TAG" ;;
                prometheus) echo "$PROMETHEUS_TAG" ;;
                haproxy) echo "$HAPROXY_TAG" ;;
                *) echo "--print needs python, postgres, prometheus or haproxy" >&2; exit 2 ;;
            esac
            exit 0 ;;
        --mirror) MIRROR=${2:?--mirror needs a URL}; shift ;;
        --mirror=*) MIRROR=${1#--mirror=} ;;
        python | postgres | prometheus | haproxy) WANT+=("$1") ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ ${#WANT[@]} -gt 0 ] || WANT=(python postgres)

log() { printf '[build-base-images] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { log "must run as root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install debootstrap"; exit 1; }
docker info >/dev/null 2>&1 || { log "no Docker engine answers (docker info)"; exit 1; }

ROOTS=()
cleanup() {
    local root
    for root in "${ROOTS[@]}"; do
        umount "$root/proc" 2>/dev/null || true
        rm -rf --one-file-system "$root" "$root".*log
    done
}
trap cleanup EXIT

# A minbase bookworm (debootstrapped once per run, in $SEED), copied into a new directory
# ($ROOT) for each image.
SEED=
make_root() {
    if [ -z "$SEED" ]; then
        SEED=$(mktemp -d /var/tmp/esa-base.XXXXXX)
        ROOTS+=("$SEED")
        log "debootstrap --variant=minbase bookworm ($MIRROR)"
        debootstrap --variant=minbase bookworm "$SEED" "$MIRROR" >"$SEED.log" 2>&1 || {
            tail -20 "$SEED.log" >&2; exit 1; }
        rm -f "$SEED.log"
        cat >"$SEED/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
EOF
        # No service may start inside the chroot; keep images small (as the official images do).
        printf '#!/bin/sh\nexit 101\n' >"$SEED/usr/sbin/policy-rc.d"
        chmod +x "$SEED/usr/sbin/policy-rc.d"
        cat >"$SEED/etc/dpkg/dpkg.cfg.d/01-esa-slim" <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
EOF
        printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
            >"$SEED/etc/apt/apt.conf.d/01-esa-no-recommends"
    fi
    ROOT=$(mktemp -d /var/tmp/esa-base.XXXXXX)
    ROOTS+=("$ROOT")
    cp -a "$SEED/." "$ROOT/"
}

install_in() {
    local root=$1
    shift
    mount -t proc proc "$root/proc"
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -ec 'apt-get update -q && apt-get -y -q upgrade && apt-get install -y -q "$@"' sh "$@" \
        >"$root.install.log" 2>&1 || { tail -30 "$root.install.log" >&2; exit 1; }
    rm -f "$root.install.log"
    umount "$root/proc"
}

finish_and_import() {
    local root=$1 tag=$2
    shift 2
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/apt/* \
        "$root"/var/log/dpkg.log "$root"/var/cache/debconf/*-old "$root"/tmp/* \
        "$root/usr/sbin/policy-rc.d"
    : >"$root/etc/machine-id"
    log "docker import -> $tag"
    tar --numeric-owner --xattrs -C "$root" -c . | docker import "$@" \
        --message "esa stand-in base image (debootstrap bookworm, $(date -u +%Y-%m-%d))" - "$tag" >/dev/null
}

exists() { [ "$FORCE" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

build_python() {
    if exists "$PYTHON_TAG"; then log "$PYTHON_TAG exists, skipped"; return; fi
    local start=$SECONDS root
    make_root
    root=$ROOT
    install_in "$root" python3 python3-venv python-is-python3 ca-certificates
    finish_and_import "$root" "$PYTHON_TAG" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]'
    log "$PYTHON_TAG built in $((SECONDS - start)) s"
}

build_postgres() {
    if exists "$POSTGRES_TAG"; then log "$POSTGRES_TAG exists, skipped"; return; fi
    local start=$SECONDS root
    make_root
    root=$ROOT
    # Debian's postgresql-common would create and start a "main" cluster: the entrypoint
    # makes the only cluster, in PGDATA, on first start.
    mkdir -p "$root/etc/postgresql-common/createcluster.d"
    printf 'create_main_cluster = false\n' >"$root/etc/postgresql-common/createcluster.d/esa.conf"
    install_in "$root" postgresql-15
    mkdir -p "$root/docker-entrypoint-initdb.d" "$root/var/lib/postgresql/data" "$root/var/run/postgresql"
    chroot "$root" chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
    chmod 700 "$root/var/lib/postgresql/data"
    chmod 2777 "$root/var/run/postgresql"
    install -m 0755 /dev/stdin "$root/usr/local/bin/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# Stand-in for the official postgres image's entrypoint (deploy/build-base-images.sh): on an
# empty PGDATA, initdb with POSTGRES_USER/POSTGRES_PASSWORD, create POSTGRES_DB, run
# /docker-entrypoint-initdb.d/*.sql and *.sh against a server reachable only through its
# Unix socket; then run postgres listening on every address (password auth, scram-sha-256).
set -eu
: "${PGDATA:=/var/lib/postgresql/data}"
export PGDATA
if [ "${1:-postgres}" != postgres ] && [ "${1#-}" = "${1:-x}" ]; then
    exec "$@"                      # another command, e.g. `psql ...` or `bash`
fi
[ "${1:-}" = postgres ] && shift
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    find "$PGDATA" \! -user postgres -exec chown postgres:postgres {} +
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" postgres "$@"
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "error: database is uninitialized and POSTGRES_PASSWORD is not set" >&2
        exit 1
    fi
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 ${POSTGRES_INITDB_ARGS:-}
    rm -f "$pwfile"
    printf '\nhost all all all scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -c unix_socket_directories=/var/run/postgresql" start
    if [ "$db" != postgres ]; then
        psql -v ON_ERROR_STOP=1 -h /var/run/postgresql -U "$user" -d postgres \
            -c "CREATE DATABASE \"$db\""
    fi
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sql) echo "running $f"
                   psql -v ON_ERROR_STOP=1 -h /var/run/postgresql -U "$user" -d "$db" -f "$f" ;;
            *.sh) echo "running $f"; . "$f" ;;
            *) [ -e "$f" ] && echo "ignoring $f" ;;
        esac
    done
    pg_ctl -D "$PGDATA" -m fast -w stop
    echo "PostgreSQL init process complete; ready for start up."
fi
exec postgres -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql "$@"
EOF
    finish_and_import "$root" "$POSTGRES_TAG" \
        --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PGDATA=/var/lib/postgresql/data' \
        --change 'VOLUME /var/lib/postgresql/data' \
        --change 'ENTRYPOINT ["docker-entrypoint.sh"]' \
        --change 'EXPOSE 5432' \
        --change 'CMD ["postgres"]'
    log "$POSTGRES_TAG built in $((SECONDS - start)) s"
}

# Debian's prometheus 2.42 (the official image: 2.53): /bin/prometheus and /bin/promtool
# (merged /usr), /bin/sh and the user nobody, which deploy/prometheus/Dockerfile relies on.
build_prometheus() {
    if exists "$PROMETHEUS_TAG"; then log "$PROMETHEUS_TAG exists, skipped"; return; fi
    local start=$SECONDS root
    make_root
    root=$ROOT
    install_in "$root" prometheus
    rm -rf "$root"/var/lib/prometheus/*
    finish_and_import "$root" "$PROMETHEUS_TAG" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'USER nobody' \
        --change 'EXPOSE 9090' \
        --change 'ENTRYPOINT ["/bin/prometheus"]' \
        --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml"]'
    log "$PROMETHEUS_TAG built in $((SECONDS - start)) s"
}

# Debian's haproxy 2.6 (the official image: 3.0): `haproxy` on PATH and the user haproxy,
# which deploy/haproxy/Dockerfile relies on.
build_haproxy() {
    if exists "$HAPROXY_TAG"; then log "$HAPROXY_TAG exists, skipped"; return; fi
    local start=$SECONDS root
    make_root
    root=$ROOT
    install_in "$root" haproxy
    finish_and_import "$root" "$HAPROXY_TAG" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENTRYPOINT ["haproxy", "-W", "-db"]' \
        --change 'CMD ["-f", "/etc/haproxy/haproxy.cfg"]'
    log "$HAPROXY_TAG built in $((SECONDS - start)) s"
}

for image in "${WANT[@]}"; do
    "build_$image"
done
