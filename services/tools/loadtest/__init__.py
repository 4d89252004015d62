"""``esa loadtest``: drive a deployment with a simulated population and verify what it did.

:mod:`.population` (who holds which value), :mod:`.prepare` (devices, reports and contributions
sealed ahead of the run), :mod:`.live` (the run, with a live view), :mod:`.refusals` (a run
whose epoch is already closed), :mod:`.verify` (conservation and estimates against the truth)
and :mod:`.report` (JSON and HTML). The run phase is loadgen's asyncio driver, not Locust:
docs/loadtest.md, "Why not Locust", and the measurement in docs/benchmarks.md.
"""
