"""Simulated traffic for the shop: many devices, each one shop instance with its own ESA state.

Each device runs :func:`shop.create_app` with its own meter provider — the ESA exporter
(:func:`encoder_client.otel.meter_provider`) and, beside it, an in-memory reader that keeps
what the app recorded — sends requests favouring one route, then shuts its provider down: the
exporter reports the epoch's most used route and median-duration bucket, and the SDK delivers
them to the shufflers. Returns, per device, the route the app's own metrics say it used most.

    esa up &
    python docs/examples/otel_app/shop_traffic.py --devices 400 --close
    # then open http://127.0.0.1:8100/ (the dashboard) and the homepage channel

(``--close`` ends the epoch at every shuffler through its admin API, with ``esa up``'s
development token, so the estimate appears now rather than at the end of the hour.)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shop import MAPPING, create_app

ROUTES = ("/", "/items/{item_id}", "/search", "/cart", "/checkout", "/health")
ROUTE = "http.route"


@dataclass(frozen=True)
class Device:
    """One simulated device: its favourite route, what its app recorded per route, and
    whether the SDK delivered its reports."""

    favourite: str
    recorded: dict[str, int]
    delivered: bool

    @property
    def most_used(self) -> str:
        """The route the app's own metrics say this device used most."""
        return max(self.recorded, key=lambda route: self.recorded[route])


def _request(http: TestClient, route: str, rng: random.Random) -> None:
    if route == "/checkout":
        http.post(route)
    elif route == "/items/{item_id}":
        http.get(f"/items/{rng.randint(1, 3)}")
    elif route == "/search":
        http.get("/search", params={"q": "tea"})
    else:
        http.get(route)


def _recorded(reader: InMemoryMetricReader) -> dict[str, int]:
    """Requests per route, as the app's OpenTelemetry instrumentation recorded them."""
    counts: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != "http.server.request.duration":
                    continue
                for point in metric.data.data_points:
                    route = (point.attributes or {}).get(ROUTE)
                    if isinstance(point, HistogramDataPoint) and isinstance(route, str):
                        counts[route] = counts.get(route, 0) + point.count
    return counts


def run_device(
    config_url: str,
    trust_file: Path,
    state_path: Path,
    favourite: str,
    rng: random.Random,
    requests: int = 4,
) -> Device:
    """One device's session: ``requests`` to its favourite route and a few to others (the
    device pins the keys in ``trust_file``: ``var/trust.json`` of ``esa up``)."""
    from encoder_client import Client
    from encoder_client.otel import meter_provider

    client = Client(config_url, trust_file=trust_file, state_path=state_path, background=False)
    recorder = InMemoryMetricReader()
    provider = meter_provider(
        client,
        MAPPING,
        export_interval_seconds=3600.0,
        extra_readers=(recorder,),
    )
    with TestClient(create_app(provider)) as http:
        others = rng.sample([r for r in ROUTES if r != favourite], 2)
        for route in [favourite] * requests + others + others[:1]:
            _request(http, route, rng)
    recorded = _recorded(recorder)
    provider.shutdown()  # the exporter reports the epoch's values and tries to deliver them
    delivered = _deliver(client, time.monotonic() + 30)
    client.close()
    return Device(favourite, recorded, delivered)


def _deliver(client: Any, deadline: float) -> bool:
    """Flush the outbox until it is empty (the SDK retries with backoff) or ``deadline``."""
    while client.state.outbox_size() and time.monotonic() < deadline:
        client.flush()
        time.sleep(0.1 if client.state.outbox_size() else 0)
    return not client.state.outbox_size()


def run(
    config_url: str,
    trust_file: Path,
    state_dir: Path,
    favourites: Sequence[str],
    seed: int = 0,
) -> list[Device]:
    """Every device in turn, each with its own state file under ``state_dir``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    return [
        run_device(config_url, trust_file, state_dir / f"device-{i}.db", favourite, rng)
        for i, favourite in enumerate(favourites)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--analyzer", default="http://127.0.0.1:8100")
    parser.add_argument(
        "--trust",
        type=Path,
        default=Path("var/trust.json"),
        help="the keys devices pin, one per party (written by esa up)",
    )
    parser.add_argument("--state-dir", type=Path, default=Path("var/shop-devices"))
    parser.add_argument("--devices", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--close", action="store_true", help="close the epoch at the shufflers")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    weights = [1 / (rank + 1) for rank in range(len(ROUTES))]  # Zipf-like popularity
    favourites = rng.choices(ROUTES, weights, k=args.devices)
    devices = run(
        args.analyzer + "/v1/config",
        args.trust,
        args.state_dir,
        favourites,
        args.seed,
    )
    for route in ROUTES:
        print(f"{route:20s} {sum(d.most_used == route for d in devices):6d} devices")
    if args.close:
        _close(args.analyzer)


def _close(analyzer: str) -> None:
    import httpx

    config = httpx.get(analyzer + "/v1/config").json()["config"]
    channels = {c["id"]: c["epoch_seconds"] for c in config["channels"]}
    for shuffler in config["shufflers"]:  # each shuffler's own signed descriptor
        for channel in ("homepage", "features"):
            httpx.post(
                shuffler["descriptor"]["url"] + "/v1/admin/close",
                headers={"Authorization": "Bearer development"},
                json={"channel_id": channel, "epoch": int(time.time() // channels[channel])},
                timeout=60,
            ).raise_for_status()
    print("epoch closed; estimates at", analyzer + "/v1/channels/homepage/estimate")


if __name__ == "__main__":
    main()
