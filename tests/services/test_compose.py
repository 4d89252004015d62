"""docker-compose.yml runs what ``esa up`` runs: same commands, ports and settings.

This parses the compose file and checks every service against
:func:`services.cli.launcher.service_specs`, and the image build's inputs (.dockerignore, pinned
base images, pull policy); the e2e suite runs those same commands as processes against
PostgreSQL (tests/e2e/test_demo.py), and tests/deploy/test_compose_up.py runs the compose file
itself on a Docker engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from common.collection import TrustAnchors
from common.envelope import load_or_create_ed25519, public_bytes
from common.wire import b64
from services.cli import cli
from services.cli.launcher import LOCAL_SETTINGS, SHARED_SETTINGS, TRUST_FILE, service_specs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
DB = (
    "postgresql+psycopg://esa:${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    "@postgres:5432/esa_{service}"
)
_INIT = [str(a) for a in SERVICES["init"]["command"]]
#: Where devices reach each shuffler: what init registers for the analyzer to fetch each signed
#: descriptor from, and so what each shuffler's descriptor must name (ESA_SHUFFLER_PUBLIC_URL).
SHUFFLER_URL = _INIT[_INIT.index("--shuffler-url-template") + 1]
SPECS = service_specs(
    Path("/var/esa"),
    3,
    8100,
    database_template=DB,
    analyzer_url="http://analyzer:8100",
    profile="production",
    shuffler_url=SHUFFLER_URL,
)
#: What compose may add to the launcher's settings, and why: containers bind all interfaces;
#: shufflers and the analyzer run as production, with real secrets from the environment.
COMPOSE_ONLY = {
    "ESA_ANALYZER_HOST",
    "ESA_ANALYZER_PUBLIC_URL",
    "ESA_ANALYZER_ENVIRONMENT",
    "ESA_ANALYZER_ADMIN_TOKEN",
    "ESA_SHUFFLER_HOST",
    "ESA_SHUFFLER_ENVIRONMENT",
    "ESA_SHUFFLER_TOKEN_SECRET",
    "ESA_SHUFFLER_ADMIN_TOKEN",
    "ESA_SHUFFLER_ENROLL_PER_MINUTE",  # the production default unless ESA_ENROLL_PER_MINUTE
    # Not a setting: the shuffler entrypoint's template for ESA_SHUFFLER_PUBLIC_URL, passed
    # through from the host only when set (the replicas profile's HAProxy URLs).
    "ESA_SHUFFLER_URL_TEMPLATE",
}


def test_the_deployment_services_are_all_there() -> None:
    assert {
        "postgres",
        "init",
        "analyzer",
        "shuffler-1",
        "shuffler-2",
        "shuffler-3",
        "loadgen",
    } <= set(SERVICES)
    assert SERVICES["loadgen"]["profiles"] == ["loadgen"]
    assert (ROOT / SERVICES["analyzer"]["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_each_service_runs_the_launchers_command_port_and_settings(spec: Any) -> None:
    service = SERVICES[spec.name]
    assert service["command"] == list(spec.command)
    env = {k: str(v) for k, v in service["environment"].items()}
    for name, value in spec.env.items():
        assert env.get(name) == value, name
    assert set(env) - set(spec.env) <= COMPOSE_ONLY
    assert service["ports"] == [f"127.0.0.1:{spec.port}:{spec.port}"]
    assert f"http://127.0.0.1:{spec.port}/readyz" in " ".join(service["healthcheck"]["test"])
    for dependency in service["depends_on"].values():
        assert dependency["condition"] in ("service_healthy", "service_completed_successfully")
    if spec.name.startswith("shuffler"):
        assert SHARED_SETTINGS.items() <= env.items()
        assert env["ESA_SHUFFLER_ENVIRONMENT"] == "production"
        assert service["environment"].get("ESA_SHUFFLER_URL_TEMPLATE", "") in ("", None)


def test_secrets_fail_fast_and_satisfy_production_settings() -> None:
    from shuffler.settings import ShufflerSettings

    lines = (ROOT / "docker-compose.yml").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    found = re.findall(r"\$\{([A-Z0-9_]+)([^}]*)\}", text)
    optional = {"ESA_ENROLL_PER_MINUTE"}  # a test deployment's loadgen raises it
    assert all(rest.startswith(":?") for name, rest in found if name not in optional), (
        "every secret must use ${VAR:?}"
    )
    used = {name for name, _ in found}
    assert used == {
        "POSTGRES_PASSWORD",
        "ESA_ADMIN_TOKEN",
        "ESA_SHUFFLER_1_TOKEN_SECRET",
        "ESA_SHUFFLER_2_TOKEN_SECRET",
        "ESA_SHUFFLER_3_TOKEN_SECRET",
        "ESA_ENROLL_PER_MINUTE",
    }
    env = {k: str(v) for k, v in SERVICES["shuffler-1"]["environment"].items()}
    defaults = {k: re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    real = {k: re.sub(r"\$\{[^}]+\}", "s3cret-value-long-enough", v) for k, v in defaults.items()}
    settings = ShufflerSettings(
        **{
            k.removeprefix("ESA_SHUFFLER_").lower(): v
            for k, v in real.items()
            if k != "ESA_SHUFFLER_CHANNELS_FILE"
        }
    )
    assert settings.environment == "production"
    secrets = {
        name: SERVICES[name]["environment"]["ESA_SHUFFLER_TOKEN_SECRET"]
        for name in ("shuffler-1", "shuffler-2", "shuffler-3")
    }
    assert len(set(secrets.values())) == 3, "each shuffler is its own trust domain"
    with pytest.raises(ValueError, match="token_secret"):
        ShufflerSettings(environment="production", token_secret="development")


def test_production_keeps_the_shufflers_default_enrolment_limit() -> None:
    """Issue 12: the raised per-address enrolment limit is for the local profile only."""
    from shuffler.settings import ShufflerSettings

    default = ShufflerSettings.model_fields["enroll_per_minute"].default
    for name in ("shuffler-1", "shuffler-2", "shuffler-3"):
        value = SERVICES[name]["environment"]["ESA_SHUFFLER_ENROLL_PER_MINUTE"]
        assert value == f"${{ESA_ENROLL_PER_MINUTE:-{default:g}}}"
    for spec in SPECS[1:]:
        assert "ESA_SHUFFLER_ENROLL_PER_MINUTE" not in spec.env
    assert float(LOCAL_SETTINGS["ESA_SHUFFLER_ENROLL_PER_MINUTE"]) > default


def test_postgres_init_creates_every_database_the_services_use() -> None:
    init = (ROOT / "deploy" / "postgres-init.sql").read_text()
    mounted = " ".join(SERVICES["postgres"]["volumes"])
    assert "./deploy/postgres-init.sql:/docker-entrypoint-initdb.d/" in mounted
    for spec in SPECS:
        url = next(v for k, v in spec.env.items() if k.endswith("DATABASE_URL"))
        assert f"CREATE DATABASE {url.rsplit('/', 1)[1]};" in init


def test_init_command_prepares_what_the_services_mount(tmp_path: Path) -> None:
    args = [str(a) for a in SERVICES["init"]["command"]]
    var = args[args.index("--var") + 1]
    assert var == "/var/esa"
    args[args.index("--var") + 1] = str(tmp_path)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    registry = json.loads((tmp_path / "shufflers.json").read_text())
    for spec, entry in zip(SPECS[1:], registry, strict=True):
        assert entry["id"] == spec.name
        assert entry["url"] == f"http://{spec.name}:{spec.port}"  # the compose service name
    for spec in SPECS:
        key_dir = next(v for k, v in spec.env.items() if k.endswith("KEY_DIR"))
        relative = Path(key_dir).relative_to("/var/esa")
        assert (tmp_path / relative / "signing.pem").exists()
        assert f"keys-{spec.name}:{key_dir}" in SERVICES[spec.name]["volumes"]
        assert f"keys-{spec.name}:{key_dir}" in SERVICES["init"]["volumes"]
    assert (tmp_path / "analyzer.pub").exists()
    trust = TrustAnchors.load(tmp_path / TRUST_FILE)  # what an app pins, one key per party
    assert set(trust.shufflers) == {spec.name for spec in SPECS[1:]}
    for spec in SPECS[1:]:
        signer = load_or_create_ed25519(tmp_path / "keys" / spec.name / "signing.pem")
        assert public_bytes(trust.shufflers[spec.name]) == public_bytes(signer.public_key())
        entry = next(e for e in registry if e["id"] == spec.name)
        assert entry["signing_key"] == b64(public_bytes(signer.public_key()))
        assert spec.env["ESA_SHUFFLER_PUBLIC_URL"] == entry["url"]  # the descriptor's URL


def test_the_non_root_image_owns_every_named_volume_mount_point() -> None:
    """Named volumes start with the ownership of the image path they mount on, so every such
    path must exist in the image and be chown'ed to the user the services run as."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    joined = dockerfile.replace("\\\n", " ")  # backslash continuations
    run = " ".join(line[4:] for line in joined.splitlines() if line.startswith("RUN "))
    steps = [step.split() for step in run.split("&&")]
    made = {word for step in steps if step[:2] == ["mkdir", "-p"] for word in step[2:]}
    owned = {word for step in steps if step[:3] == ["chown", "-R", "esa"] for word in step[3:]}
    assert "USER esa" in dockerfile and "'.[server,postgres,sim]'" in run
    named = set(COMPOSE["volumes"]) - {"pgdata"}
    for name, service in SERVICES.items():
        if name == "postgres":
            continue
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source in named:
                assert any(m == target or m.startswith(target + "/") for m in made), target
                assert any(target == o or target.startswith(o + "/") for o in owned), target
    assert SERVICES["analyzer"]["depends_on"]["init"]["condition"] == (
        "service_completed_successfully"
    )
    report = SERVICES["loadgen"]["command"][SERVICES["loadgen"]["command"].index("--report") + 1]
    assert any(
        v.startswith("reports:") and report.startswith(v.split(":")[1] + "/")
        for v in SERVICES["loadgen"]["volumes"]
    )


