"""docker-compose.yml runs what ``esa up`` runs, one trust domain per party (issue 31).

This parses the compose file and checks every service against
:func:`services.cli.launcher.service_specs` (commands, ports, settings) and each party's
secrets against :data:`services.cli.launcher.PARTY_SECRETS`; that no secret is in any
service's environment and no secret file, key volume or database network reaches two
parties (the loadgen and Prometheus are the documented single-host exceptions: tokens only);
the secrets generator (deploy/party_secrets.py: distinct values, never overwritten, placeholders
and shared values refused); the committed channel set and registry; and the image build's
inputs (.dockerignore, pinned base images, pull policy). The e2e suite runs the same commands
as processes against PostgreSQL (tests/e2e/test_demo.py), and tests/deploy/ runs the compose
file itself on a Docker engine.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from common.collection import TrustAnchors, sign_descriptor
from common.envelope import (
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
)
from common.wire import HpkeKey, ShufflerDescriptor, ShufflerEntry, b64
from runtime.publish import publish
from services.cli.launcher import LOCAL_SETTINGS, PARTY_SECRETS, SHARED_SETTINGS, service_specs
from services.tools.catalogue import DEFAULT_CHANNELS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def _party_secrets() -> ModuleType:
    """deploy/party_secrets.py (a script, not a package module)."""
    path = ROOT / "deploy" / "party_secrets.py"
    spec = importlib.util.spec_from_file_location("party_secrets", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _party_secrets()
PARTIES: tuple[str, ...] = GENERATOR.PARTIES
#: A placeholder for the launcher's URL template: compose gives each party its URL as a
#: secret file (the generator writes it), so only its scheme, host and database are compared.
DB = "postgresql+psycopg://ROLE:PASSWORD@HOST:5432/esa_{service}"
#: Where devices reach each shuffler: what each shuffler's descriptor names
#: (ESA_SHUFFLER_PUBLIC_URL) and where the analyzer's registry fetches descriptors from.
SHUFFLER_URL = "http://shuffler-{i}:{port}"
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
#: shufflers and the analyzer run as production, with real secrets given as Docker secret
#: files (``esa up`` passes the same ``_FILE`` settings, from its own key folders); each
#: service publishes its public material into its own volume.
COMPOSE_ONLY = {
    "ESA_ANALYZER_HOST",
    "ESA_ANALYZER_PUBLIC_URL",
    "ESA_ANALYZER_ENVIRONMENT",
    "ESA_ANALYZER_ADMIN_TOKEN_FILE",
    "ESA_ANALYZER_METRICS_TOKEN_FILE",  # its /metrics is reachable by the other parties here
    "ESA_ANALYZER_DATABASE_URL_FILE",
    "ESA_ANALYZER_PUBLISH_DIR",
    "ESA_SHUFFLER_HOST",
    "ESA_SHUFFLER_TRUSTED_PROXIES",  # its HAProxy's fixed address (replicas profile)
    "ESA_SHUFFLER_ENVIRONMENT",
    "ESA_SHUFFLER_TOKEN_SECRET_FILE",
    "ESA_SHUFFLER_ADMIN_TOKEN_FILE",
    "ESA_SHUFFLER_METRICS_TOKEN_FILE",
    "ESA_SHUFFLER_DATABASE_URL_FILE",
    "ESA_SHUFFLER_PUBLISH_DIR",
    "ESA_SHUFFLER_ENROLL_PER_MINUTE",  # the production default unless ESA_ENROLL_PER_MINUTE
    # Not a setting: the shuffler entrypoint's template for ESA_SHUFFLER_PUBLIC_URL, passed
    # through from the host only when set (the replicas profile's HAProxy URLs).
    "ESA_SHUFFLER_URL_TEMPLATE",
}
#: Settings that hold a secret: never given as a value, only as a file (``<NAME>_FILE``).
SECRET_SETTINGS = ("TOKEN_SECRET", "ADMIN_TOKEN", "METRICS_TOKEN", "DATABASE_URL", "PASSWORD")
#: The trust domain of each service; the loadgen and Prometheus act for several parties.
DOMAIN = {
    **{p: p for p in PARTIES},
    **{f"postgres-{p}": p for p in PARTIES},
    **{f"{p}-r2": p for p in PARTIES[1:]},
    **{f"{p}-lb": p for p in PARTIES[1:]},
}
TOOLS = {"loadgen", "prometheus"}


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: "" if v is None else str(v) for k, v in service.get("environment", {}).items()}


def _secrets(service: dict[str, Any]) -> set[str]:
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        mounts[target] = (source, mode == ["ro"])
    return mounts


def _networks(service: dict[str, Any]) -> set[str]:
    return set(service.get("networks") or ["default"])


def test_the_deployment_services_are_all_there() -> None:
    assert {
        *(f"postgres-{p}" for p in PARTIES),
        *PARTIES,
        "loadgen",
    } <= set(SERVICES)
    assert "init" not in SERVICES and "postgres" not in SERVICES  # no shared server, no keymaker
    assert SERVICES["loadgen"]["profiles"] == ["loadgen"]
    assert (ROOT / SERVICES["analyzer"]["build"]["dockerfile"]).is_file()
    assert set(DOMAIN) | TOOLS == set(SERVICES)  # every service belongs somewhere


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_each_service_runs_the_launchers_command_port_and_settings(spec: Any) -> None:
    service = SERVICES[spec.name]
    assert service["command"] == list(spec.command)
    env = _env(service)
    prefix = "ESA_ANALYZER_" if spec.name == "analyzer" else "ESA_SHUFFLER_"
    for name, value in spec.env.items():
        if name.endswith("DATABASE_URL"):  # a secret: as a file, checked below
            assert name not in env
            continue
        if name == "ESA_SHUFFLER_ANALYZER_KEY_FILE":  # what the analyzer published, mounted
            assert env[name] == "/var/esa/published/analyzer/analyzer.pub"
            assert _mounts(service)["/var/esa/published/analyzer"] == ("published-analyzer", True)
            continue
        assert env.get(name) == value, name
    assert set(env) - set(spec.env) <= COMPOSE_ONLY
    # The party's own secrets, as files, under the names `esa up` keeps them in its key folder.
    kind = "analyzer" if spec.name == "analyzer" else "shuffler"
    for file, variable in PARTY_SECRETS[kind].items():
        assert env[f"{variable}_FILE"] == f"/run/secrets/{spec.name}-{file}", variable
        assert f"{spec.name}-{file}" in _secrets(service)
    # Its database URL: a file, naming its own server, role and the launcher's database.
    assert env[f"{prefix}DATABASE_URL_FILE"] == f"/run/secrets/{spec.name}-database-url"
    url = urlsplit(GENERATOR.database_url(spec.name, "p" * 43))
    wanted = urlsplit(spec.env[f"{prefix}DATABASE_URL"])
    assert (url.scheme, url.path) == (wanted.scheme, wanted.path)
    assert url.hostname == f"postgres-{spec.name}" and url.username == wanted.path[1:]
    assert _secrets(service) == {f"{spec.name}-{f}" for f in GENERATOR.kinds(spec.name)} - {
        f"{spec.name}-db-password"  # the server's, not the service's
    }
    assert env[f"{prefix}PUBLISH_DIR"] == f"/var/esa/published/{spec.name}"
    assert service["ports"] == [f"127.0.0.1:{spec.port}:{spec.port}"]
    assert f"http://127.0.0.1:{spec.port}/readyz" in " ".join(service["healthcheck"]["test"])
    for dependency in service["depends_on"].values():
        assert dependency["condition"] == "service_healthy"
    assert service["depends_on"][f"postgres-{spec.name}"]
    if spec.name.startswith("shuffler"):
        assert SHARED_SETTINGS.items() <= env.items()
        assert env["ESA_SHUFFLER_ENVIRONMENT"] == "production"
        assert env.get("ESA_SHUFFLER_URL_TEMPLATE", "") == ""


def test_no_secret_is_a_value_in_any_services_environment() -> None:
    """Secrets are files (Docker secrets): none in an environment, so none in ``docker
    inspect`` or /proc/<pid>/environ; compose interpolates nothing secret."""
    for name, service in SERVICES.items():
        for variable, value in _env(service).items():
            if variable.endswith(SECRET_SETTINGS):
                raise AssertionError(f"{name}: {variable} is a secret given as a value")
            if variable.endswith("_FILE") and variable.removesuffix("_FILE").endswith(
                SECRET_SETTINGS
            ):
                assert value.startswith("/run/secrets/"), (name, variable)
    lines = (ROOT / "docker-compose.yml").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    used = {name for name, _ in re.findall(r"\$\{([A-Z0-9_]+)([^}]*)\}", text)}
    # The only interpolations: where the secret files are, and the test deployment's limit.
    assert used == {"ESA_SECRETS_DIR", "ESA_ENROLL_PER_MINUTE"}


def test_each_secret_file_reaches_one_party_only() -> None:
    """Every secret is its own file, mounted into the services of its own trust domain only
    (a shuffler's replica is that shuffler's domain); the loadgen (a test tool that closes
    epochs at every shuffler) and Prometheus (one for every party: a single-host staging
    shape) get admin and metrics tokens only, never a key, a token secret or a database
    credential."""
    declared = COMPOSE["secrets"]
    names = [name for _, name in GENERATOR.files()]
    assert sorted(declared) == sorted(names)
    for name, entry in declared.items():
        assert entry == {"file": f"${{ESA_SECRETS_DIR:-./deploy/secrets}}/{name}"}, name
    holders: dict[str, set[str]] = {}
    for service_name, service in SERVICES.items():
        for secret in _secrets(service):
            holders.setdefault(secret, set()).add(service_name)
    for secret, services in holders.items():
        party = next(p for p in PARTIES if secret.startswith(f"{p}-"))
        domains = {DOMAIN[s] for s in services if s not in TOOLS}
        assert domains <= {party}, (secret, services)
        if services & TOOLS:
            assert secret.endswith(("-admin-token", "-metrics-token")), (secret, services)
    assert _secrets(SERVICES["prometheus"]) == {f"{p}-metrics-token" for p in PARTIES}
    loadgen = {f"{p}-{k}" for p in PARTIES for k in ("admin-token", "metrics-token")}
    assert _secrets(SERVICES["loadgen"]) == loadgen
    for lb in (f"{p}-lb" for p in PARTIES[1:]):
        assert not _secrets(SERVICES[lb])  # HAProxy balances on the token without reading it


def test_each_trust_domain_has_its_own_database_server_on_its_own_network() -> None:
    """One PostgreSQL per party, on an internal network that only that party's processes
    join: the analyzer's container cannot even resolve a shuffler's server."""
    for party in PARTIES:
        server = SERVICES[f"postgres-{party}"]
        env = _env(server)
        url = urlsplit(GENERATOR.database_url(party, "p" * 43))
        assert env["POSTGRES_DB"] == env["POSTGRES_USER"] == url.path[1:] == url.username
        assert env["POSTGRES_PASSWORD_FILE"] == f"/run/secrets/{party}-db-password"
        assert _secrets(server) == {f"{party}-db-password"}
        assert _networks(server) == {f"db-{party}"} and "ports" not in server
        assert _mounts(server) == {"/var/lib/postgresql/data": (f"pgdata-{party}", False)}
        assert f"-U {url.username} -d {url.username}" in server["healthcheck"]["test"][1]
        network = COMPOSE["networks"][f"db-{party}"]
        assert network["internal"] is True and set(network) == {"internal", "ipam"}
        members = {name for name, s in SERVICES.items() if f"db-{party}" in _networks(s)}
        assert members == {f"postgres-{party}", party} | (
            {f"{party}-r2"} if party != "analyzer" else set()
        )
    assert set(COMPOSE["networks"]) == {"default"} | {f"db-{p}" for p in PARTIES}
    # every network on a fixed subnet, none overlapping: dockerd chooses none of them
    subnets = [
        ipaddress.ip_network(n["ipam"]["config"][0]["subnet"]) for n in COMPOSE["networks"].values()
    ]
    assert not any(a.overlaps(b) for i, a in enumerate(subnets) for b in subnets[i + 1 :])
    # The base image's entrypoint reads POSTGRES_PASSWORD_FILE only in the official image;
    # esa-postgres's own reads it for the stand-in too and refuses a placeholder.
    dockerfile = (ROOT / "deploy" / "postgres" / "Dockerfile").read_text()
    assert "esa-postgres-entrypoint.sh" in dockerfile.split("ENTRYPOINT")[1]
    script = (ROOT / "deploy" / "postgres" / "entrypoint.sh").read_text()
    assert "POSTGRES_PASSWORD_FILE" in script and "exec docker-entrypoint.sh" in script


def test_keys_stay_in_their_partys_volume_and_only_public_material_crosses() -> None:
    """Each service makes its own keys in its own volume, mounted into its own trust domain's
    processes only; what it publishes (its own volume, written by it alone) is mounted
    read-only where other parties need it: the analyzer (its registry), the loadgen (the
    keys a device pins) and the shufflers (the analyzer's config-signing key)."""
    for party in PARTIES:
        for name, service in SERVICES.items():
            for target, (source, read_only) in _mounts(service).items():
                if source == f"keys-{party}":
                    assert DOMAIN.get(name) == party, (name, source)
                    assert target == f"/var/esa/keys/{party}" and not read_only
                if source == f"published-{party}" and DOMAIN.get(name) != party:
                    assert read_only, (name, source)
                    readers = ("analyzer", "loadgen") if party != "analyzer" else SERVICES
                    assert name in readers, (name, source)
        prefix = "ESA_ANALYZER_" if party == "analyzer" else "ESA_SHUFFLER_"
        env = _env(SERVICES[party])
        assert _mounts(SERVICES[party])[env[f"{prefix}KEY_DIR"]] == (f"keys-{party}", False)
        assert _mounts(SERVICES[party])[env[f"{prefix}PUBLISH_DIR"]] == (
            f"published-{party}",
            False,
        )
    for party in PARTIES:  # the analyzer and the loadgen see every party's published keys
        for reader in ("analyzer", "loadgen"):
            assert f"/var/esa/published/{party}" in _mounts(SERVICES[reader]), (reader, party)


def test_the_registry_pins_what_each_shuffler_publishes(tmp_path: Path) -> None:
    """deploy/shufflers.json names, for each shuffler, the URL the analyzer fetches its
    descriptor from (the one its descriptor vouches for) and the file it publishes; laid out
    as the containers see their volumes, the analyzer's settings pin each shuffler's own key,
    and the loadgen's --trust folder gives the same keys and the analyzer's."""
    from analyzer.settings import AnalyzerSettings

    analyzer = _env(SERVICES["analyzer"])
    mounts = _mounts(SERVICES["analyzer"])
    registry = Path(analyzer["ESA_ANALYZER_SHUFFLERS_FILE"])
    assert mounts[str(registry)] == ("./deploy/shufflers.json", True)
    entries = [ShufflerEntry(**e) for e in json.loads((ROOT / "deploy/shufflers.json").read_text())]
    assert [e.id for e in entries] == [s.name for s in SPECS[1:]]
    root, inside = tmp_path / "published", Path("/var/esa/published")  # as the containers see it
    keys: dict[str, Any] = {}
    now = int(time.time())
    for entry, spec in zip(entries, SPECS[1:], strict=True):
        env = _env(SERVICES[spec.name])
        assert entry.url == env["ESA_SHUFFLER_PUBLIC_URL"] == spec.env["ESA_SHUFFLER_PUBLIC_URL"]
        assert not entry.signing_key  # pinned from the published descriptor, never by hand
        folder = Path(env["ESA_SHUFFLER_PUBLISH_DIR"])
        assert entry.descriptor_file == str(folder / f"{entry.id}.descriptor.json")
        assert mounts[str(folder)] == (f"published-{entry.id}", True)
        # What the shuffler publishes at start (ShufflerService.publish), from its own keys.
        signer = load_or_create_ed25519(tmp_path / "keys" / entry.id / "signing.pem")
        hpke = load_or_create_x25519(tmp_path / "keys" / entry.id / "hpke.pem").public_key()
        descriptor = ShufflerDescriptor(
            id=entry.id,
            url=entry.url,
            keys=[HpkeKey(key_id=key_id(hpke).hex(), public_key=b64(public_bytes(hpke)))],
            signing_key=b64(public_bytes(signer.public_key())),
            issued_at=now,
            expires_at=now + 3600,
        )
        text = sign_descriptor(descriptor, signer).model_dump_json()
        publish(root / folder.relative_to(inside), f"{entry.id}.descriptor.json", text)
        keys[entry.id] = b64(public_bytes(signer.public_key()))
    analyzer_key = load_or_create_ed25519(tmp_path / "keys" / "analyzer" / "signing.pem")
    publish(root / "analyzer", "analyzer.pub", b64(public_bytes(analyzer_key.public_key())) + "\n")
    local = [
        {
            **e.model_dump(),
            "descriptor_file": str(root / Path(str(e.descriptor_file)).relative_to(inside)),
        }
        for e in entries
    ]  # the registry as the analyzer reads it, with tmp_path for the mounts
    (tmp_path / "shufflers.json").write_text(json.dumps(local))
    settings = AnalyzerSettings(shufflers_file=tmp_path / "shufflers.json")
    assert {s.id: s.signing_key for s in settings.shufflers} == keys
    loadgen = SERVICES["loadgen"]["command"]
    assert loadgen[loadgen.index("--trust") + 1] == "/var/esa/published"
    trust = TrustAnchors.read(root).to_json()
    assert trust == {"analyzer": b64(public_bytes(analyzer_key.public_key())), "shufflers": keys}


def test_the_committed_channels_are_the_default_catalogue() -> None:
    """deploy/channels.json, mounted read-only as every service's channel file, is the
    catalogue ``esa up`` writes (no `init` writes it any more)."""
    committed = json.loads((ROOT / "deploy" / "channels.json").read_text())
    assert committed == json.loads(json.dumps([c.model_dump() for c in DEFAULT_CHANNELS]))
    for spec in SPECS:
        path = next(v for k, v in spec.env.items() if k.endswith("CHANNELS_FILE"))
        assert _mounts(SERVICES[spec.name])[path] == ("./deploy/channels.json", True)


def _generate(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "deploy" / "party_secrets.py"
    command = [sys.executable, str(script), "--dir", str(folder), *args]
    env = {k: v for k, v in os.environ.items() if k != "ESA_SECRETS_DIR"}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.system
def test_the_secrets_generator_makes_distinct_secrets_and_never_overwrites(tmp_path: Path) -> None:
    folder = tmp_path / "secrets"
    done = _generate(folder)
    assert done.returncode == 0, done.stderr
    values = {p.name: p.read_text().strip() for p in folder.iterdir()}
    assert sorted(values) == sorted(name for _, name in GENERATOR.files())
    tokens = {k: v for k, v in values.items() if not k.endswith("-database-url")}
    assert len(set(tokens.values())) == len(tokens)  # no two files share a value
    assert all(len(v) >= 40 for v in tokens.values())
    for party in PARTIES:  # each URL names its own server, role and password
        password = values[f"{party}-db-password"]
        assert values[f"{party}-database-url"] == GENERATOR.database_url(party, password)
    assert all(v not in done.stdout + done.stderr for v in values.values())  # nothing printed
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o644}
    again = _generate(folder)  # nothing overwritten
    assert again.returncode == 0 and "created" not in again.stdout
    assert {p.name: p.read_text().strip() for p in folder.iterdir()} == values
    (folder / "shuffler-2-admin-token").unlink()  # a missing one is made anew, alone
    assert _generate(folder, "--check").returncode == 1
    assert _generate(folder).returncode == 0
    assert (folder / "shuffler-2-admin-token").read_text().strip() != values[
        "shuffler-2-admin-token"
    ]


@pytest.mark.system
@pytest.mark.parametrize(
    ("file", "value", "why"),
    [
        ("shuffler-1-admin-token", "analyzer-admin-token", "the same value"),
        ("shuffler-3-token-secret", "shuffler-2-token-secret", "the same value"),
        ("shuffler-2-metrics-token", "changeme", "placeholder"),
        ("analyzer-db-password", "q7x2k9", "placeholder"),  # too short
    ],
)
def test_the_secrets_generator_refuses_shared_and_placeholder_secrets(
    tmp_path: Path, file: str, value: str, why: str
) -> None:
    """A shared value (two parties', or two of one party's) or a placeholder is refused, named
    by file and never by value, whether the check runs alone or before creating."""
    folder = tmp_path / "secrets"
    assert _generate(folder).returncode == 0
    other = folder / value
    text = other.read_text() if other.exists() else value + "\n"
    (folder / file).write_text(text)
    for args in ((), ("--check",)):
        done = _generate(folder, *args)
        assert done.returncode == 1 and file in done.stderr and why in done.stderr, done.stderr
        assert text.strip() not in done.stdout + done.stderr


@pytest.mark.system
def test_the_secrets_generator_refuses_a_url_of_another_partys_database(tmp_path: Path) -> None:
    folder = tmp_path / "secrets"
    assert _generate(folder).returncode == 0
    theirs = (folder / "shuffler-2-database-url").read_text()
    (folder / "shuffler-1-database-url").write_text(theirs)
    done = _generate(folder, "--check")
    assert done.returncode == 1 and "shuffler-1-database-url" in done.stderr
    assert _generate(tmp_path / "none", "--check").returncode == 1  # no folder: nothing to run


@pytest.mark.system
def test_secret_files_satisfy_the_production_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shuffler started with compose's environment, its secret files as the generator makes
    them, runs as production; a placeholder in its file is refused."""
    from shuffler.settings import ShufflerSettings

    folder = tmp_path / "secrets"
    assert _generate(folder).returncode == 0
    env = _env(SERVICES["shuffler-1"])
    env = {k: re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    env = {k: v.replace("/run/secrets", str(folder)) for k, v in env.items() if v}
    env.pop("ESA_SHUFFLER_CHANNELS_FILE")
    for key in [k for k in os.environ if k.startswith("ESA_SHUFFLER_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = ShufflerSettings()
    assert settings.environment == "production"
    assert settings.admin_token.get_secret_value() == (
        (folder / "shuffler-1-admin-token").read_text().strip()
    )
    assert settings.database_url.startswith("postgresql+psycopg://esa_shuffler_1:")
    (folder / "shuffler-1-token-secret").write_text("development\n")
    with pytest.raises(ValueError, match="token_secret"):
        ShufflerSettings()


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


def test_the_replicas_share_their_domains_settings_and_nothing_else() -> None:
    for party in PARTIES[1:]:
        base, replica = SERVICES[party], SERVICES[f"{party}-r2"]
        for key in ("command", "environment", "secrets", "networks", "volumes", "healthcheck"):
            assert replica[key] == base[key], (party, key)
        assert "ports" not in replica
        assert replica["depends_on"][party]["condition"] == "service_healthy"


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
    named = {v for v in COMPOSE["volumes"] if not v.startswith("pgdata-")}
    for name, service in SERVICES.items():
        if name.startswith("postgres-"):
            continue
        for target, (source, _) in _mounts(service).items():
            if source in named:
                assert any(m == target or m.startswith(target + "/") for m in made), target
                assert any(target == o or target.startswith(o + "/") for o in owned), target
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
    assert context.params["trust_file"] == Path("/var/esa/published")  # what parties published
    assert context.params["keys"] == Path("/run/secrets")  # each party's own tokens
    assert context.params["admin_token"] is None  # no token shared by every party
    assert "environment" not in SERVICES["loadgen"]
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
    replace; a build context without the virtualenv, local keys, databases or secrets."""
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
    for pattern in ("**/.venv", "var", "**/var", "**/*.pem", ".git", "tests", "deploy/*"):
        assert pattern in ignored, pattern
    assert "!deploy/wheelhouse" in ignored  # the one deploy/ folder the image needs
    assert "deploy/secrets/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_loadgen_home_is_writable_and_its_dashboard_is_the_hosts() -> None:
    """Issue 16: HOME and matplotlib's cache outside the mounted /var/esa; the last line the
    loadgen prints is a URL the host can open."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "HOME=/home/esa MPLCONFIGDIR=/home/esa/.config/matplotlib" in dockerfile
    assert all(read_only for target, (_, read_only) in _mounts(SERVICES["loadgen"]).items()
               if target.startswith("/var/esa/"))  # fmt: skip
    script = SERVICES["loadgen"]["entrypoint"][2]
    assert 'esa "$$@"' in script and "http://127.0.0.1:8100/" in script
    assert "127.0.0.1:8100:8100" in SERVICES["analyzer"]["ports"]


def test_each_shuffler_trusts_its_own_haproxys_fixed_address_only() -> None:
    """X-Forwarded-For is the device's address only from the shuffler's HAProxy (replicas
    profile): a fixed address on the default network, outside the range Docker hands other
    containers, so no other container can hold it and name any address it likes."""
    ipam = COMPOSE["networks"]["default"]["ipam"]["config"][0]
    subnet, dynamic = ipaddress.ip_network(ipam["subnet"]), ipaddress.ip_network(ipam["ip_range"])
    for party in PARTIES[1:]:
        proxy = SERVICES[f"{party}-lb"]["networks"]["default"]["ipv4_address"]
        assert ipaddress.ip_address(proxy) in subnet and ipaddress.ip_address(proxy) not in dynamic
        for name in (party, f"{party}-r2"):
            assert _env(SERVICES[name])["ESA_SHUFFLER_TRUSTED_PROXIES"] == proxy
    assert "ESA_ANALYZER_TRUSTED_PROXIES" not in _env(SERVICES["analyzer"])  # no proxy in front
