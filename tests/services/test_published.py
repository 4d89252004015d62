"""What the parties publish for each other at start, with real processes and real HTTP: a
shuffler's signed descriptor (``ESA_SHUFFLER_PUBLISH_DIR`` → ``<id>.descriptor.json``), the
analyzer's config-signing key (``ESA_ANALYZER_PUBLISH_DIR`` → ``analyzer.pub``); an analyzer
whose registry pins each shuffler's key from the descriptor it published (``descriptor_file``)
and refuses to start on one it cannot use; and the trust anchors an app builder takes from a
folder of what the parties published (:meth:`TrustAnchors.from_published`).

Each party publishes into a folder of its own (as separate trust domains would), all below one
``published`` folder here."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import (
    ANALYZER_KEY_FILE,
    DESCRIPTOR_SUFFIX,
    CollectionConfigError,
    TrustAnchors,
    published_key,
    sign_descriptor,
    verify_collection,
)
from common.envelope import FragmentContext, load_or_create_ed25519, public_bytes
from common.mechanisms import krappor
from common.randomness import SeededSource
from common.wire import Batch, ShufflerDescriptor, SignedDescriptor, b64

from ..e2e.forge import analyzer_key, fragments, krappor_reports, post_part
from ..support import (
    LONG_EPOCH_CHANNEL,
    SMALL_CHANNEL,
    ServiceProcess,
    analyzer_process,
    registry_entry,
    shuffler_process,
)

SHUFFLERS = ("shuffler-1", "shuffler-2")
CHANNEL = LONG_EPOCH_CHANNEL


@dataclass
class Parties:
    """Two shufflers and an analyzer that pins their keys from what they published."""

    root: Path
    published: Path
    shufflers: dict[str, ServiceProcess]
    analyzer: ServiceProcess

    def descriptor_file(self, shuffler_id: str) -> Path:
        return self.published / shuffler_id / f"{shuffler_id}{DESCRIPTOR_SUFFIX}"

    def signer(self, party: str) -> Ed25519PrivateKey:
        """A party's own signing key (its key folder)."""
        return load_or_create_ed25519(self.root / party / "keys" / "signing.pem")


def _key(private: Ed25519PrivateKey) -> str:
    return b64(public_bytes(private.public_key()))


def _mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def _pinned_entry(shuffler: ServiceProcess, path: Path, **extra: str) -> dict[str, str]:
    """A registry entry that takes the shuffler's key from its published descriptor."""
    return {"id": shuffler.spec.name, "url": shuffler.url, "descriptor_file": str(path), **extra}


@pytest.fixture(scope="module")
def parties(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parties]:
    root = tmp_path_factory.mktemp("published")
    published = root / "published"
    shufflers = {
        sid: shuffler_process(root, sid, [SMALL_CHANNEL], publish_dir=str(published / sid))
        for sid in SHUFFLERS
    }
    started: list[ServiceProcess] = []
    try:
        for process in shufflers.values():  # first: the analyzer reads what they published
            started.append(process.start())
        registry = [
            _pinned_entry(p, published / sid / f"{sid}{DESCRIPTOR_SUFFIX}")
            for sid, p in shufflers.items()
        ]
        analyzer = analyzer_process(
            root,
            [CHANNEL.model_dump(mode="json")],
            registry,
            publish_dir=str(published / "analyzer"),
        )
        started.append(analyzer.start())
        yield Parties(root, published, shufflers, analyzer)
    finally:
        for process in started:
            process.stop()


def _config(url: str) -> dict[str, object]:
    """The signed collection config, once the analyzer has every shuffler's descriptor."""
    deadline = time.monotonic() + 60
    while True:
        answer = httpx.get(url + "/v1/config", timeout=10)
        if answer.status_code == 200:
            document: dict[str, object] = answer.json()
            return document
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.2)


@pytest.mark.system
def test_each_shuffler_publishes_its_descriptor_signed_with_its_own_key(
    parties: Parties,
) -> None:
    for sid, process in parties.shufflers.items():
        path = parties.descriptor_file(sid)
        assert _mode(path) == "0o644"  # public by design, whatever the umask
        document = SignedDescriptor.model_validate_json(path.read_text())
        named, key = published_key(document)
        assert named == sid and b64(public_bytes(key)) == _key(parties.signer(sid))
        served = httpx.get(process.url + "/v1/descriptor", timeout=10).json()["descriptor"]
        for field in ("id", "url", "signing_key", "keys"):
            assert document.descriptor[field] == served[field], field
        assert document.descriptor["url"] == process.url
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no leftovers


@pytest.mark.system
def test_the_analyzer_publishes_its_config_signing_key(parties: Parties) -> None:
    path = parties.published / "analyzer" / ANALYZER_KEY_FILE
    assert _mode(path) == "0o644"
    published = path.read_text()
    assert published == _key(parties.signer("analyzer")) + "\n"
    config = _config(parties.analyzer.url)["config"]
    assert isinstance(config, dict)
    assert config["analyzer"]["signing_key"] == published.strip()


