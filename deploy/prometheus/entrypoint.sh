#!/bin/sh
# Prometheus with the shufflers' metrics credential in a file (prometheus.yml's
# `authorization: credentials_file`), never on its command line or in its configuration.
# compose passes the credential as ESA_METRICS_TOKEN and mounts a tmpfs on
# /run/esa-prometheus: the file lives in memory, readable by this user only.
set -eu
: "${ESA_METRICS_TOKEN:?ESA_METRICS_TOKEN (the shufflers' metrics bearer token) is not set}"
umask 077
printf '%s' "$ESA_METRICS_TOKEN" >/run/esa-prometheus/metrics-token
unset ESA_METRICS_TOKEN
exec /bin/prometheus \
    --config.file=/etc/esa-prometheus/prometheus.yml \
    --storage.tsdb.path=/prometheus \
    --storage.tsdb.retention.time=15d \
    --web.listen-address=:9090 \
    "$@"
