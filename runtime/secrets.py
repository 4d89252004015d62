"""Secrets in the services' settings: read from files when the deployment gives them as files
(Docker secrets, ``/run/secrets/...``), and refused when they are placeholders outside
development.

A secret setting ``X`` of a service with prefix ``ESA_SHUFFLER_`` comes from the environment
variable ``ESA_SHUFFLER_X`` or from the file that ``ESA_SHUFFLER_X_FILE`` names (its content,
surrounding whitespace removed), never both: a file keeps the value out of the process
environment, which ``docker inspect`` and ``/proc/<pid>/environ`` show.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

#: Values refused as secrets outside development.
PLACEHOLDERS = frozenset({"", "changeme", "change-me", "secret", "development"})
#: Shortest secret accepted outside development.
MIN_SECRET_LENGTH = 16


class SecretFilesSource(PydanticBaseSettingsSource):
    """Settings source for the ``<PREFIX><NAME>_FILE`` variables of the secret fields
    ``names``."""

    def __init__(self, settings_cls: type[BaseSettings], names: tuple[str, ...]) -> None:
        super().__init__(settings_cls)
        self.names = names

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Unused: :meth:`__call__` reads every named field at once."""
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        """The secret values given as files.

        Raises:
            ValueError: a variable and its ``_FILE`` twin are both set, or the file cannot be
                read (naming the variable and the path, never the content).
        """
        prefix = str(self.config.get("env_prefix", ""))
        found: dict[str, Any] = {}
        for name in self.names:
            variable = f"{prefix}{name.upper()}"
            path = os.environ.get(f"{variable}_FILE")
            if not path:
                continue
            if os.environ.get(variable):
                raise ValueError(f"set {variable} or {variable}_FILE, not both")
            try:
                found[name] = Path(path).read_text().strip()
            except OSError as error:
                raise ValueError(f"{variable}_FILE={path}: {error.strerror or error}") from error
        return found


class SecretFileSettings(BaseSettings):
    """A service's settings whose :attr:`secret_fields` may also come from files."""

    secret_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments first, then ``<PREFIX><NAME>_FILE`` files, then the environment."""
        files = SecretFilesSource(settings_cls, cls.secret_fields)
        return init_settings, files, env_settings, dotenv_settings, file_secret_settings


def settings_problems(error: Exception) -> str:
    """What is wrong with a service's settings, without any value it was given: pydantic's
    own message quotes the input, secrets read from files included."""
    if not isinstance(error, ValidationError):
        return str(error)
    return "; ".join(
        f"{'.'.join(str(p) for p in problem['loc']) or 'settings'}: {problem['msg']}"
        for problem in error.errors(include_input=False, include_url=False)
    )


def refuse_placeholder(name: str, value: str, environment: str) -> None:
    """Outside development, a secret must be set to something real.

    Raises:
        ValueError: naming the setting (never its value).
    """
    if environment != "development" and (
        value.lower() in PLACEHOLDERS or len(value) < MIN_SECRET_LENGTH
    ):
        raise ValueError(
            f"{name} must be set to a real secret (>= {MIN_SECRET_LENGTH} chars) in {environment}"
        )
