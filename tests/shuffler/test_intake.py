"""Intake: tokens, rate limits with bounded state, and what a contribution must satisfy."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.envelope import OLD_MAGIC, Contribution, new_nonce, outer_info, seal
from common.wire import ChannelPolicy
from shuffler.errors import (
    BadTokenError,
    ClientRateLimitedError,
    EpochNotOpenError,
    MalformedContributionError,
    RevokedTokenError,
    TooFewFragmentsError,
    TooManyFragmentsError,
    UnknownChannelError,
    UnsupportedVersionError,
)
from shuffler.intake import RateLimiter, TokenAuthority, open_epochs

from .factory import EPOCH_SECONDS, POLICY, make_service, pending


def test_tokens_verify_without_lookup_and_refuse_forgeries_and_revocations() -> None:
    authority = TokenAuthority(b"secret")
    token = authority.issue()
    client_id = authority.verify(token)
    assert token.startswith(client_id + ".") and len(client_id) == 32
    for forged in ("", "no-dot", client_id + ".", token[:-2] + "xx", "x." + token.split(".")[1]):
        with pytest.raises(BadTokenError):
            authority.verify(forged)
    with pytest.raises(BadTokenError):
        TokenAuthority(b"other").verify(token)
    authority.revoked.add(client_id)
    with pytest.raises(RevokedTokenError):
        authority.verify(token)


def test_rate_limiter_grants_the_burst_then_says_when_to_retry() -> None:
    limiter = RateLimiter(rate=0.5, burst=3)
    assert [limiter.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a", 0.0) == pytest.approx(2.0)
    assert limiter.take("b", 0.0) == 0.0  # buckets are per key
    assert limiter.take("a", 2.0) == 0.0
    with pytest.raises(ClientRateLimitedError) as raised:
        limiter.check("a", 2.0, "slow down")
    assert raised.value.retry_after == 2 and raised.value.code == "rate_limited"


def test_rate_limiter_state_is_bounded_and_expires() -> None:
    limiter = RateLimiter(rate=1.0, burst=2, max_keys=100)
    for i in range(1_000):
        limiter.take(f"client-{i}", 0.0)
    assert len(limiter) == 100  # least recently seen forgotten first
    limiter.take("late", 1.9)
    assert len(limiter) == 100
    limiter.take("later", 2.0)  # every bucket seen at t=0 has refilled by now: forgotten
    assert len(limiter) == 2


def test_open_epochs_include_the_previous_one_during_the_grace_period() -> None:
    policy = ChannelPolicy(id="c", epoch_seconds=100)
    assert open_epochs(policy, 1_000.5, grace=2.0) == {10, 9}
    assert open_epochs(policy, 1_002.0, grace=2.0) == {10}
    assert open_epochs(policy, 1_050.0, grace=0.0) == {10}


def test_open_epochs_include_the_next_one_within_the_clock_skew() -> None:
    """A device whose clock is ahead by up to ``skew`` reports for the next epoch before the
    shuffler's clock reaches it: taken; an epoch further ahead is not."""
    policy = ChannelPolicy(id="c", epoch_seconds=3600)
    end = 11 * 3600  # epoch 10 ends
    assert open_epochs(policy, end - 300.0, grace=2.0, skew=300.0) == {10, 11}
    assert open_epochs(policy, end - 300.5, grace=2.0, skew=300.0) == {10}
    assert open_epochs(policy, end - 1.0, grace=2.0, skew=0.0) == {10}
    assert 12 not in open_epochs(policy, end - 1.0, grace=2.0, skew=3600.0)


