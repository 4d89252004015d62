"""The ``deploy`` marker: tests that run docker-compose.yml on a real Docker engine.

They need root (to install and start the engine when missing: deploy/engine.sh) or an engine
that answers already. Elsewhere they are skipped, except under ``CI=true``, where they are
required: a missing engine there fails the run instead of passing it silently.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deploy: docker compose on a real Docker engine (tests/deploy/)"
    )
