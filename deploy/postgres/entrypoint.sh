#!/bin/sh
# The entrypoint of esa-postgres (deploy/postgres/Dockerfile), in front of the base image's own
# docker-entrypoint.sh (the official image's or the stand-in's of deploy/build-base-images.sh).
#
# docker-compose.yml gives each trust domain's server its password as a Docker secret, a file
# that POSTGRES_PASSWORD_FILE names. The official entrypoint reads such a file; the stand-in's
# does not, so this reads it for both: only when the data directory is still empty (the
# password is needed once, by initdb; an initialised server keeps its role's password hash and
# runs without it in its environment), and never with POSTGRES_PASSWORD set as well. It
# refuses a placeholder or a password shorter than 16 characters, naming the file, never the
# value.
set -eu
: "${PGDATA:=/var/lib/postgresql/data}"
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    if [ -n "${POSTGRES_PASSWORD:-}" ]; then
        echo "esa-postgres: set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE, not both" >&2
        exit 1
    fi
    if [ ! -r "$POSTGRES_PASSWORD_FILE" ] || [ -d "$POSTGRES_PASSWORD_FILE" ]; then
        echo "esa-postgres: POSTGRES_PASSWORD_FILE=$POSTGRES_PASSWORD_FILE is not a readable file" >&2
        exit 1
    fi
    password=$(cat "$POSTGRES_PASSWORD_FILE")
    case "$password" in
        changeme | change-me | secret | development | password | postgres)
            short=yes ;;
        *) if [ ${#password} -lt 16 ]; then short=yes; else short=no; fi ;;
    esac
    if [ "$short" = yes ]; then
        echo "esa-postgres: $POSTGRES_PASSWORD_FILE holds a placeholder or fewer than 16 characters" >&2
        exit 1
    fi
    unset POSTGRES_PASSWORD_FILE
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        POSTGRES_PASSWORD=$password
        export POSTGRES_PASSWORD
    fi
    unset password
fi
exec docker-entrypoint.sh "$@"
