"""Analyzer settings: the admin token may be a placeholder only in development."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from analyzer.settings import LIFETIME_DELTA, AnalyzerSettings


def _settings(**values: object) -> AnalyzerSettings:
    return AnalyzerSettings(channels_file=None, shufflers_file=None, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize("token", ["development", "changeme", "short-secret"])
def test_production_refuses_a_placeholder_admin_token(token: str) -> None:
    with pytest.raises(ValidationError, match="admin_token"):
        _settings(environment="production", admin_token=SecretStr(token))


def test_development_accepts_the_placeholder_and_production_a_real_token() -> None:
    assert _settings().admin_token.get_secret_value() == "development"
    real = _settings(environment="production", admin_token=SecretStr("x" * 32))
    assert real.lifetime_delta == LIFETIME_DELTA


def test_device_budget_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESA_ANALYZER_DEVICE_BUDGET", '{"lifetime_eps": 40}')
    settings = AnalyzerSettings()
    assert settings.device_budget is not None and settings.device_budget.lifetime_eps == 40
    monkeypatch.setenv("ESA_ANALYZER_DEVICE_BUDGET", '{"window_eps": 4}')
    with pytest.raises(ValueError, match="go together"):
        AnalyzerSettings()


def test_the_renamed_intake_slots_setting_is_refused_not_ignored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ESA_ANALYZER_INTAKE_SLOTS`` became ``ESA_ANALYZER_INTAKE_SLOTS_PER_SHUFFLER``: an
    operator still setting the old one (environment, ``.env`` file, keyword) is told so at
    start rather than silently getting the default."""
    named = "ESA_ANALYZER_INTAKE_SLOTS_PER_SHUFFLER"
    monkeypatch.setenv("ESA_ANALYZER_INTAKE_SLOTS", "8")
    with pytest.raises(ValidationError, match=named):
        AnalyzerSettings()
    monkeypatch.delenv("ESA_ANALYZER_INTAKE_SLOTS")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("ESA_ANALYZER_INTAKE_SLOTS=8\n")
    with pytest.raises(ValidationError, match=named):
        AnalyzerSettings()
    (tmp_path / ".env").unlink()
    with pytest.raises(ValidationError, match=named):
        AnalyzerSettings(intake_slots=8)  # type: ignore[call-arg]
    monkeypatch.setenv(named, "8")
    assert AnalyzerSettings().intake_slots_per_shuffler == 8
