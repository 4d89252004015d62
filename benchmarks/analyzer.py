"""Analyzer speed: batch intake vs raw HPKE opening, and a Table I-size estimate.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/analyzer.py [--write]``). The analyzer
runs as a real uvicorn process on SQLite; signed batches of sealed k-RAPPOR fragments
(k = 1,778,120, ε = 12) are POSTed to it. In the same run, this process measures how fast it
can open the same kind of sealed fragment with nothing else to do. ``--write`` records the
"Analyzer" section of docs/benchmarks.md.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import command_line, machine, write_section

from common.envelope import (
    FragmentContext,
    KeyRing,
    load_or_create_ed25519,
    load_or_create_x25519,
    open_fragment,
    seal_fragment,
    sign,
)
from common.mechanisms import krappor
from common.preauth import PREAUTH_HEADER, preauth_header
from common.randomness import default_source
from common.wire import PART_FRAGMENTS, Batch, ChannelConfig, b64
from tests.support import analyzer_process, registry_entry

SECTION = "## Analyzer"
K = 1_778_120
CHANNEL = ChannelConfig(
    id="heavy",
    mechanism="krappor",
    params={"k": K, "eps": 12.0},
    min_crowd=100,
    max_fragments=64,
    payload_size=16,
    delta=5e-10,
)
BATCHES, PER_BATCH = 4, 5_000


def main() -> None:
    args = command_line(__doc__).parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        signer = load_or_create_ed25519(tmp / "s1" / "signing.pem")
        analyzer_key = load_or_create_x25519(tmp / "analyzer" / "keys" / "hpke.pem")
        # Batches need only the shuffler's pinned key (its descriptor is never fetched).
        registry = [registry_entry("shuffler-1", "http://127.0.0.1:1", signer)]
        params = krappor.KRapporParams(k=K, eps=12.0)
        bodies = []
        sealed_all: list[tuple[bytes, FragmentContext]] = []
        # One batch per epoch: the analyzer takes one batch per shuffler and group.
        for epoch in range(1, BATCHES + 1):
            context = FragmentContext(CHANNEL.id, epoch, "")
            sealed = [
                seal_fragment(f, context, 16, analyzer_key.public_key())
                for _ in range(PER_BATCH)
                for f in krappor.KRappor().encode_value(
                    params, secrets.randbelow(1000), default_source()
                )
            ]
            sealed_all.extend((blob, context) for blob in sealed)
            # In parts of at most PART_FRAGMENTS fragments, as a shuffler cuts a batch.
            batch_id, parts = secrets.token_hex(16), -(-len(sealed) // PART_FRAGMENTS)
            for part in range(parts):
                batch = Batch(
                    batch_id=batch_id,
                    part=part,
                    parts=parts,
                    shuffler_id="shuffler-1",
                    channel_id=CHANNEL.id,
                    crowd_id="",
                    epoch=epoch,
                    n_contributions=PER_BATCH,
                    fragments=[
                        b64(f) for f in sealed[part * PART_FRAGMENTS : (part + 1) * PART_FRAGMENTS]
                    ],
                )
                body = batch.body()
                bodies.append((body, b64(sign(body, signer))))
        fragments = sum(len(Batch.model_validate_json(b).fragments) for b, _ in bodies)
        ring = KeyRing.of(analyzer_key)
        start = time.perf_counter()
        for blob, context in sealed_all[:20_000]:
            open_fragment(blob, context, ring)
        raw_rate = 20_000 / (time.perf_counter() - start)
        service = analyzer_process(tmp, [CHANNEL.model_dump()], registry).start()
        try:
            with httpx.Client(timeout=600) as client:
                start = time.perf_counter()
                for body, signature in bodies:
                    response = client.post(
                        service.url + "/v1/batches",
                        content=body,
                        headers={
                            "ESA-Signature": signature,
                            "ESA-Shuffler": "shuffler-1",
                            PREAUTH_HEADER: preauth_header("shuffler-1", body, signer, time.time()),
                        },
                    )
                    assert response.status_code == 201, response.text
                span = f"epoch_from=1&epoch_to={BATCHES}"
                estimate = service.url + f"/v1/channels/{CHANNEL.id}/estimate?{span}&top=100"
                # Parts are stored, then opened in the background (issue 11): intake ends when
                # the last batch is complete and the estimate covers every contribution.
                while (response := client.get(estimate)).status_code != 200 or response.json()[
                    "n"
                ] < BATCHES * PER_BATCH:
                    time.sleep(0.05)
                intake_seconds = time.perf_counter() - start
                start = time.perf_counter()
                response = client.get(estimate)
                estimate_seconds = time.perf_counter() - start
                assert response.status_code == 200, response.text
                certificate = response.json()["certificate"]
        finally:
            service.stop()
    intake_rate = fragments / intake_seconds
    lines = [
        "Command: `make bench WRITE=--write` "
        "(runs `.venv/bin/python benchmarks/analyzer.py --write`).",
        f"Machine: {machine(pinned=False)}.",
        "",
        f"{BATCHES} batches (one per epoch), {fragments:,} sealed k-RAPPOR fragments in all",
        f"(k = 1,778,120, ε = 12, {BATCHES * PER_BATCH:,} contributions), in {len(bodies)} signed",
        f"parts of at most {PART_FRAGMENTS:,} fragments POSTed to one",
        "`esa analyzer serve` process (SQLite). Intake = verify and store each part, then open",
        "every fragment on the opening pool and fold it in (until the estimate covers all).",
        "",
        "| measure | value |",
        "|---|---|",
        f"| raw HPKE open rate (this process, nothing else) | {raw_rate:,.0f} fragments/s |",
        f"| analyzer intake over HTTP | {intake_rate:,.0f} fragments/s |",
        f"| ratio intake / raw | **{intake_rate / raw_rate:.2f}** (target >= 0.6) |",
        "| estimate of the 1,778,120-bin histogram with its certificate | "
        f"**{estimate_seconds:.2f} s** (target < 1 s) |",
        "",
        f"Certificate of that release: ε = {certificate['eps']:.4g}, δ = {certificate['delta']:.3g}"
        f" ({certificate['method']}).",
    ]
    write_section(SECTION, "\n".join(lines), args.write)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
