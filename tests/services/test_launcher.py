"""``esa up``: starts everything healthy, refuses a taken port, leaves nothing behind on SIGTERM
(and says so, exiting 143 without a traceback)."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from common.collection import TrustAnchors, shuffler_party, verify_collection
from common.envelope import load_or_create_ed25519, load_or_create_x25519, public_bytes
from common.wire import b64
from runtime.keys import KeyDirectory, LiveKeys, Timing
from services.cli.launcher import (
    LOCAL_SETTINGS,
    TRUST_FILE,
    port_free,
    prepare,
)
from services.cli.servers import keys_generate
from services.tools.catalogue import DEFAULT_CHANNELS

from ..support import wait_until


def _base_port() -> int:
    for _ in range(100):
        base = random.randrange(20_000, 40_000)
        if all(port_free(base + i) for i in range(4)):
            return base
    raise RuntimeError("no free port range")


def _processes_mentioning(marker: str) -> list[int]:
    """Processes whose environment mentions ``marker``, without their children (the analyzer's
    opening pool workers inherit its environment)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return [pid for pid, parent in found.items() if parent not in found]


@pytest.mark.system
def test_up_serves_every_mechanism_refuses_taken_ports_and_stops_cleanly(tmp_path: Path) -> None:
    var, base = tmp_path / "var", _base_port()
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--var",
        str(var),
        "--base-port",
        str(base),
    ]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        lines = [first.stdout.readline() for _ in range(6)]
        assert lines[-1].startswith("dashboard"), lines
        assert lines[-2].split()[:2] == ["trust", str(var / TRUST_FILE)], lines
        shown = [first.stdout.readline() for _ in range(8)]
        assert shown[0].startswith("new tokens, shown once"), shown
        _assert_each_party_has_its_own_tokens(base, var, shown[1:])
        _assert_a_device_can_verify_the_config_at_once(base, var)
        channels = httpx.get(f"http://127.0.0.1:{base}/v1/channels").json()["channels"]
        assert {c["mechanism"] for c in channels} == {c.mechanism for c in DEFAULT_CHANNELS}
        for i in range(1, 4):
            assert httpx.get(f"http://127.0.0.1:{base + i}/readyz").status_code == 200
        assert oct((var / "keys" / "analyzer" / "hpke.pem").stat().st_mode & 0o777) == "0o600"
        _assert_each_shuffler_is_its_own_trust_domain(base)
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "already in use" in second.stderr
        assert "new tokens" not in second.stdout  # shown once: the first run made them
        assert len(_processes_mentioning(str(var))) == 4  # analyzer + 3 shufflers
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 143  # 128 + SIGTERM, after stopping everything, quietly
        rest = first.stdout.read()
        assert "esa up stopped by SIGTERM" in rest and "Traceback" not in rest, rest
    finally:
        if first.poll() is None:
            first.kill()
    wait_until(lambda: not _processes_mentioning(str(var)), timeout=20)
    wait_until(lambda: all(port_free(base + i) for i in range(4)), timeout=20)


def _assert_a_device_can_verify_the_config_at_once(base: int, var: Path) -> None:
    """``esa up`` prints its services once the analyzer serves its config (every shuffler's
    descriptor fetched): it verifies with the keys of ``var/trust.json``, each shuffler named
    at its own URL with the HPKE key of its own key file."""
    document = httpx.get(f"http://127.0.0.1:{base}/v1/config", timeout=10)
    assert document.status_code == 200, document.text
    config = verify_collection(document.json(), TrustAnchors.load(var / TRUST_FILE), time.time())
    assert [(s.id, s.url) for s in config.shufflers] == [
        (f"shuffler-{i}", f"http://127.0.0.1:{base + i}") for i in (1, 2, 3)
    ]
    for shuffler in config.shufflers:
        hpke = load_or_create_x25519(var / "keys" / shuffler.id / "hpke.pem")
        assert shuffler.public_key == b64(public_bytes(hpke.public_key()))


def _assert_each_party_has_its_own_tokens(base: int, var: Path, shown: list[str]) -> None:
    """Every party's admin token (and each shuffler's metrics token) is its own, shown once as
    kept in its key folder (0600), given to it as a file, and opens nothing of another party."""
    tokens = {(party, kind): token for party, kind, token in (line.split() for line in shown)}
    assert len(set(tokens.values())) == 7, shown  # analyzer admin; 3 × (admin, metrics)
    for (party, kind), token in tokens.items():
        path = var / "keys" / party / kind
        assert path.read_text().strip() == token
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    close = {"channel_id": "homepage", "epoch": 0}
    for i in (1, 2, 3):
        url = f"http://127.0.0.1:{base + i}"
        for holder in ("analyzer", "shuffler-1", "shuffler-2", "shuffler-3"):
            bearer = {"Authorization": f"Bearer {tokens[holder, 'admin-token']}"}
            answer = httpx.post(url + "/v1/admin/close", json=close, headers=bearer)
            own = holder == f"shuffler-{i}"
            assert (answer.status_code == 401) is not own, (holder, i, answer.text)
            if holder != "analyzer":
                metrics = {"Authorization": f"Bearer {tokens[holder, 'metrics-token']}"}
                status = httpx.get(url + "/metrics", headers=metrics).status_code
                assert status == (200 if own else 401), (holder, i)