@pytest.mark.system
def test_the_analyzer_pins_the_published_keys_and_refuses_batches_signed_otherwise(
    parties: Parties,
) -> None:
    document = _config(parties.analyzer.url)
    anchors = TrustAnchors.from_published(parties.published)  # what an app builder pins
    verified = verify_collection(document, anchors, time.time())
    assert {s.id: s.signing_key for s in verified.shufflers} == {
        sid: _key(parties.signer(sid)) for sid in SHUFFLERS
    }
    assert TrustAnchors.read(parties.published).to_json() == anchors.to_json()
    # A batch part signed by shuffler-1's own key is taken; signed by any other key, 401.
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    reports = krappor_reports(
        np.arange(10) % 20,
        krappor.KRapporParams(k=20, eps=4.0),
        FragmentContext(CHANNEL.id, epoch, ""),
        CHANNEL.payload_size,
        analyzer_key(parties.analyzer.url),
        SeededSource(epoch),
    )
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id="shuffler-1",
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=10,
        fragments=fragments(reports),
    )
    url = parties.analyzer.url
    for other in (Ed25519PrivateKey.generate(), parties.signer("shuffler-2")):
        forged = post_part(url, batch.body(), other, "shuffler-1")
        assert forged.status_code == 401 and forged.json()["error"] == "bad_preauth", forged.text
    taken = post_part(url, batch.body(), parties.signer("shuffler-1"), "shuffler-1")
    assert taken.status_code == 201, taken.text


@pytest.mark.system
def test_a_shuffler_publishes_again_on_restart_replacing_the_file_whole(tmp_path: Path) -> None:
    folder = tmp_path / "published"
    process = shuffler_process(tmp_path, "shuffler-1", [SMALL_CHANNEL], publish_dir=str(folder))
    path = folder / f"shuffler-1{DESCRIPTOR_SUFFIX}"
    process.start()
    try:
        first = SignedDescriptor.model_validate_json(path.read_text())
        assert published_key(first)[0] == "shuffler-1" and _mode(path) == "0o644"
    finally:
        process.stop()
    # A stale, truncated and private file left behind: the restart replaces it whole.
    path.write_text(path.read_text()[:40])
    path.chmod(0o600)
    stale = path.stat().st_ino
    time.sleep(1.1)  # a later issued_at
    process.start()
    try:
        again = SignedDescriptor.model_validate_json(path.read_text())
        named, key = published_key(again)
        assert named == "shuffler-1" and _mode(path) == "0o644"
        assert path.stat().st_ino != stale  # a new file renamed over the old one
        assert again.descriptor["issued_at"] > first.descriptor["issued_at"]
        assert again.descriptor["signing_key"] == first.descriptor["signing_key"]
        assert b64(public_bytes(key)) == _key(
            load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
        )
        assert sorted(p.name for p in folder.iterdir()) == [path.name]  # no temporary left
    finally:
        process.stop()


def _refused_at_start(analyzer: ServiceProcess) -> str:
    """Start ``analyzer``, which must exit at once; its log, whitespace collapsed."""
    with pytest.raises(RuntimeError, match="exited"):
        analyzer.start(timeout=60)
    return " ".join(analyzer.log_path.read_text().split())


@pytest.mark.system
def test_an_analyzer_refuses_to_start_on_a_descriptor_file_it_cannot_pin(
    parties: Parties, tmp_path: Path
) -> None:
    """Missing (the shuffler not started yet), describing another shuffler, or naming another
    key than the registry's ``signing_key``: the analyzer does not start, naming the file."""
    channels = [CHANNEL.model_dump(mode="json")]
    first, second = parties.shufflers["shuffler-1"], parties.shufflers["shuffler-2"]
    missing = parties.published / "shuffler-3" / f"shuffler-3{DESCRIPTOR_SUFFIX}"
    other = _key(Ed25519PrivateKey.generate())
    cases = {
        "missing": (
            [_pinned_entry(first, missing)],
            [str(missing), "is unusable", "is the shuffler started?"],
        ),
        "another shuffler": (
            [_pinned_entry(first, parties.descriptor_file("shuffler-2"))],
            [str(parties.descriptor_file("shuffler-2")), "describes 'shuffler-2'"],
        ),
        "another key": (
            [
                _pinned_entry(first, parties.descriptor_file("shuffler-1"), signing_key=other),
                _pinned_entry(second, parties.descriptor_file("shuffler-2")),
            ],
            [str(parties.descriptor_file("shuffler-1")), "not signed by the key pinned for it"],
        ),
    }
    for case, (registry, expected) in cases.items():
        analyzer = analyzer_process(tmp_path / case.replace(" ", "-"), channels, registry)
        log = _refused_at_start(analyzer)
        for text in expected:
            assert text in log, (case, text, log[-2000:])
    # The key the descriptor names, given as signing_key too: the analyzer starts.
    same = _key(parties.signer("shuffler-1"))
    registry = [_pinned_entry(first, parties.descriptor_file("shuffler-1"), signing_key=same)]
    analyzer = analyzer_process(tmp_path / "same-key", channels, registry)
    analyzer.start()
    analyzer.stop()


