"""Issue 20: every public SDK entry point raises an :class:`EsaError` subclass naming the bad
value — a wrong key, a malformed URL, an unreachable or misbehaving analyzer, an unusable state
path — never a raw ``binascii.Error``, ``httpx`` or ``sqlite3`` exception.

The analyzer and shuffler that misbehave are real HTTP servers on 127.0.0.1 answering what a
broken deployment or a captive portal answers; the configs are signed with real Ed25519 keys.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import sign_config
from common.envelope import key_id, public_bytes
from common.wire import (
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    HpkeKey,
    b64,
)
from encoder_client import (
    Client,
    ConfigError,
    EsaError,
    InvalidArgumentError,
    StateError,
    StateFileError,
    TrustedKeyError,
    ValueOutOfDomainError,
)

from ..support import QuietHandler, descriptor, free_port, handler_served

CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    min_crowd=20,
    max_fragments=1,
    payload_size=16,
)
PLACEHOLDER = "PASTE-YOUR-ANALYZER-SIGNING-KEY-BASE64"
#: The one shuffler's own signing key, and the pin a device holds for it.
SHUFFLER_SIGNER = Ed25519PrivateKey.generate()
SHUFFLER_KEYS = {"shuffler-1": b64(public_bytes(SHUFFLER_SIGNER.public_key()))}


class Answers(QuietHandler):
    """``GET /<status>/<kind>`` and ``POST`` anything: answers with that status and a body of
    that kind (``html``, ``list``, ``text``)."""

    BODIES: ClassVar[dict[str, bytes]] = {
        "html": b"<html>captive portal</html>",
        "list": b"[1, 2]",
        "text": b"oops",
    }

    def _answer(self) -> None:
        parts = self.path.strip("/").split("/")  # /<status>/<kind>[/v1/...]
        status, kind = (int(parts[0]), parts[1]) if parts[0].isdigit() else (200, "html")
        body = self.BODIES[kind]
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if kind == "list" else "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()


@pytest.fixture(scope="module")
def broken() -> Iterator[str]:
    """A real HTTP server that answers every request wrongly (HTML, lists, 500s)."""
    with handler_served(Answers) as url:
        yield url


def _signed_config(tmp: Path, shuffler_url: str) -> tuple[Path, str]:
    """A config file signed by a fresh analyzer key (returned as base64, as an app pins it)
    whose one shuffler, at ``shuffler_url``, vouches for itself with a key pinned in
    :data:`SHUFFLER_KEYS`."""
    signer, analyzer = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    shuffler = descriptor(SHUFFLER_SIGNER, X25519PrivateKey.generate(), url=shuffler_url)
    key = HpkeKey(
        key_id=key_id(analyzer.public_key()).hex(),
        public_key=b64(public_bytes(analyzer.public_key())),
    )
    pinned = b64(public_bytes(signer.public_key()))
    info = AnalyzerInfo(url="http://127.0.0.1:9", keys=[key], signing_key=pinned)
    now = int(time.time())
    config = CollectionConfig(
        issued_at=now,
        expires_at=now + 10**6,
        analyzer=info,
        shufflers=[shuffler],
        channels=[CHANNEL],
    )
    path = tmp / "config.json"
    path.write_text(sign_config(config, signer).model_dump_json())
    return path, pinned


def test_a_key_that_is_not_32_bytes_of_base64_is_a_trusted_key_error(tmp_path: Path) -> None:
    config, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    short = base64.b64encode(b"hello").decode()
    cases = [
        (PLACEHOLDER, "'PASTE-YOUR-ANALYZER-SIGNING-KEY-BASE64' is not base64"),
        (pinned[:-2], "is not base64"),  # a key cut while pasting: incorrect padding
        ("clé-" + pinned, "is not base64"),  # not even ASCII
        (short, f"'{short}' is 5 bytes; an Ed25519 public key is 32"),
        (b"\x01" * 31, "'31 raw bytes' is 31 bytes"),
        (3, "must be base64 text or bytes, not 3"),
        (None, "pin one key per trust domain"),
    ]
    for key, message in cases:
        with pytest.raises(TrustedKeyError, match=message) as raised:
            Client(
                config_file=config,
                trusted_key=key,  # type: ignore[arg-type]
                shuffler_keys=SHUFFLER_KEYS,
                state_path=tmp_path / "d.db",
            )
        assert isinstance(raised.value, ConfigError) and isinstance(raised.value, ValueError)
    # a shuffler's pin is checked the same way, and named
    with pytest.raises(TrustedKeyError, match=r"shuffler_keys\['shuffler-1'\] 'hello' is not"):
        Client(
            config_file=config,
            trusted_key=pinned,
            shuffler_keys={"shuffler-1": "hello"},
            state_path=tmp_path / "d.db",
        )
    assert not (tmp_path / "d.db").exists()  # refused before anything was created
    # var/analyzer.pub read as is (with its newline), and the raw 32 bytes, are both the key
    for key in (pinned + "\n", base64.b64decode(pinned)):
        with Client(
            config_file=config,
            trusted_key=key,
            shuffler_keys=SHUFFLER_KEYS,
            state_path=tmp_path / "ok.db",
        ) as client:
            assert client.channel("homepage").mechanism == "krr"


def test_the_analyzer_key_alone_is_not_enough(tmp_path: Path) -> None:
    """A device that pinned only the analyzer's key would take the shufflers' keys on the
    analyzer's word (docs/protocol.md, "Who vouches for what"): refused, whatever the config."""
    config, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    nothing: dict[str, str] = {}
    for shufflers in (None, nothing):
        with pytest.raises(TrustedKeyError, match="shuffler_keys must map each shuffler id"):
            Client(
                config_file=config,
                trusted_key=pinned,
                shuffler_keys=shufflers,
                state_path=tmp_path / "d.db",
            )
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps({"analyzer": pinned, "shufflers": SHUFFLER_KEYS}))
    with pytest.raises(TrustedKeyError, match="not both"):
        Client(
            config_file=config, trust_file=trust, trusted_key=pinned, state_path=tmp_path / "d.db"
        )
    for content, message in (
        (None, "No such file"),
        ("{not json", "trust file"),
        (json.dumps({"analyzer": pinned}), "shufflers"),
        (json.dumps({"analyzer": pinned, "shufflers": {}}), "pin no shuffler key"),
        (json.dumps({"analyzer": "nope", "shufflers": SHUFFLER_KEYS}), "analyzer key"),
    ):
        path = tmp_path / "bad-trust.json"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        with pytest.raises(TrustedKeyError, match=message):
            Client(config_file=config, trust_file=path, state_path=tmp_path / "d.db")
    assert not (tmp_path / "d.db").exists()
    with Client(config_file=config, trust_file=trust, state_path=tmp_path / "ok.db") as client:
        assert client.channel("homepage").mechanism == "krr"


