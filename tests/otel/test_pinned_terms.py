"""The bridge under a config that relaxes a mapped channel's pinned privacy terms: the report is
refused by the SDK (``privacy_refused``), nothing is queued and the app never sees an error."""

from __future__ import annotations

from pathlib import Path

from common.collection import sign_config
from common.wire import CollectionConfig, SignedConfig
from encoder_client import Client
from encoder_client.otel import EsaMetricExporter

from ..support import offline_config
from .helpers import Clock, Device, krr_channel

DURATION = "http.server.request.duration"
CATEGORY = {
    "kind": "category",
    "channel": "routes",
    "instrument": DURATION,
    "attribute": "http.route",
    "values": ["/", "/search"],
}


def test_a_relaxed_channel_is_not_reported_and_the_app_sees_no_error(tmp_path: Path) -> None:
    found, clock = offline_config(tmp_path, [krr_channel("routes", eps=2.0)]), Clock()
    client = Client(
        config_file=found.path,
        trust_file=found.trust_file,
        state_path=tmp_path / "device.db",
        background=False,
        clock=clock,
    )
    phone = Device(client=client, clock=clock, shuffler=found.shuffler, analyzer=found.analyzer)
    try:
        exporter = EsaMetricExporter(client, {"rules": [CATEGORY]}, clock=clock, background=False)
        provider, reader = phone.provider(exporter)
        signed = SignedConfig.model_validate_json(found.path.read_text())
        config = CollectionConfig.model_validate(signed.config)
        relaxed = config.model_copy(
            update={
                "channels": [krr_channel("routes", eps=12.0)],
                "issued_at": config.issued_at + 1,
            }
        )
        found.path.write_text(sign_config(relaxed, found.signer).model_dump_json())
        client.refresh_config()
        provider.get_meter("app").create_histogram(DURATION).record(0.05, {"http.route": "/"})
        clock.at(0.8)
        reader.collect()
        stats = exporter.stats()["routes"]
        assert (stats.reported, stats.privacy_refused, stats.refused) == (0, 1, 0)
        assert phone.contributions() == []
    finally:
        phone.close()