def test_validation_refuses_each_problem_with_its_code(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path)
    token, epoch = service.tokens.issue(), clock.epoch
    assert pending(service, token, epoch).contribution.epoch == epoch
    cases: list[tuple[type[Exception], dict[str, object]]] = [
        (EpochNotOpenError, {"epoch": epoch - 5}),
        (EpochNotOpenError, {"epoch": epoch + 2}),
        (EpochNotOpenError, {"epoch": epoch + 10**6}),
        (TooManyFragmentsError, {"fragments": 9}),
        (UnknownChannelError, {"channel": "unknown"}),
    ]
    for error, kwargs in cases:
        with pytest.raises(error):
            pending(service, token, **{"epoch": epoch, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(MalformedContributionError):
        service.validate(service.admit(token), b"not a ciphertext" * 8)
    with pytest.raises(BadTokenError):
        pending(service, token.split(".")[0] + ".forged", epoch)
    service.intake.close("homepage", epoch)
    with pytest.raises(EpochNotOpenError, match=rf"^epoch {epoch} is closed \(by an admin\)$"):
        pending(service, token, epoch)
    with pytest.raises(EpochNotOpenError, match=f"epoch {epoch - 5} is not open"):
        pending(service, token, epoch - 5)  # an old epoch: nothing said of the admin's close


def test_a_device_a_few_minutes_ahead_lands_and_one_further_ahead_is_refused(
    database_url: str, tmp_path: Path
) -> None:
    """200 s before the next epoch starts, a device whose clock is ahead reports for it:
    taken (the default skew is 300 s); the epoch after it is refused by name."""
    service, clock = make_service(database_url, tmp_path)
    token, epoch = service.tokens.issue(), clock.epoch
    clock.now = (epoch + 1) * EPOCH_SECONDS - 200.0
    assert pending(service, token, epoch + 1).contribution.epoch == epoch + 1
    with pytest.raises(EpochNotOpenError, match=rf"epoch {epoch + 2} is not open \(open: "):
        pending(service, token, epoch + 2)


def test_a_wire_version_1_contribution_and_too_few_fragments_are_refused(
    database_url: str, tmp_path: Path
) -> None:
    """Wire version 2 binds fragments to channel, epoch and crowd; a version 1 contribution
    (magic ``ESA1``) opens but is refused by name, before anything else of it is read. A
    channel's ``min_fragments`` refuses a contribution with fewer (here none)."""
    policy = POLICY.model_copy(update={"min_fragments": 1})
    service, clock = make_service(database_url, tmp_path, policy=policy)
    token = service.tokens.issue()
    body = Contribution(
        channel_id="homepage",
        crowd_id="",
        epoch=clock.epoch,
        nonce=new_nonce(),
        fragments=(bytes(72),),
    ).encode()
    old = seal(OLD_MAGIC + body[4:], service.ring.public(), outer_info("shuffler-1"))
    with pytest.raises(UnsupportedVersionError, match="wire version 1") as raised:
        service.validate(service.admit(token), old)
    assert raised.value.code == "unsupported_version"
    unknown = seal(OLD_MAGIC + b"\x00" * 8, service.ring.public(), outer_info("shuffler-1"))
    with pytest.raises(UnsupportedVersionError):  # the magic alone decides
        service.validate(service.admit(token), unknown)
    with pytest.raises(TooFewFragmentsError, match="0 fragments < min_fragments=1"):
        pending(service, token, clock.epoch, fragments=0)
    assert pending(service, token, clock.epoch, fragments=1).contribution.epoch == clock.epoch


def test_enrolment_is_rate_limited_per_address(database_url: str, tmp_path: Path) -> None:
    service, _ = make_service(database_url, tmp_path, enroll_per_minute=6.0)
    tokens = [service.enroll("10.0.0.1")]
    with pytest.raises(ClientRateLimitedError) as raised:
        service.enroll("10.0.0.1")
    assert raised.value.retry_after is not None and raised.value.retry_after >= 1
    tokens.append(service.enroll("10.0.0.2"))
    assert all(service.tokens.verify(t) for t in tokens)


def test_per_client_state_stays_bounded_over_many_distinct_clients(
    database_url: str, tmp_path: Path
) -> None:
    """Issue 11: 20,000 distinct clients (and addresses) each sending now and then; the
    shuffler's per-client state is only the buckets that have not refilled yet."""
    service, _ = make_service(database_url, tmp_path, rate_per_second=5.0, rate_burst=20)
    intake = service.intake
    window = 20 / 5.0  # a bucket is forgotten once full again: burst / rate seconds
    step = 0.001
    sizes = []
    for i in range(20_000):
        intake.contributions.check(service.tokens.issue().partition(".")[0], i * step, "slow")
        intake.enrolments.take(f"10.0.{i // 256}.{i % 256}", i * step)
        sizes.append(len(intake.contributions))
    enrol_window = intake.enrolments.burst / intake.enrolments.rate
    assert max(sizes) <= window / step + 1
    assert len(intake.enrolments) <= enrol_window / step + 1
    intake.contributions.check("late", 20_000 * step + window, "slow")
    assert len(intake.contributions) == 1


def test_with_epochs_shorter_than_the_skew_only_the_next_epoch_opens_early() -> None:
    """docs/operations.md, "Clock skew": the skew opens the next epoch early, never a later one,
    so with 60 s epochs and a 300 s skew a device 250 s ahead (its epoch 4 later) is refused."""
    policy = ChannelPolicy(id="c", epoch_seconds=60)
    now = 600.0 + 30.0  # epoch 10, half-way
    ahead = int((now + 250.0) // 60)
    assert ahead == 14 and ahead not in open_epochs(policy, now, grace=2.0, skew=300.0)
    assert open_epochs(policy, now, grace=2.0, skew=300.0) == {10, 11}
