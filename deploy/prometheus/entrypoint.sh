#!/bin/sh
# Prometheus with each party's metrics token in a file of its own (prometheus.yml's
# `authorization: credentials_file`: /run/secrets/<party>-metrics-token, the Docker secrets
# compose mounts), never on its command line, in its configuration or in its environment.
# Refuses to start when one is missing or unreadable (naming the file, never its content),
# rather than scrape that target without a credential.
set -eu
for party in analyzer shuffler-1 shuffler-2 shuffler-3; do
    token=/run/secrets/$party-metrics-token
    if [ ! -r "$token" ] || [ ! -s "$token" ] || [ -d "$token" ]; then
        echo "esa-prometheus: $token (the Docker secret $party-metrics-token) is missing or unreadable" >&2
        exit 1
    fi
done
exec /bin/prometheus \
    --config.file=/etc/esa-prometheus/prometheus.yml \
    --storage.tsdb.path=/prometheus \
    --storage.tsdb.retention.time=15d \
    --web.listen-address=:9090 \
    "$@"
