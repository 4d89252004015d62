"""A small FastAPI shop instrumented only through the OpenTelemetry API, reporting through ESA.

The app knows nothing of ESA: FastAPI's OpenTelemetry instrumentation records
``http.server.request.duration`` (a histogram with ``http.route``), and the app itself counts
searches with a plain OTel counter. Only ``main()`` wires the meter provider to ESA
(:func:`encoder_client.otel.meter_provider` with ``mapping.yaml`` beside this file): the
epoch's most used route goes to channel ``homepage`` and the median request duration's bucket
to ``features`` — the default channels of ``esa up``. The search counter and every other
attribute (methods, status codes, the query text) stay on the device.

Run it against ``esa up`` (from the repository root)::

    esa up &                                   # analyzer on :8100, shufflers on :8101..
    python docs/examples/otel_app/shop.py      # the app on :8000, one device

or simulate many devices with ``python docs/examples/otel_app/shop_traffic.py --help``.
"""

from __future__ import annotations

import os

# The stable HTTP semantic conventions (``http.route`` on ``http.server.request.duration``);
# read once, when the instrumentation first records.
os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")

from pathlib import Path

from fastapi import FastAPI, HTTPException
from opentelemetry import metrics
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

HERE = Path(__file__).resolve().parent
MAPPING = HERE / "mapping.yaml"
ITEMS = {1: "teapot", 2: "kettle", 3: "mug"}


def create_app(meter_provider: metrics.MeterProvider | None = None) -> FastAPI:
    """The shop, instrumented with ``meter_provider`` (default: the global one)."""
    app = FastAPI(title="shop")
    meter = (meter_provider or metrics.get_meter_provider()).get_meter("shop")
    searches = meter.create_counter("shop.searches", description="searches (stays on device)")

    @app.get("/")
    def home() -> dict[str, str]:
        return {"shop": "open"}

    @app.get("/items/{item_id}")
    def item(item_id: int) -> dict[str, str]:
        if item_id not in ITEMS:
            raise HTTPException(404, f"no item {item_id}")
        return {"item": ITEMS[item_id]}

    @app.get("/search")
    def search(q: str = "") -> dict[str, list[str]]:
        searches.add(1, {"query.length": len(q)})
        return {"results": [name for name in ITEMS.values() if q in name]}

    @app.get("/cart")
    def cart() -> dict[str, int]:
        return {"items": 0}

    @app.post("/checkout")
    def checkout() -> dict[str, str]:
        return {"order": "placed"}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    FastAPIInstrumentor.instrument_app(app, meter_provider=meter_provider)
    return app


def main() -> None:
    """Serve the shop as one ESA device (settings from the environment):

    ``ESA_CONFIG_URL`` (default ``http://127.0.0.1:8100/v1/config``), ``ESA_TRUST_FILE``
    (default ``var/trust.json``, written by ``esa up``: the keys a device pins, one per party),
    ``ESA_STATE`` (default ``shop-device.db``), ``ESA_MAPPING`` (default ``mapping.yaml``
    here), ``ESA_EXPORT_INTERVAL`` seconds (default 60), ``PORT`` (default 8000).
    """
    import uvicorn

    from encoder_client import Client
    from encoder_client.otel import meter_provider

    client = Client(
        os.environ.get("ESA_CONFIG_URL", "http://127.0.0.1:8100/v1/config"),
        trust_file=Path(os.environ.get("ESA_TRUST_FILE", "var/trust.json")),
        state_path=os.environ.get("ESA_STATE", "shop-device.db"),
    )
    provider = meter_provider(
        client,
        os.environ.get("ESA_MAPPING", str(MAPPING)),
        export_interval_seconds=float(os.environ.get("ESA_EXPORT_INTERVAL", "60")),
        close_client=True,
    )
    metrics.set_meter_provider(provider)
    try:
        port = int(os.environ.get("PORT", "8000"))
        uvicorn.run(create_app(provider), host="127.0.0.1", port=port)
    finally:
        provider.shutdown()  # reports this epoch's tallies, delivers what it can


if __name__ == "__main__":
    main()