def test_loadgen_runs_esa_demo_against_the_compose_analyzer() -> None:
    from services.cli.demo import demo

    args = [str(a) for a in SERVICES["loadgen"]["command"]]
    assert args[0] == "demo"
    context = demo.make_context("demo", args[1:])
    assert context.params["analyzer_url"] == "http://analyzer:8100"
    assert context.params["var"] == Path("/var/esa")
    assert "ESA_SHUFFLER_ADMIN_TOKEN" in SERVICES["loadgen"]["environment"]
    assert set(SERVICES["loadgen"]["depends_on"]) == {s.name for s in SPECS}


#: Every image the compose file builds, with the build argument that names its base image.
IMAGES = {
    "esa-pipeline:latest": "PYTHON_IMAGE",
    "esa-postgres:latest": "POSTGRES_IMAGE",
    "esa-prometheus:latest": "PROMETHEUS_IMAGE",  # profile monitoring
    "esa-haproxy:latest": "HAPROXY_IMAGE",  # profile replicas
}


def test_images_are_built_here_from_pinned_bases_with_a_small_private_context() -> None:
    """Issue 16: never pull our own image; pinned base images that an air-gapped user can
    replace; a build context without the virtualenv, local keys or databases."""
    for name, service in SERVICES.items():
        if "build" in service:
            assert service["pull_policy"] == "build", name
            assert service["image"] in IMAGES, name
            assert service["build"]["args"] == [IMAGES[service["image"]]], name
    for image, dockerfile in (
        ("PROMETHEUS_IMAGE", "deploy/prometheus/Dockerfile"),
        ("HAPROXY_IMAGE", "deploy/haproxy/Dockerfile"),
    ):  # the profiles' images: pinned official bases, or deploy/build-base-images.sh's
        assert re.search(
            rf"^ARG {image}=\S+:v?\d+\.\d+\.\d+\S*$", (ROOT / dockerfile).read_text(), re.M
        )
    python = (ROOT / "deploy" / "Dockerfile").read_text()
    postgres = (ROOT / "deploy" / "postgres" / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-bookworm$", python, re.M)
    assert re.search(r"^ARG POSTGRES_IMAGE=postgres:\d+\.\d+-bookworm$", postgres, re.M)
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for pattern in ("**/.venv", "var", "**/var", "**/*.pem", ".git", "tests"):
        assert pattern in ignored, pattern
    assert "!deploy/wheelhouse" in ignored  # the one deploy/ folder the image needs


def test_the_loadgen_home_is_writable_and_its_dashboard_is_the_hosts() -> None:
    """Issue 16: HOME and matplotlib's cache outside the read-only /var/esa mount; the last
    line the loadgen prints is a URL the host can open."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "HOME=/home/esa MPLCONFIGDIR=/home/esa/.config/matplotlib" in dockerfile
    assert "config:/var/esa:ro" in SERVICES["loadgen"]["volumes"]
    script = SERVICES["loadgen"]["entrypoint"][2]
    assert 'esa "$$@"' in script and "http://127.0.0.1:8100/" in script
    assert "127.0.0.1:8100:8100" in SERVICES["analyzer"]["ports"]
