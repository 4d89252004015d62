"""Trust domains that hold in docker-compose.yml (issue 31), on the running deployment.

Run last on the session's ``stack`` (the file sorts after the others), so every profile's
containers are up and checked too: Prometheus, the replicas and their HAProxies.

* Databases: from inside each party's container (the analyzer's first), every other party's
  PostgreSQL server neither resolves nor answers, by name or by address, while its own does:
  each server is on an internal network of its own that only its party's processes join.
* Tokens: every party's admin and metrics tokens open that party's routes and get 401
  everywhere else (the analyzer's admin token at every shuffler, one shuffler's at another).
* Keys: every private key on the engine's volumes (found by content, in a throwaway auditor
  container without a network that mounts each of the project's volumes read-only) is in its
  own party's keys volume only, and only that party's containers mount it; no container
  wrote a key into its own layer (``docker diff``); each container's /run/secrets holds its
  own party's secrets only (the loadgen and Prometheus: tokens, never a key, a token secret
  or a database credential).
* Secrets: no secret value is in any container's ``docker inspect`` (environment, command,
  labels) or in any service's log; a service given a placeholder secret file refuses to
  start, and says which file, never the value.

The loadgen's run with conservation read from each trust domain's own database is
test_compose_up.py's (and, through HAProxy, test_replicas.py's).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.deploy.stack import PARTIES, PORTS, PROJECT, ROOT, SHUFFLERS, Stack, database

pytestmark = pytest.mark.deploy

#: The trust domain of each compose service (the loadgen and Prometheus act for several).
DOMAIN = {
    **{p: p for p in PARTIES},
    **{f"postgres-{p}": p for p in PARTIES},
    **{f"{p}-r2": p for p in SHUFFLERS},
    **{f"{p}-lb": p for p in SHUFFLERS},
}
TOOLS = {"loadgen", "prometheus"}
#: A harmless admin request on both services: the token is checked before the body, and with
#: the right one the body is refused (a batch id must be 32 hex digits): nothing is requeued.
PROBE = {"batch_id": "not-a-batch"}

#: Run inside a party's container: connect to every server by name and by address with the
#: party's own database credentials (the only ones it holds), in parallel; print what happened.
CONNECT = """
import json, sys, threading, psycopg
from urllib.parse import urlsplit
own = urlsplit(open(sys.argv[1]).read().strip())
targets = json.loads(sys.argv[2])
results = {}
def attempt(label, host, dbname):
    try:
        with psycopg.connect(host=host, port=5432, dbname=dbname, user=own.username,
                             password=own.password, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        results[label] = "connected"
    except Exception as error:
        results[label] = f"{type(error).__name__}: {str(error).strip()[:160]}"
threads = [threading.Thread(target=attempt, args=(label, host, db))
           for label, (host, db) in targets.items()]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(results))
