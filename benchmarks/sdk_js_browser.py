"""What the TypeScript SDK's ``report()`` costs a web page's main thread, in headless Chromium.

Run: ``.venv/bin/python benchmarks/sdk_js_browser.py [--write]`` (builds sdk-js when stale;
``--write`` replaces the "TypeScript device SDK in a browser" section of docs/benchmarks.md,
without it the numbers are only printed). A deployment as ``esa up`` starts it (the default
channels, CORS granting the page's origin) and the example page (docs/examples/web/) served
on 127.0.0.1 and loaded without reporting; ``--devices`` devices are created on it (each its
own IndexedDB database) and each makes the page's three reports
(``homepage`` k-RAPPOR, ``homepage-fragments``, ``abroad``), calls back to back, one device
after the other. Measured in the page (sdk-js/scripts/browser.mjs): the synchronous part of
each call (``performance.now()`` around it), the time until its promise settles, tasks over
50 ms (PerformanceObserver ``longtask``), and the main thread's task and script time over the
reports (the DevTools protocol's ``Performance.getMetrics``) and the page's event-loop delay.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import add_write, machine, run_main, write_section

from services.tools.catalogue import DEFAULT_CHANNELS
from tests.support import SDK_JS, built_sdk_js, example_page, free_port, start_deployment

SECTION = "## TypeScript device SDK in a browser (report() on the main thread)"
BROWSER = SDK_JS / "scripts" / "browser.mjs"


def _run(node: str, devices: int, var: Path) -> dict[str, Any]:
    """The deployment, the page and the measurement (browser.mjs ``bench``)."""
    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    cors = {"ESA_ANALYZER_CORS_ORIGINS": origin, "ESA_SHUFFLER_CORS_ORIGINS": origin}
    deployment = start_deployment(var, DEFAULT_CHANNELS, env=cors, own_tokens=True)
    try:
        with example_page(var / "site", deployment.trust_file, port) as page:
            config = deployment.analyzer.url + "/v1/config"
            request = {
                "mode": "bench",
                "page": page,
                "config": config,
                "devices": devices,
            }
            done = subprocess.run(
                [node, str(BROWSER)],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                check=True,
                timeout=1800,
            )
    finally:
        deployment.stop()
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _ms(stats: dict[str, float]) -> str:
    return f"{stats['p50']:.2f} / {stats['p99']:.2f} / {stats['max']:.2f}"


def measure(devices: int) -> list[str]:
    """Every number, as the lines of the docs section."""
    node = built_sdk_js()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        found = _run(node, devices, Path(directory))
    reports, thread = found["reports"], found["main_thread"]
    bundle = (SDK_JS / "dist" / "esa-device-sdk.browser.js").read_bytes()
    long, gaps = found["long_tasks_ms"], found["event_loop_gaps_ms"]
    busy = thread["task_ms"] / found["elapsed_ms"]
    return [
        "Command: `.venv/bin/python benchmarks/sdk_js_browser.py --write`.",
        f"Machine: {machine(pinned=False)};",
        f"headless Chromium {found['version']} (Debian's, driven by playwright-core); load",
        f"average {load:.1f} at the start (a shared machine: other work ran meanwhile, and a",
        "task's time includes the time the OS gave it, so these are upper bounds).",
        "",
        f"{devices} devices on the example page, each its own IndexedDB database and created",
        "before the measurement, each making the page's three reports (`homepage` k-RAPPOR",
        "k = 64, `homepage-fragments` report fragments k = 64, `abroad` longitudinal), called",
        f"back to back, one device after the other: {reports} report calls in "
        f"{found['elapsed_ms'] / 1000:.1f} s. The page loads the browser bundle",
        f"(`sdk-js/dist/esa-device-sdk.browser.js`): {len(bundle) / 1024:.1f} KiB, "
        f"{len(gzip.compress(bundle, compresslevel=9)) / 1024:.1f} KiB gzipped (gzip -9).",
        "",
        "| per report call | median / 99th percentile / largest (ms) |",
        "|---|---|",
        "| synchronous part of the call: the page is held (`performance.now()`, coarsened to "
        f"0.1 ms) | {_ms(found['sync_ms'])} |",
        f"| call → its promise settles: queued (the page runs meanwhile) | "
        f"{_ms(found['settled_ms'])} |",
        f"| the page's event loop waited (a `setTimeout(0)` chain meanwhile, >= 4 ms) | "
        f"{_ms(gaps)} |",
        "",
        f"Main-thread tasks over the {reports} calls until the last settled (DevTools",
        f"`Performance.getMetrics`, TaskDuration): {thread['task_ms']:,.0f} ms, "
        f"**{thread['task_ms'] / reports:.2f} ms per report**",
        "(encoding, the state's snapshot, the IndexedDB transactions, the WebCrypto calls);",
        f"the main thread was busy {busy:.0%} of the time while reports came back to back.",
        "Tasks over 50 ms (PerformanceObserver `longtask`): "
        + (f"{long['count']}, the longest {long['max']:.0f} ms." if long["count"] else "none."),
        "The work is split into many tasks, but back to back they queue, which is what the",
        "event loop's wait above shows (the load average counts too). `report()` itself returns at",
        "once; a page reporting a few values an hour spends a few milliseconds of its main",
        "thread on each.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_write(parser)
    parser.add_argument("--devices", type=int, default=300, help="devices on the page")
    args = parser.parse_args(argv)
    lines = measure(args.devices)
    print("\n".join(lines))
    write_section(SECTION, "\n".join(lines), args.write)


if __name__ == "__main__":
    run_main(main)
