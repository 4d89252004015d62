"""Every private key under a folder, by content: run by tests/deploy/test_trust_domains.py
inside a throwaway auditor container (the deployment's image, no network) that mounts each of
the compose project's volumes read-only at ``<root>/<volume>``.

Finds each PEM private key (Ed25519 or X25519, as ``common.envelope`` writes them), then every
other file holding the same key in another form (its raw 32 bytes, or their base64): a copy in
a database page or a log counts. Prints a JSON list of ``{"volume", "path", "kind", "form",
"public_key"}`` (the public key as standard base64, which is how the parties publish theirs);
never a private value.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

PEM = re.compile(rb"-----BEGIN PRIVATE KEY-----.+?-----END PRIVATE KEY-----", re.S)
RAW = serialization.Encoding.Raw


def _files(root: Path) -> list[tuple[str, Path]]:
    found = []
    for volume in sorted(os.listdir(root)):
        for folder, _, names in os.walk(root / volume):
            for name in names:
                path = Path(folder) / name
                if path.is_file() and not path.is_symlink():
                    found.append((volume, path))
    return found


def _public(key: object) -> tuple[str, str, bytes] | None:
    """(kind, public key base64, private raw bytes) of a key this deployment uses."""
    private_raw = serialization.PrivateFormat.Raw
    none = serialization.NoEncryption()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        kind = "ed25519"
    elif isinstance(key, x25519.X25519PrivateKey):
        kind = "x25519"
    else:
        return None
    public = key.public_key().public_bytes(RAW, serialization.PublicFormat.Raw)
    return kind, base64.b64encode(public).decode(), key.private_bytes(RAW, private_raw, none)


def main(root: Path) -> list[dict[str, str]]:
    files = _files(root)
    findings: list[dict[str, str]] = []
    keys: dict[bytes, tuple[str, str]] = {}  # private raw -> (kind, public)
    for volume, path in files:
        data = path.read_bytes()
        for block in PEM.findall(data):
            try:
                parsed = _public(serialization.load_pem_private_key(block, password=None))
            except ValueError:
                continue
            if parsed is None:
                continue
            kind, public, raw = parsed
            keys[raw] = (kind, public)
            where = {"volume": volume, "path": str(path.relative_to(root / volume))}
            findings.append({**where, "kind": kind, "form": "pem", "public_key": public})
    for volume, path in files:  # a second pass: the database volumes are large
        data = path.read_bytes()
        for raw, (kind, public) in keys.items():
            for form, needle in (("raw", raw), ("base64", base64.b64encode(raw))):
                if needle in data:
                    where = {"volume": volume, "path": str(path.relative_to(root / volume))}
                    findings.append({**where, "kind": kind, "form": form, "public_key": public})
    return findings


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
