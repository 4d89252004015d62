"""The ``deploy`` marker: tests that run docker-compose.yml on a real Docker engine, and the
compose project they share (``stack``, started once for the package and taken down after its
last test, so its dozen idle containers do not slow the rest of the suite: the base
deployment, to which test_monitoring.py and test_replicas.py add their profiles).

They need root (to install and start the engine when missing: deploy/engine.sh) or an engine
that answers already. Elsewhere they are skipped, except under ``CI=true``, where they are
required: a missing engine there fails the run instead of passing it silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.deploy.stack import (
    PORTS,
    Stack,
    compose_command,
    free,
    make_secrets,
    prepare_engine,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deploy: docker compose on a real Docker engine (tests/deploy/)"
    )


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    images = prepare_engine()
    # Every party's secrets, made as a user makes them (deploy/party_secrets.py), in a
    # folder of this session's rather than the repository's deploy/secrets/.
    folder = tmp_path_factory.mktemp("esa-deploy") / "secrets"
    secrets = make_secrets(folder)
    env = {
        **os.environ,
        **images,
        "ESA_SECRETS_DIR": str(folder),
        "ESA_ENROLL_PER_MINUTE": "120000",
    }
    for inherited in ("COMPOSE_PROJECT_NAME", "COMPOSE_PROFILES", "ESA_SHUFFLER_URL_TEMPLATE"):
        env.pop(inherited, None)
    deployment = Stack(compose_command(), env, secrets)
    deployment.down(volumes=True, timeout=120)  # what an earlier (or interrupted) run left
    taken = [port for port in PORTS.values() if not free(port)]
    assert not taken, f"ports {taken} are taken on 127.0.0.1: the compose file publishes them"
    try:
        # One build of each image: docker-compose 1.29 builds every service that has a
        # `build` (five times esa-pipeline); `up` then finds the images.
        deployment.run("build", "postgres-analyzer", "analyzer", timeout=900)
        deployment.run("up", "-d", timeout=300)
        deployment.wait_healthy()
        deployment.wait_config()  # every shuffler's signed descriptor fetched
        yield deployment
    finally:
        print(deployment.logs())
        deployment.down(volumes=True, check=False)
