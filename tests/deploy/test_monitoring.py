"""docker-compose.yml's ``monitoring`` profile on a real Docker engine (issue 16, item 3).

Added to the running deployment (the session's ``stack``): Prometheus, built from the pinned
official image or Debian's ``prometheus`` package (deploy/build-base-images.sh), scrapes the
analyzer and the three shufflers, each with its own party's metrics token (a Docker secret
file; the tokens differ, and a party's /metrics refuses another's, so every target up means
every target was scraped with its own), and has loaded every alert rule of
deploy/prometheus/alerts.yml; promtool inside the image accepts the rules and their unit tests
(alerts.test.yml). Checked from the host through Prometheus's HTTP API on 127.0.0.1:9090.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]

from tests.deploy.stack import PORTS, ROOT, Stack, free, rule_metrics

pytestmark = pytest.mark.deploy

API = "http://127.0.0.1:9090/api/v1"
RULES = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())


def _get(path: str, **params: str) -> Any:
    answer = httpx.get(f"{API}/{path}", params=params, timeout=10).raise_for_status().json()
    assert answer["status"] == "success", answer
    return answer["data"]


def _targets_up(timeout: float) -> list[dict[str, Any]]:
    """Prometheus's active targets once every one has been scraped and is up."""
    deadline = time.monotonic() + timeout
    targets: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            targets = _get("targets", state="active")["activeTargets"]
        except httpx.HTTPError:  # still starting
            targets = []
        instances = {t["labels"]["instance"] for t in targets}
        static = {f"{name}:{port}" for name, port in PORTS.items()}
        # ⊇, not ==: with the replicas profile up, DNS discovery adds the -r2 processes.
        if static <= instances and all(t["health"] == "up" for t in targets):
            return targets
        time.sleep(2)
    raise AssertionError(f"targets not all up in {timeout} s: {targets}")


def _rules_evaluated(timeout: float) -> dict[str, Any]:
    """Prometheus's rule groups once every rule has been evaluated at least once (so "nothing
    fires" below means the rules ran, not that they never did)."""
    deadline = time.monotonic() + timeout
    groups: dict[str, Any] = {}
    while time.monotonic() < deadline:
        groups = {g["name"]: g for g in _get("rules")["groups"]}
        rules = [r for g in groups.values() for r in g["rules"]]
        if rules and all(r["health"] != "unknown" for r in rules):
            return groups
        time.sleep(2)
    raise AssertionError(f"rules not all evaluated in {timeout} s: {groups}")


def test_prometheus_scrapes_every_service_and_loads_the_alert_rules(stack: Stack) -> None:
    assert free(9090), "127.0.0.1:9090 is taken: the monitoring profile publishes it"
    stack.run("--profile", "monitoring", "build", "prometheus", timeout=600)
    stack.run("--profile", "monitoring", "up", "-d", "--no-deps", "prometheus", timeout=300)
    targets = _targets_up(timeout=90)
    seen = {t["labels"]["instance"]: t for t in targets}
    assert {f"{name}:{port}" for name, port in PORTS.items()} <= set(seen)
    for name in PORTS:
        assert seen[f"{name}:{PORTS[name]}"]["labels"]["service"] == name
    assert {t["labels"]["job"] for t in targets} == {"analyzer", "shuffler"}
    # One scrape config per party, each with its own party's token file (none in the config).
    pools = {
        t["scrapePool"]: t["labels"]["instance"]
        for t in targets
        if "-r" not in t["labels"]["instance"]
    }
    assert pools == {name: f"{name}:{port}" for name, port in PORTS.items()}
    # Up means /metrics answered 200: with its own party's token (with none or another
    # party's, 401 and down).
    received = _get("query", query="esa_shuffler_contributions_received_total")["result"]
    assert sorted(r["metric"]["trust_domain"] for r in received) == [
        "shuffler-1",
        "shuffler-2",
        "shuffler-3",
    ]
    for metric in rule_metrics():  # every series an alert rule reads exists (right names)
        assert _get("query", query=metric)["result"], metric

    groups = _rules_evaluated(timeout=90)
    for group in RULES["groups"]:
        loaded = {r["name"]: r for r in groups[group["name"]]["rules"]}
        assert set(loaded) == {r["alert"] for r in group["rules"]}, group["name"]
        assert all(r["health"] == "ok" for r in loaded.values()), loaded
    # A deployment that just served a run with every part delivered raises nothing.
    firing = [a for a in _get("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == [], firing

    checks = ["/bin/promtool", "check", "rules", "/etc/esa-prometheus/alerts.yml"]
    assert "SUCCESS" in stack.run("--profile", "monitoring", "exec", "-T", "prometheus", *checks)
    unit = ["/bin/sh", "-c", "cd /etc/esa-prometheus && /bin/promtool test rules alerts.test.yml"]
    assert "SUCCESS" in stack.run("--profile", "monitoring", "exec", "-T", "prometheus", *unit)
    logs = stack.run("--profile", "monitoring", "logs", "--no-color", "prometheus")
    leaked = [name for name, value in stack.secrets.items() if value in logs]
    assert not leaked, leaked  # no credential in its logs
    assert stack.health("prometheus") in ("healthy", "starting")
