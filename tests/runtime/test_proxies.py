"""Which peers a service takes ``X-Forwarded-For`` from (runtime/proxies.py): named addresses
or networks only, none by default, and the processes ``esa up --replicas`` puts behind HAProxy
trust HAProxy's address."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from analyzer.settings import AnalyzerSettings
from runtime import haproxy
from runtime.proxies import TrustedProxySettings, parse_trusted_proxies, proxy_options
from services.cli import launcher
from shuffler.settings import ShufflerSettings


def test_proxies_are_addresses_or_networks_and_none_is_trusted_by_default() -> None:
    assert parse_trusted_proxies(" 10.0.0.5, 10.1.0.7/24 ,::1") == "10.0.0.5,10.1.0.0/24,::1"
    assert parse_trusted_proxies("") == ""
    for bad in ("*", "haproxy", "10.0.0.300"):
        with pytest.raises(ValueError, match=f"{bad!r} is not an IP address or network"):
            parse_trusted_proxies(bad)
    with pytest.raises(ValidationError, match="trusted_proxies"):
        ShufflerSettings(trusted_proxies="*")
    assert ShufflerSettings().trusted_proxies == AnalyzerSettings().trusted_proxies == ""
    assert proxy_options("") == {"proxy_headers": False}  # not uvicorn's 127.0.0.1 default
    assert proxy_options("10.0.0.5") == {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.5"}


def test_both_services_take_trusted_proxies_from_one_shared_definition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One setting, one definition (runtime.proxies.TrustedProxySettings): read from each
    service's own environment variable, normalized and refused alike."""
    for settings, party in ((AnalyzerSettings, "ANALYZER"), (ShufflerSettings, "SHUFFLER")):
        assert issubclass(settings, TrustedProxySettings)
        assert "trusted_proxies" not in vars(settings).get("__annotations__", {})
        monkeypatch.setenv(f"ESA_{party}_TRUSTED_PROXIES", " 10.0.0.5 , 10.1.0.7/24")
        assert settings().trusted_proxies == "10.0.0.5,10.1.0.0/24"
        monkeypatch.setenv(f"ESA_{party}_TRUSTED_PROXIES", "haproxy")
        with pytest.raises(ValidationError, match="'haproxy' is not an IP address or network"):
            settings()
        monkeypatch.delenv(f"ESA_{party}_TRUSTED_PROXIES")


def test_processes_behind_haproxy_trust_its_address_and_nothing_else_does(tmp_path: Path) -> None:
    specs = launcher.service_specs(tmp_path, 2, 9000)
    assert not any("TRUSTED_PROXIES" in name for spec in specs for name in spec.env)
    processes, _ = launcher.scale(specs, 2, 2, 9000)
    for spec in processes:
        party = "ESA_SHUFFLER" if spec.command[0] == "shuffler" else "ESA_ANALYZER"
        assert spec.env[f"{party}_TRUSTED_PROXIES"] == haproxy.ADDRESS
