"""The audit's public-surface probes against a real shuffler at a production-like enrolment
limit: the canaries' own enrolments drain the per-address bucket, so a probe may be answered
429; that answers the prober's rate, not the group, and must not count as the surface moving
(found running docs/audit.md's compose staging procedure at compose's 600 a minute)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from services.tools.audit.probes import snapshot, surface_check
from tests.support import SMALL_CHANNEL, ServiceProcess, shuffler_process

pytestmark = pytest.mark.system  # starts real processes


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A shuffler allowing 60 enrolments a minute per address (a bucket of 10, 1 a second)."""
    tmp = tmp_path_factory.mktemp("probes")
    process = shuffler_process(tmp, "shuffler-1", [SMALL_CHANNEL], enroll_per_minute="60")
    yield process.start()
    process.stop()


def test_a_drained_enrolment_bucket_does_not_move_the_surface(limited: ServiceProcess) -> None:
    with httpx.Client(timeout=10) as client:
        fresh = snapshot(client, limited.url)
        answers = [client.post(limited.url + "/v1/enroll").status_code for _ in range(12)]
        assert 429 in answers, answers  # the bucket is empty: the next enrol would be refused
        drained = snapshot(client, limited.url)
    assert drained["enroll"].startswith("200"), drained["enroll"]
    findings = surface_check([(0, fresh), (12, drained)])
    assert all(f.passed for f in findings), [f.detail for f in findings if not f.passed]
