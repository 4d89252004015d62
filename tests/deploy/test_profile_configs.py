"""The compose profiles' configuration files, without a Docker engine (fast; tests/deploy/
test_monitoring.py and test_replicas.py run them for real).

* deploy/prometheus/alerts.yml: ``promtool check rules`` and the rules' unit tests
  (``promtool test rules alerts.test.yml``: each alert fires on the series it is about and
  none on a healthy deployment); every metric the rules name is one the services export.
* deploy/haproxy/<domain>.cfg: what deploy/haproxy/render.py generates from
  runtime/haproxy.py now (no drift), and ``haproxy -c`` accepts it.
* deploy/compose.audit.yml (docs/audit.md's staging audit): ``docker compose -f
  docker-compose.yml -f deploy/compose.audit.yml config`` accepts it and wires shuffler-1 to
  the audit sink (which relays every other channel to the analyzer), leaving every other
  service as it is; compose needs no engine for ``config``.

promtool comes with Debian's ``prometheus`` package, which the CI does not install (its
maintainer scripts would start a Prometheus on the CI host): without it these skip, and the
deploy test runs the same two promtool commands inside the Prometheus image, required under
``CI=true``. ``.ci/run`` installs ``haproxy``, and a compose (deploy/engine.sh): both are
required under ``CI=true`` and skip elsewhere when absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.deploy.stack import rule_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
HAPROXY = ROOT / "deploy" / "haproxy"


def _tool(name: str, *also: Path) -> str:
    found = shutil.which(name) or next((str(p) for p in also if p.exists()), None)
    required = name in ("haproxy", "docker-compose")
    if found is None and required and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = _tool("promtool")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        done = subprocess.run(
            [promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def test_alert_rules_name_only_metrics_the_services_export() -> None:
    from analyzer.metrics import COUNTERS as ANALYZER_COUNTERS
    from analyzer.metrics import GAUGES
    from shuffler.metrics import COUNTERS as SHUFFLER_COUNTERS

    # prometheus_client exposes a counter ``x`` as ``x_total``.
    counters = [f"esa_shuffler_{name}" for name in SHUFFLER_COUNTERS]
    counters += ["esa_shuffler_contributions_deleted"]
    counters += [f"esa_analyzer_{name}" for name in ANALYZER_COUNTERS]
    exported = {f"{name}_total" for name in counters} | {"up", "esa_shuffler_queue_depth"}
    exported |= {f"esa_analyzer_{name}" for name in GAUGES} | {"esa_analyzer_parts_unopened"}
    named = rule_metrics()
    assert named and named <= exported, named - exported


def test_haproxy_configs_are_generated_from_esa_ups_and_valid() -> None:
    done = subprocess.run(
        [sys.executable, str(HAPROXY / "render.py"), "--check"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    haproxy = _tool("haproxy", Path("/usr/sbin/haproxy"))
    for domain in ("shuffler-1", "shuffler-2", "shuffler-3"):
        config = HAPROXY / f"{domain}.cfg"
        checked = subprocess.run(
            [haproxy, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        text = config.read_text()
        assert f"server {domain}-r2 {domain}-r2:" in text and "uri /readyz" in text


# --- deploy/compose.audit.yml ---------------------------------------------------------------


def _compose() -> list[str]:
    """``docker compose`` (v2) when it answers, else ``docker-compose`` (1.29, engine.sh's)."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return [_tool("docker-compose")]


def _config(*files: str, sink_token: str | None = "y" * 32) -> subprocess.CompletedProcess[str]:
    # The secrets are files (Docker secrets): ``config`` names them without reading them.
    inherited = ("COMPOSE_FILE", "COMPOSE_PROFILES", "ESA_AUDIT_SINK_TOKEN", "ESA_SECRETS_DIR")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["COMPOSE_PROJECT_NAME"] = "esa-audit-config-test"
    if sink_token is not None:
        env["ESA_AUDIT_SINK_TOKEN"] = sink_token
    command = [*_compose(), *(a for f in files for a in ("-f", f)), "config"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _services(*files: str) -> dict[str, dict[str, Any]]:
    done = _config(*files)
    assert done.returncode == 0, done.stderr
    services: dict[str, dict[str, Any]] = yaml.safe_load(done.stdout)["services"]
    return services


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only), from 1.29's short or v2's long syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, mode == ["ro"])
        else:
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return mounts