@pytest.mark.parametrize("shufflers", [["shuffler-1"], "shuffler-1", [1]])
def test_shuffler_keys_that_are_not_a_mapping_are_a_trusted_key_error(
    tmp_path: Path, shufflers: object
) -> None:
    config, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(TrustedKeyError, match="shuffler_keys must map each shuffler id"):
        Client(
            config_file=config,
            trusted_key=pinned,
            shuffler_keys=shufflers,  # type: ignore[arg-type]
            state_path=tmp_path / "d.db",
        )


def test_malformed_config_urls_name_the_url(tmp_path: Path) -> None:
    _, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    cases = {
        "not a url": "'not a url' is not an http:// or https:// URL",
        "ftp://127.0.0.1/v1/config": "is not an http:// or https:// URL",
        "http://[::1/v1/config": "'http://\\[::1/v1/config' is not a URL",
        "": "'' is not an http:// or https:// URL",
    }
    for url, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            Client(
                url, trusted_key=pinned, shuffler_keys=SHUFFLER_KEYS, state_path=tmp_path / "d.db"
            )
    with pytest.raises(ConfigError, match="give config_url or config_file"):
        Client(trusted_key=pinned, shuffler_keys=SHUFFLER_KEYS, state_path=tmp_path / "d.db")
    with pytest.raises(ConfigError, match="config_url must be a string URL, not 8100"):
        Client(8100, trusted_key=pinned, shuffler_keys=SHUFFLER_KEYS, state_path=tmp_path / "d.db")  # type: ignore[arg-type]


def test_network_errors_and_bad_answers_at_construction_are_config_errors(
    tmp_path: Path, broken: str
) -> None:
    _, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    nobody = f"http://127.0.0.1:{free_port()}/v1/config"
    cases = {
        nobody: f"cannot fetch config_url '{nobody}': ConnectError",
        f"{broken}/500/text": "answered HTTP 500: 'oops'",
        f"{broken}/200/html": "did not answer JSON: '<html>captive portal</html>'",
        f"{broken}/200/list": "refused: not a JSON object but list",
    }
    for url, message in cases.items():
        with pytest.raises(ConfigError, match=message) as raised:
            Client(
                url,
                trusted_key=pinned,
                shuffler_keys=SHUFFLER_KEYS,
                state_path=tmp_path / "d.db",
                background=False,
            )
        assert url in str(raised.value)
    with pytest.raises(ConfigError, match=r"cannot be read: .*No such file"):
        Client(
            config_file=tmp_path / "missing.json",
            trusted_key=pinned,
            shuffler_keys=SHUFFLER_KEYS,
            state_path="d.db",
        )
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"junk\.json' is not JSON"):
        Client(
            config_file=tmp_path / "junk.json",
            trusted_key=pinned,
            shuffler_keys=SHUFFLER_KEYS,
            state_path="d.db",
        )


