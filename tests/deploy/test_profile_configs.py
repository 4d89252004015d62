"""The compose profiles' configuration files, without a Docker engine (fast; tests/deploy/
test_monitoring.py and test_replicas.py run them for real).

* deploy/prometheus/alerts.yml: ``promtool check rules`` and the rules' unit tests
  (``promtool test rules alerts.test.yml``: each alert fires on the series it is about and
  none on a healthy deployment); every metric the rules name is one the services export.
* deploy/haproxy/<domain>.cfg: what deploy/haproxy/render.py generates from
  services/runtime/haproxy.py now (no drift), and ``haproxy -c`` accepts it.

promtool comes with Debian's ``prometheus`` package, which the CI does not install (its
maintainer scripts would start a Prometheus on the CI host): without it these skip, and the
deploy test runs the same two promtool commands inside the Prometheus image, required under
``CI=true``. ``.ci/run`` installs ``haproxy``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.stack import rule_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
HAPROXY = ROOT / "deploy" / "haproxy"


def _tool(name: str, *also: Path) -> str:
    found = shutil.which(name) or next((str(p) for p in also if p.exists()), None)
    if found is None and name == "haproxy" and os.environ.get("CI", "").lower() == "true":
        pytest.fail("haproxy is not installed (.ci/run installs it)")
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