def _ports(service: dict[str, Any]) -> set[str]:
    """``host_ip:published:target`` of each published port, from either syntax."""
    ports = set()
    for port in service.get("ports", []):
        if isinstance(port, str):
            ports.add(port.removesuffix("/tcp"))
        else:
            ports.add(f"{port.get('host_ip', '')}:{port['published']}:{port['target']}")
    return ports


def test_audit_override_wires_shuffler_1_to_a_relaying_sink() -> None:
    base = _services("docker-compose.yml")
    audit = _services("docker-compose.yml", "deploy/compose.audit.yml")
    sink, shuffler = audit["audit-sink"], audit["shuffler-1"]
    # The sink: the deployment's image, serving the records on the host's loopback only.
    assert sink["image"] == base["analyzer"]["image"] == "esa-pipeline:latest"
    command = sink["command"]
    assert command[:2] == ["audit", "sink"]
    option = dict(zip(command[2::2], command[3::2], strict=True))
    assert option["--host"] == "0.0.0.0" and option["--keep-channel"] == "audit"
    assert option["--relay"] == base["shuffler-2"]["environment"]["ESA_SHUFFLER_ANALYZER_URL"]
    assert _ports(sink) == {f"127.0.0.1:{option['--port']}:{option['--port']}"}
    assert "ESA_AUDIT_SINK_TOKEN" in sink["environment"] and "healthcheck" in sink
    assert sink["depends_on"]["analyzer"]["condition"] == "service_healthy"
    # Its record file is on a volume the image's user owns (deploy/Dockerfile's mkdir).
    record = Path(option["--record"])
    assert _mounts(sink)[str(record.parent)][0].endswith("reports")
    assert str(record.parent) in (ROOT / "deploy" / "Dockerfile").read_text()
    # shuffler-1 forwards to the sink and enforces var/audit's channel file, read-only.
    env = shuffler["environment"]
    assert env["ESA_SHUFFLER_ANALYZER_URL"] == f"http://audit-sink:{option['--port']}"
    channels = Path(env["ESA_SHUFFLER_CHANNELS_FILE"])
    source, read_only = _mounts(shuffler)[str(channels.parent)]
    assert Path(source) == ROOT / "var" / "audit" and read_only
    # Nothing else changes: shuffler-1's other settings, and every other service.
    changed = {k for k in env if env[k] != base["shuffler-1"]["environment"].get(k)}
    assert changed == {"ESA_SHUFFLER_ANALYZER_URL", "ESA_SHUFFLER_CHANNELS_FILE"}
    assert set(audit) == set(base) | {"audit-sink"}
    for name in set(base) - {"shuffler-1"}:
        assert _comparable(audit[name]) == _comparable(base[name]), name


def _comparable(service: dict[str, Any]) -> dict[str, Any]:
    """``service`` with its mounts as a mapping, its networks and secrets as sets and without
    ``pull_policy``: docker-compose 1.29 reorders volumes and secrets, writes a network's empty
    settings as ``{}`` instead of null and drops ``pull_policy`` when it merges files (hence
    docs/audit.md's ``up --no-deps``: every service's config hash changes)."""
    unordered = ("pull_policy", "volumes", "networks", "secrets")
    kept = {k: v for k, v in service.items() if k not in unordered}
    secrets = {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}
    networks = set(service.get("networks") or ())
    return {**kept, "volumes": _mounts(service), "networks": networks, "secrets": secrets}


def test_audit_override_refuses_to_run_without_the_sink_token() -> None:
    done = _config("docker-compose.yml", "deploy/compose.audit.yml", sink_token=None)
    assert done.returncode != 0 and "ESA_AUDIT_SINK_TOKEN" in done.stderr, done.stderr