@pytest.mark.system
def test_an_entry_needs_a_key_or_a_descriptor_file(tmp_path: Path) -> None:
    signer = Ed25519PrivateKey.generate()
    entry = registry_entry("shuffler-1", "http://127.0.0.1:9", signer)
    del entry["signing_key"]
    analyzer = analyzer_process(tmp_path, [CHANNEL.model_dump(mode="json")], [entry])
    assert "give signing_key or descriptor_file" in _refused_at_start(analyzer)


# --- TrustAnchors.from_published on copies of what the real parties published ----------------


def _copy(parties: Parties, into: Path) -> Path:
    return Path(shutil.copytree(parties.published, into))


@pytest.mark.system
def test_published_keys_pin_what_the_parties_wrote(parties: Parties) -> None:
    anchors = TrustAnchors.from_published(parties.published)
    assert b64(public_bytes(anchors.analyzer)) == _key(parties.signer("analyzer"))
    assert {sid: b64(public_bytes(k)) for sid, k in anchors.shufflers.items()} == {
        sid: _key(parties.signer(sid)) for sid in SHUFFLERS
    }


@pytest.mark.system
def test_a_folder_without_one_analyzer_key_is_refused(parties: Parties, tmp_path: Path) -> None:
    none = _copy(parties, tmp_path / "none")
    (none / "analyzer" / ANALYZER_KEY_FILE).unlink()
    with pytest.raises(ValueError, match=f"need one {ANALYZER_KEY_FILE}, found 0"):
        TrustAnchors.from_published(none)
    two = _copy(parties, tmp_path / "two")
    (two / "old").mkdir()
    (two / "old" / ANALYZER_KEY_FILE).write_text(_key(Ed25519PrivateKey.generate()) + "\n")
    with pytest.raises(ValueError, match=f"need one {ANALYZER_KEY_FILE}, found 2"):
        TrustAnchors.from_published(two)


@pytest.mark.system
def test_a_folder_without_a_shuffler_descriptor_is_refused(
    parties: Parties, tmp_path: Path
) -> None:
    folder = _copy(parties, tmp_path / "folder")
    for sid in SHUFFLERS:
        shutil.rmtree(folder / sid)
    with pytest.raises(ValueError, match="no shuffler descriptor"):
        TrustAnchors.from_published(folder)
    with pytest.raises(ValueError, match="no shuffler descriptor"):
        TrustAnchors.read(folder)


@pytest.mark.system
def test_a_tampered_descriptor_is_refused_naming_its_file(parties: Parties, tmp_path: Path) -> None:
    """Its URL changed (the signature no longer verifies), its signing key swapped for another
    (its own signature does not verify with it), or not a descriptor at all."""
    other = _key(Ed25519PrivateKey.generate())
    for change in ({"url": "http://impostor.example"}, {"signing_key": other}, None):
        folder = _copy(parties, tmp_path / secrets.token_hex(4))
        path = folder / "shuffler-2" / f"shuffler-2{DESCRIPTOR_SUFFIX}"
        if change is None:
            path.write_text("{not json")
        else:
            document = json.loads(path.read_text())
            document["descriptor"].update(change)
            path.write_text(json.dumps(document))
            with pytest.raises(CollectionConfigError):
                published_key(SignedDescriptor.model_validate_json(path.read_text()))
        with pytest.raises(ValueError) as refused:
            TrustAnchors.from_published(folder)
        assert str(path) in str(refused.value), (change, refused.value)


@pytest.mark.system
def test_two_descriptors_of_one_shuffler_with_different_keys_are_refused(
    parties: Parties, tmp_path: Path
) -> None:
    """A stale descriptor with an old key, or an impostor's, beside the shuffler's own: the
    folder is refused, naming the second file, instead of pinning whichever is read last."""
    folder = _copy(parties, tmp_path / "folder")
    shutil.copytree(folder / "shuffler-1", folder / "zz-old")
    impostor = Ed25519PrivateKey.generate()
    path = folder / "zz-old" / f"shuffler-1{DESCRIPTOR_SUFFIX}"
    document = SignedDescriptor.model_validate_json(path.read_text())
    forged = ShufflerDescriptor(**{**document.descriptor, "signing_key": _key(impostor)})
    path.write_text(sign_descriptor(forged, impostor).model_dump_json())
    with pytest.raises(ValueError, match="a second descriptor of shuffler 'shuffler-1'") as found:
        TrustAnchors.from_published(folder)
    assert str(path) in str(found.value)
