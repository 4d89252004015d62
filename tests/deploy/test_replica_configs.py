"""Prometheus and the ``replicas`` profile (issue 17), from the configuration files alone (fast,
no Docker engine; tests/deploy/test_replicas.py checks the same against the running stack).

* deploy/prometheus/prometheus.yml scrapes every process of docker-compose.yml: the services
  of no profile as static targets, and each shuffler process the ``replicas`` profile adds
  (``shuffler-<i>-r2``) through DNS discovery on its name and port, so none is a target
  without the profile (a static target that is absent would be down, and EsaServiceDown
  would fire on a deployment that is fine). One scrape config per trust domain, with that
  party's own metrics token (the Docker secret compose gives Prometheus) and only that
  party's processes as targets. The relabelling gives every shuffler process the ``job``
  ``shuffler`` and a discovered replica the labels of its trust domain's first process:
  ``trust_domain``, its own ``service``, and an ``instance`` by name (``shuffler-2-r2:8102``)
  rather than the container's address.
* deploy/prometheus/alerts.yml reads the queue depths, which every process of a trust domain
  reads from the same database, once per trust domain (``max by (trust_domain)``): two
  processes do not make two alerts or a doubled value (``promtool test rules`` runs the
  rules on two processes' series: alerts.test.yml, in tests/deploy/test_profile_configs.py
  where promtool is installed and in the Prometheus image in tests/deploy/test_monitoring.py).
"""

from __future__ import annotations

import re
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests.deploy.stack import PORTS, ROOT

PROMETHEUS = ROOT / "deploy" / "prometheus"


def _compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return services


def _jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    return {job["job_name"]: dict(job) for job in config["scrape_configs"]}


def _job(name: str) -> dict[str, Any]:
    return _jobs()[name]


def _port(service: dict[str, Any]) -> int:
    env = service["environment"]
    return int(env.get("ESA_SHUFFLER_PORT") or env["ESA_ANALYZER_PORT"])


def _relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus's ``replace`` relabelling (the only action used): the source labels joined
    by ``;``, matched by the whole regex, ``$n`` expanded into the target label; then
    ``instance`` defaults to ``__address__`` and ``__`` labels are dropped."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", rule
        sources = rule.get("source_labels", [])
        value = rule.get("separator", ";").join(out.get(s, "") for s in sources)
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            template = re.sub(r"\$(\d+)", r"\\g<\1>", str(rule.get("replacement", "$1")))
            out[rule["target_label"]] = match.expand(template)
    out.setdefault("instance", out["__address__"])
    return {k: v for k, v in out.items() if not k.startswith("__")}


def test_prometheus_scrapes_each_process_and_only_the_profiles_as_discovered() -> None:
    services = _compose_services()
    serving = {
        name: _port(s)
        for name, s in services.items()
        if (s.get("command") or [None])[0] in ("analyzer", "shuffler")
    }
    always = {n: p for n, p in serving.items() if not services[n].get("profiles")}
    replicas = {n: p for n, p in serving.items() if services[n].get("profiles") == ["replicas"]}
    assert always == PORTS and set(replicas) == {f"{d}-r2" for d in PORTS if d != "analyzer"}
    jobs = _jobs()
    assert set(jobs) == set(PORTS)  # one scrape config per trust domain
    for party, job in jobs.items():  # each scrapes its own party's processes only
        static = {target for group in job["static_configs"] for target in group["targets"]}
        assert static == {f"{party}:{always[party]}"}, party
    discovered = {
        name: entry["port"]
        for party in PORTS
        if party != "analyzer"
        for entry in jobs[party]["dns_sd_configs"]
        for name in entry["names"]
        if entry["type"] == "A" and name.startswith(f"{party}-r")
    }
    assert discovered == replicas
    assert "dns_sd_configs" not in jobs["analyzer"]  # one analyzer process in compose


def test_each_trust_domain_is_scraped_with_its_own_partys_metrics_token() -> None:
    """The token a scrape config presents is its own party's Docker secret: no party's
    token reaches another's /metrics (each refuses any other), and none is in the file."""
    text = (PROMETHEUS / "prometheus.yml").read_text()
    assert "credentials:" not in text and "bearer_token:" not in text
    prometheus = _compose_services()["prometheus"]
    assert "environment" not in prometheus and "tmpfs" not in prometheus
    assert set(prometheus["secrets"]) == {f"{party}-metrics-token" for party in PORTS}
    for party, job in _jobs().items():
        assert job["authorization"] == {
            "type": "Bearer",
            "credentials_file": f"/run/secrets/{party}-metrics-token",
        }, party
    entrypoint = (PROMETHEUS / "entrypoint.sh").read_text()  # refuses to start without one
    assert "for party in analyzer shuffler-1 shuffler-2 shuffler-3" in entrypoint


def test_a_discovered_replica_is_labelled_as_its_trust_domains_process() -> None:
    for domain in ("shuffler-1", "shuffler-2", "shuffler-3"):
        job = _job(domain)
        rules = job["relabel_configs"]
        for group in job["static_configs"]:  # the static target keeps its labels, job shuffler
            (target,) = group["targets"]
            labels = {"__address__": target, "job": domain, **group["labels"]}
            kept = {k: v for k, v in labels.items() if k[:2] != "__"}
            assert _relabel(labels, rules) == kept | {"instance": target, "job": "shuffler"}
        port = PORTS[domain]
        found = {
            "__address__": f"172.18.0.9:{port}",
            "__meta_dns_name": f"{domain}-r2",
            "job": domain,
        }
        assert _relabel(found, rules) == {
            "job": "shuffler",
            "trust_domain": domain,
            "service": f"{domain}-r2",
            "instance": f"{domain}-r2:{port}",
        }


def test_alert_rules_read_a_trust_domains_queue_depth_once() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    expressions = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    reading = [e for e in expressions if "esa_shuffler_queue_depth" in e]
    assert reading
    for expression in reading:
        uses = expression.count("esa_shuffler_queue_depth")
        assert expression.count("max by (trust_domain) (esa_shuffler_queue_depth") == uses
    tests = (PROMETHEUS / "alerts.test.yml").read_text()
    assert 'instance="shuffler-1-r2:8101", service="shuffler-1-r2"' in tests