def _assert_each_shuffler_is_its_own_trust_domain(base: int) -> None:
    """Issue 12: a client token enrolled at shuffler-2 is refused (401) by shuffler-1 and
    shuffler-3, and still accepted by shuffler-2 (a garbage body: 400, past the token check)."""
    token = httpx.post(f"http://127.0.0.1:{base + 2}/v1/enroll").json()["client_token"]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
    answers = {
        i: httpx.post(
            f"http://127.0.0.1:{base + i}/v1/contributions", content=b"x" * 64, headers=headers
        )
        for i in (1, 2, 3)
    }
    assert answers[2].status_code == 400 and answers[2].json()["error"] == "malformed"
    for i in (1, 3):
        assert answers[i].status_code == 401, answers[i].text
        assert answers[i].json()["error"] == "bad_token"


def test_prepare_gives_each_party_its_own_lasting_secrets_as_files(tmp_path: Path) -> None:
    specs = prepare(tmp_path, 3, 20_000)
    assert "ESA_SHUFFLER_TOKEN_SECRET_FILE" not in specs[0].env  # no client tokens issued
    values = []
    for spec in specs:
        files = {k: v for k, v in spec.env.items() if (k.endswith("_FILE") and "SECRET" in k) or
                 k.endswith("_TOKEN_FILE")}  # fmt: skip
        expected = 1 if spec.name == "analyzer" else 3  # admin; secret, admin, metrics
        assert len(files) == expected, spec.env
        for variable, path in files.items():
            assert Path(path).parent == tmp_path / "keys" / spec.name, variable
            assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
            assert variable.removesuffix("_FILE") not in spec.env  # never the value itself
            values.append(Path(path).read_text().strip())
    assert len(set(values)) == len(values) == 10 and all(len(v) >= 40 for v in values)
    again = prepare(tmp_path, 3, 20_000)  # a restart keeps every token valid
    assert [s.env for s in again] == [s.env for s in specs]
    chosen = prepare(tmp_path, 3, 20_000, overrides={"ESA_SHUFFLER_TOKEN_SECRET": "x" * 20})
    assert {s.env["ESA_SHUFFLER_TOKEN_SECRET"] for s in chosen[1:]} == {"x" * 20}
    assert all("ESA_SHUFFLER_TOKEN_SECRET_FILE" not in s.env for s in chosen)


def test_the_raised_enrolment_limit_and_the_example_pages_origins_are_local_only(
    tmp_path: Path,
) -> None:
    from services.cli.launcher import EXAMPLE_PAGE_ORIGINS, service_specs

    local = service_specs(tmp_path, 2)
    production = service_specs(tmp_path, 2, profile="production")
    for spec in local:
        prefix = "ESA_ANALYZER_" if spec.name == "analyzer" else "ESA_SHUFFLER_"
        mine = {k: v for k, v in LOCAL_SETTINGS.items() if k.startswith(prefix)}
        assert mine and mine.items() <= spec.env.items()
        assert spec.env[f"{prefix}CORS_ORIGINS"] == EXAMPLE_PAGE_ORIGINS
    for spec in production:
        assert not set(LOCAL_SETTINGS) & set(spec.env)


def test_prepare_writes_the_keys_an_app_pins_and_the_analyzers_registry(tmp_path: Path) -> None:
    """``var/trust.json``: the analyzer's config-signing key and each shuffler's signing key
    (one per trust domain, from their key files); ``var/shufflers.json``: where the analyzer
    fetches each signed descriptor and the key it pins for it; each shuffler's descriptor
    names that same URL. Keys survive a second prepare."""
    specs = prepare(tmp_path, 3, 20_000, shuffler_url="http://shuffler-{i}.example:{port}")
    trust = TrustAnchors.load(tmp_path / TRUST_FILE)
    analyzer = load_or_create_ed25519(tmp_path / "keys" / "analyzer" / "signing.pem")
    assert public_bytes(trust.analyzer) == public_bytes(analyzer.public_key())
    assert (tmp_path / "analyzer.pub").read_text().strip() == b64(public_bytes(trust.analyzer))
    registry = json.loads((tmp_path / "shufflers.json").read_text())
    assert [set(entry) for entry in registry] == [{"id", "url", "signing_key"}] * 3
    for spec, entry in zip(specs[1:], registry, strict=True):
        signer = load_or_create_ed25519(tmp_path / "keys" / spec.name / "signing.pem")
        assert entry["id"] == spec.name and public_bytes(trust.shufflers[spec.name]) == (
            public_bytes(signer.public_key())
        )
        assert entry["signing_key"] == b64(public_bytes(signer.public_key()))
        assert entry["url"] == f"http://{spec.name}.example:{spec.port}"
        assert spec.env["ESA_SHUFFLER_PUBLIC_URL"] == entry["url"]
    before = (tmp_path / TRUST_FILE).read_text()
    prepare(tmp_path, 3, 20_000)
    assert (tmp_path / TRUST_FILE).read_text() == before


