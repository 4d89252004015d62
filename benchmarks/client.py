"""SDK cost: encode + seal + queue per report, and memory with a 10,000-contribution outbox.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/client.py [--write]``). No servers: the client
loads a locally signed collection config (the same document an analyzer serves) and nothing is
delivered. ``--write`` records the "Client SDK" section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import command_line, machine, pin_one_core, write_section
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import TrustAnchors, sign_config
from common.envelope import key_id, public_bytes
from common.wire import ChannelConfig, CollectionConfig, b64
from encoder_client import Client
from tests.support import descriptor

SECTION = "## Client SDK"
CHANNELS = [
    ChannelConfig(
        id="krappor",
        mechanism="krappor",
        params={"k": 1_778_120, "eps": 12.0},
        epoch_seconds=1,
        max_fragments=64,
    ),
    ChannelConfig(
        id="rfrag",
        mechanism="rfrag",
        params={"k": 10_000, "eps_b": 8.0, "eps_f": 6.0, "tau": 3},
        epoch_seconds=1,
    ),
    ChannelConfig(id="krr", mechanism="krr", params={"k": 10_000, "eps": 6.0}, epoch_seconds=1),
    ChannelConfig(
        id="zsum",
        mechanism="zsum",
        params={"d": 16, "eps": 1.0, "delta": 1e-8, "n": 100_000},
        epoch_seconds=1,
        max_fragments=32,
    ),
]
REPORTS = 2_000
OUTBOX = 10_000


def _config(tmp: Path) -> tuple[Path, Path]:
    """The signed config (each shuffler in its own signed descriptor) and the trust file that
    pins the analyzer's key and every shuffler's."""
    signer, analyzer = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    shufflers, pinned = [], {}
    for i in range(3):
        sid, shuffler_signer = f"shuffler-{i + 1}", Ed25519PrivateKey.generate()
        url = f"http://127.0.0.1:{9000 + i}"
        shufflers.append(descriptor(shuffler_signer, X25519PrivateKey.generate(), sid, url))
        pinned[sid] = shuffler_signer.public_key()
    now = int(time.time())
    config = {
        "issued_at": now,
        "expires_at": now + 10**7,
        "analyzer": {
            "url": "http://127.0.0.1:8100",
            "keys": [
                {
                    "key_id": key_id(analyzer.public_key()).hex(),
                    "public_key": b64(public_bytes(analyzer.public_key())),
                }
            ],
            "signing_key": b64(public_bytes(signer.public_key())),
        },
        "shufflers": [d.model_dump() for d in shufflers],
        "channels": [c.model_dump() for c in CHANNELS],
    }
    path = tmp / "config.json"
    path.write_text(sign_config(CollectionConfig.model_validate(config), signer).model_dump_json())
    trust = tmp / "trust.json"
    trust.write_text(json.dumps(TrustAnchors(signer.public_key(), pinned).to_json()))
    return path, trust


def main() -> None:
    args = command_line(__doc__).parse_args()
    pin_one_core()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        config, trust = _config(tmp)
        start_time = time.time()
        for channel in CHANNELS:
            tick = [0]

            def clock(tick: list[int] = tick) -> float:
                return start_time + tick[0]

            client = Client(
                config_file=config,
                trust_file=trust,
                state_path=tmp / f"{channel.id}.db",
                background=False,
                clock=clock,
            )
            reporter = (
                client.counts(channel.id)
                if channel.mechanism == "zsum"
                else client.histogram(channel.id)
            )
            started = time.perf_counter()
            for i in range(REPORTS):
                tick[0] = i
                reporter.report(i % 16)
            rows.append((channel.mechanism, (time.perf_counter() - started) / REPORTS * 1e3))
            client.close()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tick = [0]
        client = Client(
            config_file=config,
            trust_file=trust,
            state_path=tmp / "outbox.db",
            background=False,
            clock=lambda: start_time + tick[0],
        )
        reporter = client.histogram("krr")
        for i in range(OUTBOX):
            tick[0] = i
            reporter.report(i % 100)
        size = client.state.outbox_size()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        state_bytes = sum(p.stat().st_size for p in tmp.glob("outbox.db*"))
        client.close()
    lines = [
        "Command: `make bench WRITE=--write` "
        "(runs `.venv/bin/python benchmarks/client.py --write`).",
        f"Machine: {machine()}.",
        "",
        "Per report: validate, encode (OS CSPRNG), pad and HPKE-seal every fragment for the",
        "analyzer, HPKE-seal the contribution(s) for the shuffler(s), and commit state + outbox",
        f"to the device's SQLite file (synchronous=FULL); mean over {REPORTS:,} reports.",
        "",
        "| mechanism | ms per report |",
        "|---|---|",
        *[f"| {name} | {ms:.2f} |" for name, ms in rows],
        "",
        f"Outbox of {size:,} sealed contributions (k-RR): peak resident memory of the process",
        f"{after / 1024:.0f} MiB ({(after - before) / 1024:+.0f} MiB while filling it); the",
        f"outbox lives on disk ({state_bytes / 2**20:.1f} MiB state file), not in memory.",
    ]
    write_section(SECTION, "\n".join(lines), args.write)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
