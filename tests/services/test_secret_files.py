"""Secrets given as files (``ESA_<SERVICE>_<NAME>_FILE``, Docker secrets) reach the settings,
never both ways at once, and placeholders are refused outside development whichever way they
come (runtime/secrets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from analyzer.settings import AnalyzerSettings
from runtime.secrets import settings_problems
from shuffler.settings import ShufflerSettings


def _secret(tmp_path: Path, name: str, value: str) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    return str(path)


def test_secrets_come_from_the_files_their_variables_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TOKEN_SECRET", "ADMIN_TOKEN", "METRICS_TOKEN"):
        value = f"{name.lower()}-of-shuffler-1-xyz"
        monkeypatch.setenv(f"ESA_SHUFFLER_{name}_FILE", _secret(tmp_path, name, value))
    url = "postgresql+psycopg://shuffler_1:pw@db-1:5432/shuffler_1"
    monkeypatch.setenv("ESA_SHUFFLER_DATABASE_URL_FILE", _secret(tmp_path, "db", url))
    monkeypatch.setenv("ESA_SHUFFLER_ENVIRONMENT", "production")
    settings = ShufflerSettings()
    assert settings.admin_token.get_secret_value() == "admin_token-of-shuffler-1-xyz"
    assert settings.metrics_token is not None
    assert settings.metrics_token.get_secret_value() == "metrics_token-of-shuffler-1-xyz"
    assert settings.database_url == url
    monkeypatch.setenv(
        "ESA_ANALYZER_ADMIN_TOKEN_FILE", _secret(tmp_path, "a", "analyzer-admin-0123")
    )
    assert AnalyzerSettings().admin_token.get_secret_value() == "analyzer-admin-0123"


def test_a_secret_given_both_ways_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ESA_ANALYZER_ADMIN_TOKEN", "one-value-of-the-token")
    monkeypatch.setenv("ESA_ANALYZER_ADMIN_TOKEN_FILE", _secret(tmp_path, "t", "another-value"))
    with pytest.raises(
        ValueError, match="ESA_ANALYZER_ADMIN_TOKEN or ESA_ANALYZER_ADMIN_TOKEN_FILE"
    ):
        AnalyzerSettings()


def test_an_unreadable_secret_file_is_named_but_never_its_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("ESA_SHUFFLER_ADMIN_TOKEN_FILE", str(missing))
    with pytest.raises(ValueError, match=f"ESA_SHUFFLER_ADMIN_TOKEN_FILE={missing}"):
        ShufflerSettings()


@pytest.mark.parametrize("value", ["development", "short-token", "changeme"])
def test_a_placeholder_from_a_file_is_refused_in_production(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ESA_ANALYZER_ENVIRONMENT", "production")
    monkeypatch.setenv("ESA_ANALYZER_ADMIN_TOKEN", "a-real-admin-token-value")
    monkeypatch.setenv("ESA_ANALYZER_METRICS_TOKEN_FILE", _secret(tmp_path, "m", value))
    with pytest.raises(ValidationError, match="metrics_token must be set to a real secret"):
        AnalyzerSettings()


def test_a_settings_error_names_the_setting_never_a_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pydantic quotes the settings it was given; a secret read from a file must not reach
    the error a service prints at start."""
    url = "postgresql+psycopg://u:SuperSecretPassw0rd@db/esa"
    monkeypatch.setenv("ESA_ANALYZER_DATABASE_URL_FILE", _secret(tmp_path, "db", url))
    monkeypatch.setenv("ESA_ANALYZER_ENVIRONMENT", "production")
    monkeypatch.setenv("ESA_ANALYZER_ADMIN_TOKEN", "short")
    with pytest.raises(ValidationError) as refused:
        AnalyzerSettings()
    problems = settings_problems(refused.value)
    assert "admin_token must be set to a real secret" in problems
    assert "SuperSecretPassw0rd" not in problems and "short" not in problems.split(":", 1)[0]