"""


def _address(stack: Stack, service: str) -> str:
    """The container's address on its only network (a database server's)."""
    networks = stack.inspect(stack.container(service))["NetworkSettings"]["Networks"]
    (network,) = networks.values()
    return str(network["IPAddress"])


def _attempts(stack: Stack, party: str, addresses: dict[str, str]) -> dict[str, str]:
    prefix = "ESA_ANALYZER_" if party == "analyzer" else "ESA_SHUFFLER_"
    targets = {}
    for other in PARTIES:
        targets[f"{other} by name"] = (f"postgres-{other}", database(other))
        targets[f"{other} by address"] = (addresses[other], database(other))
    code = f"import os, sys; sys.argv[1] = os.environ['{prefix}DATABASE_URL_FILE']\n" + CONNECT
    out = stack.exec(party, "python", "-c", code, "url", json.dumps(targets), timeout=60)
    result: dict[str, str] = json.loads(out)
    return result


def test_no_party_can_connect_to_another_partys_database(stack: Stack) -> None:
    addresses = {party: _address(stack, f"postgres-{party}") for party in PARTIES}
    found: dict[str, dict[str, str]] = {}

    def probe(party: str) -> None:
        found[party] = _attempts(stack, party, addresses)

    threads = [threading.Thread(target=probe, args=(party,)) for party in PARTIES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for party in PARTIES:  # the analyzer first: it must not reach any shuffler's contributions
        results = found[party]
        assert results[f"{party} by name"] == results[f"{party} by address"] == "connected"
        for other in PARTIES:
            if other == party:
                continue
            # Neither resolves (another network's name) nor routes (another internal bridge).
            by_name, by_address = results[f"{other} by name"], results[f"{other} by address"]
            assert by_name != "connected" and by_address != "connected", (party, other, results)
            assert "resolve" in by_name or "Name or service not known" in by_name, by_name
            assert "timeout" in by_address.lower() or "unreachable" in by_address, by_address


def _admin(url: str, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.post(
        f"{url}/v1/admin/requeue", json=PROBE, headers=headers, timeout=10
    ).status_code


def _metrics(url: str, token: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{url}/metrics", headers=headers, timeout=10).status_code


def test_each_partys_tokens_open_its_own_service_only(stack: Stack) -> None:
    for party, port in PORTS.items():
        url = f"http://127.0.0.1:{port}"
        for owner in PARTIES:
            admin, metrics = stack.token(owner), stack.token(owner, "metrics-token")
            if owner == party:  # accepted: past the token, the probe's body is refused
                assert _admin(url, admin) in (400, 422), (party, owner)
                assert _metrics(url, metrics) == 200, (party, owner)
            else:  # the analyzer's at every shuffler, one shuffler's at another, ...
                assert _admin(url, admin) == 401, (party, owner)
                assert _metrics(url, metrics) == 401, (party, owner)
                assert _metrics(url, admin) == 401, (party, owner)
        assert _admin(url, stack.token(party, "metrics-token")) == 401  # read-only token


def _auditor_findings(stack: Stack, volumes: list[str]) -> list[dict[str, str]]:
    """Every private key on the project's volumes, by its public key: an auditor container
    (the deployment's image, no network, every volume mounted read-only, removed after)."""
    mounts = [word for v in volumes for word in ("-v", f"{v}:/audit/{v}:ro")]
    script = (ROOT / "tests" / "deploy" / "find_keys.py").read_text()
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--user", "0", *mounts,
         "--entrypoint", "python", "esa-pipeline:latest", "-c", script, "/audit"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found: list[dict[str, str]] = json.loads(done.stdout)
    return found


def test_no_container_but_a_partys_own_holds_its_private_keys(stack: Stack) -> None:
    trust = stack.trust().to_json()
    document = httpx.get("http://127.0.0.1:8100/v1/config", timeout=10).json()
    public: dict[str, str] = {trust["analyzer"]: "analyzer"}  # public key -> party
    public.update({key: party for party, key in trust["shufflers"].items()})
    for shuffler in document["config"]["shufflers"]:  # each descriptor's HPKE keys too
        for key in shuffler["descriptor"]["keys"]:
            public[key["public_key"]] = shuffler["descriptor"]["id"]
    for key in document["config"]["analyzer"]["keys"]:  # and the analyzer's
        public[key["public_key"]] = "analyzer"
    containers = stack.containers()
    mounted: dict[str, set[str]] = {}  # volume -> services mounting it
    for container, service in containers.items():
        info = stack.inspect(container)
        for mount in info["Mounts"]:
            if mount["Type"] == "volume":
                mounted.setdefault(mount["Name"], set()).add(service)
            elif mount["Destination"].startswith("/run/secrets/"):
                secret = Path(mount["Destination"]).name
                owner = next(p for p in PARTIES if secret.startswith(f"{p}-"))
                if service in TOOLS:
                    assert secret.endswith(("-admin-token", "-metrics-token")), (service, secret)
                else:
                    assert DOMAIN[service] == owner, (service, secret)
            else:  # the committed channel set and registry, nothing else from the host
                source = Path(mount["Source"]).relative_to(ROOT)
                assert str(source) in ("deploy/channels.json", "deploy/shufflers.json"), mount
        added = subprocess.run(
            ["docker", "diff", container], capture_output=True, text=True, check=True
        ).stdout
        assert ".pem" not in added and "PRIVATE" not in added, (service, added)
    # The project's named volumes, and anonymous ones (an image's VOLUME: Prometheus's data).
    volumes = sorted(mounted)
    findings = _auditor_findings(stack, volumes)
    holders: dict[str, set[str]] = {}  # party -> volumes holding one of its private keys
    for finding in findings:
        party = public.get(finding["public_key"])
        assert party is not None, f"a private key of no party: {finding['path']}"
        holders.setdefault(party, set()).add(finding["volume"])
    for party in PARTIES:
        own = f"{PROJECT}_keys-{party}"
        assert holders.get(party) == {own}, (party, holders)
        readers = {service for service in mounted[own] if service not in TOOLS}
        assert {DOMAIN[s] for s in readers} == {party}, (own, mounted[own])
        assert not mounted[own] & TOOLS, (own, mounted[own])
    signing = {f["public_key"] for f in findings if f["kind"] == "ed25519"}
    assert {trust["analyzer"], *trust["shufflers"].values()} <= signing


def test_no_secret_in_docker_inspect_or_in_any_log(stack: Stack) -> None:
    for container, service in stack.containers().items():
        text = json.dumps(stack.inspect(container))
        leaked = [name for name, value in stack.secrets.items() if value in text]
        assert not leaked, f"docker inspect of {service} shows {leaked}"
    logs = stack.run(*stack.profiles(), "logs", "--no-color", timeout=120)
    leaked = [name for name, value in stack.secrets.items() if value in logs]
    assert not leaked, f"the services' logs show {leaked}"


@pytest.mark.parametrize(
    ("service", "file", "says"),
    [
        ("shuffler-1", "shuffler-1-admin-token", "admin_token must be set to a real secret"),
        ("postgres-shuffler-1", "shuffler-1-db-password", "placeholder or fewer than 16"),
    ],
)
def test_a_placeholder_secret_file_stops_the_service(
    stack: Stack, tmp_path: Path, service: str, file: str, says: str
) -> None:
    """``run`` of one service with the deployment's secrets but one file replaced by a
    placeholder: it exits at once naming the setting or file, never the value; the running
    deployment is untouched (``--no-deps``, a one-off container)."""
    folder = tmp_path / "secrets"
    shutil.copytree(Path(stack.env["ESA_SECRETS_DIR"]), folder)
    (folder / file).write_text("changeme\n")
    env = {**stack.env, "ESA_SECRETS_DIR": str(folder)}
    args = ["run", "--rm", "--no-deps", "-T", service]
    if service.startswith("postgres"):
        args += ["postgres"]
    done = subprocess.run(
        [*stack.command, "-p", PROJECT, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0 and says in output, output[-2000:]
    assert "changeme" not in output
    assert stack.health(service) == "healthy"  # the deployment's own container still serves
