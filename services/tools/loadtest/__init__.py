"""``esa loadtest``: drive a deployment with a simulated population and verify what it did.

* :mod:`.population` — who holds which value, per channel (zipf, uniform, shipped datasets, CSV);
* :mod:`.prepare` — devices enrolled at every shuffler, reports encoded and sealed in worker
  processes, contributions for the run's epochs written to files ahead of the run
  (services/tools/loadgen/);
* :mod:`.live` — the run: replay at a rate, a ramp or as fast as answered, with a rich live view;
* :mod:`.refusals` — a run whose epoch the shufflers closed (an earlier run's verification):
  stopped with a clear error before the load or before verification, never verified;
* :mod:`.verify` — close the epochs, wait for every batch, conservation and estimates vs truth;
* :mod:`.report` — JSON and HTML report with plots.

The run phase is loadgen's asyncio driver, not Locust: docs/benchmarks.md ("Load test:
generation, and Locust vs the asyncio driver") has the measurement behind that choice (2.8-4.9x
less client CPU per request).
"""