def test_an_unusable_state_path_is_a_state_file_error_and_nothing_is_moved(
    tmp_path: Path,
) -> None:
    config, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    cases = {
        folder: "a-folder cannot be used: (Is a directory|not a regular file)",
        a_file / "device.db": r"notes\.txt/device\.db cannot be used: notes\.txt is not a folder",
        Path("/proc/esa-no-such-dir/device.db"): "cannot be used: No such file or directory",
    }
    for path, message in cases.items():
        with pytest.raises(StateFileError, match=message) as raised:
            Client(
                config_file=config,
                trusted_key=pinned,
                shuffler_keys=SHUFFLER_KEYS,
                state_path=path,
                background=False,
            )
        assert isinstance(raised.value, StateError) and isinstance(raised.value, EsaError)
    assert (folder / "keep.txt").read_text() == "mine"  # the folder was not moved aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder", "config.json", "notes.txt"]
    if os.geteuid() != 0:  # root writes through permission bits
        read_only = tmp_path / "ro.db"
        Client(
            config_file=config,
            trusted_key=pinned,
            shuffler_keys=SHUFFLER_KEYS,
            state_path=read_only,
        ).close()
        read_only.chmod(0o444)
        with pytest.raises(StateFileError, match=r"ro\.db"):
            Client(
                config_file=config,
                trusted_key=pinned,
                shuffler_keys=SHUFFLER_KEYS,
                state_path=read_only,
            )
        assert read_only.exists()


def test_bad_arguments_and_values_are_typed(tmp_path: Path) -> None:
    config, pinned = _signed_config(tmp_path, "http://127.0.0.1:9")
    state = tmp_path / "d.db"
    bad: list[tuple[dict[str, object], str]] = [
        ({"timeout": 0}, "timeout must be a positive number of seconds: 0"),
        ({"flush_interval": -1.0}, "flush_interval must be a positive number of seconds: -1.0"),
        ({"weights": {"shuffler-1": -1.0}}, "weights must be non-negative"),
        ({"weights": {"shuffler-1": 0.0}}, "at least one positive"),
        ({"crowd": 3}, "crowd must be a string, not 3"),
        ({"state_path": None}, "state_path must be a file path, not None"),
    ]
    for change, message in bad:
        kwargs: dict[str, object] = {
            "trusted_key": pinned,
            "shuffler_keys": SHUFFLER_KEYS,
            "state_path": state,
            **change,
        }
        with pytest.raises(InvalidArgumentError, match=message) as raised:
            Client(config_file=config, **kwargs)  # type: ignore[arg-type]
        assert isinstance(raised.value, EsaError) and isinstance(raised.value, ValueError)
    client = Client(
        config_file=config,
        trusted_key=pinned,
        shuffler_keys=SHUFFLER_KEYS,
        state_path=state,
        background=False,
    )
    with pytest.raises(ValueOutOfDomainError, match="'seven'"):
        client.histogram("homepage").report("seven")  # type: ignore[arg-type]
    client.close()
    with pytest.raises(StateFileError, match=r"d\.db"):  # a report after close()
        client.histogram("homepage").report(1)


def test_flush_survives_a_shuffler_that_answers_garbage(tmp_path: Path, broken: str) -> None:
    """The enrolment answer is HTML, the contribution answer a 400 without JSON: flush delivers
    nothing, raises nothing, and keeps the contribution for a later attempt."""
    config, pinned = _signed_config(tmp_path, f"{broken}/200/html")
    with Client(
        config_file=config,
        trusted_key=pinned,
        shuffler_keys=SHUFFLER_KEYS,
        state_path=tmp_path / "d.db",
        background=False,
    ) as client:
        client.histogram("homepage").report(1)
        assert client.flush() == 0
        assert client.state.outbox_size() == 1
    config, pinned = _signed_config(tmp_path, f"{broken}/400/text")
    with Client(
        config_file=config,
        trusted_key=pinned,
        shuffler_keys=SHUFFLER_KEYS,
        state_path=tmp_path / "e.db",
        background=False,
    ) as client:
        client.state.set_token("shuffler-1", "a-token")  # skip enrolment: straight to the 400
        client.histogram("homepage").report(1)
        assert client.flush() == 0
        assert client.state.outbox_size() == 0  # a 400 is refused for good: dropped, logged