def test_prepare_after_rotations_pins_the_keys_that_sign_now_and_makes_no_key_again(
    tmp_path: Path,
) -> None:
    """``esa up`` again after shuffler-1's first HPKE and signing keys retired (their files
    deleted): no key file is made again, and what apps and the analyzer pin is the key that
    signs now, never the retired root (whose file is gone: nobody can fork from it)."""
    prepare(tmp_path, 1, 20_000)
    keys = tmp_path / "keys" / "shuffler-1"
    directory = KeyDirectory(keys, shuffler_party("shuffler-1"))
    root = load_or_create_ed25519(keys / "signing.pem").public_key()
    earlier = time.time() - 10_000
    timing = Timing(activation_seconds=60, hpke_overlap_seconds=1000)
    hpke = directory.rotate("hpke", earlier, timing)
    signer = directory.rotate("signing", earlier, timing)
    assert sorted(directory.prune(time.time())) == sorted(
        r.key_id for r in directory.book().records if r.file in ("hpke.pem", "signing.pem")
    )
    prepare(tmp_path, 1, 20_000)
    assert not (keys / "hpke.pem").exists() and not (keys / "signing.pem").exists()
    refused = CliRunner().invoke(keys_generate, ["--role", "shuffler", "--out", str(keys)])
    assert refused.exit_code == 1 and "esa keys rotate" in refused.output, refused.output
    assert not (keys / "signing.pem").exists()
    trust = TrustAnchors.load(tmp_path / TRUST_FILE)
    assert b64(public_bytes(trust.shufflers["shuffler-1"])) == signer.public_key
    assert b64(public_bytes(trust.shufflers["shuffler-1"])) != b64(public_bytes(root))
    (entry,) = json.loads((tmp_path / "shufflers.json").read_text())
    assert entry["signing_key"] == signer.public_key
    # An older launcher made hpke.pem again with another key: the retired key is gone, the
    # shuffler still starts.
    load_or_create_x25519(keys / "hpke.pem")
    live = LiveKeys(directory, lambda: timing)
    assert set(live.ring.keys) == {bytes.fromhex(hpke.key_id)}
    assert b64(public_bytes(live.current.signer.public_key())) == signer.public_key


def test_default_channels_leave_room_for_every_fragment_count() -> None:
    """A contribution with more than max_fragments fragments is refused for good (413), and
    one with fewer than min_fragments too (400), so the default channels' limits must sit far
    above what their encoders produce, and never above the fewest an honest device sends."""
    import numpy as np

    from common.mechanisms import SeededSource, StateUpdate, ValueKind, get

    rng = SeededSource(1)
    for config, shufflers in itertools.product(DEFAULT_CHANNELS, (1, 2, 3)):
        mechanism = get(config.mechanism)
        params = mechanism.parse_params(config.params)
        counts = []
        for i in range(300):
            value: object = i % mechanism.domain_size(params)
            if mechanism.value_kind is ValueKind.STATE:
                value = StateUpdate(1, True)
            state = mechanism.new_state(params, rng)
            # One contribution a route; with fewer shufflers report fragments share routes.
            encoded = mechanism.encode(params, value, state, rng, shufflers)
            sizes = [len(fragments) for _, fragments in encoded.routes]  # each one is sent
            counts.append(max(sizes, default=0))
            assert min(sizes, default=config.min_fragments) >= config.min_fragments, config.id
        mean, sd = float(np.mean(counts)), float(np.std(counts))
        assert max(counts) <= config.max_fragments, (config.id, shufflers, max(counts))
        bounded = mechanism.fragment_limit(params) <= config.max_fragments
        assert bounded or mean + 8 * sd <= config.max_fragments, (config.id, shufflers, mean, sd)


def test_free_ports_are_below_the_ephemeral_range() -> None:
    """A service restarted on its port must not find it taken by an outgoing connection, which
    the kernel numbers from the ephemeral range (a CI failure: a shuffler stopped and started
    again by the outbox test found its port in use)."""
    from services.cli.launcher import PORT_FLOOR, ephemeral_floor, free_base_port

    for _ in range(20):
        base = free_base_port(4)
        assert base >= PORT_FLOOR and base + 4 <= ephemeral_floor()
        assert all(port_free(base + i) for i in range(4))
