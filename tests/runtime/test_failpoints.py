"""Failpoints (runtime/failpoints.py): named crash points of the commit paths, armed only by
``ESA_FAILPOINTS``, with a real SIGKILL when armed (docs/reliability.md, fault 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import failpoints

ROOT = Path(__file__).resolve().parents[2]


def test_unarmed_points_do_nothing_and_unknown_names_are_refused() -> None:
    assert not failpoints.ARMED  # the test run arms none
    for name in failpoints.POINTS:
        failpoints.failpoint(name)  # returns: nothing armed
    assert failpoints._armed(" shuffler.close.after_epoch_closed, ") == {
        "shuffler.close.after_epoch_closed"
    }
    with pytest.raises(ValueError, match=r"unknown failpoints \[.shuffler\.close\.typo.\]"):
        failpoints._armed("shuffler.close.after_epoch_closed,shuffler.close.typo")


def test_every_point_is_placed_once_in_the_servers() -> None:
    sources = [
        path.read_text()
        for package in ("shuffler", "analyzer")
        for path in (ROOT / package).glob("*.py")
    ]
    for name in failpoints.POINTS:
        assert sum(text.count(f'failpoint("{name}")') for text in sources) == 1, name


@pytest.mark.system  # starts a process
def test_an_armed_point_kills_the_process_with_sigkill() -> None:
    point = "analyzer.fold.after_commit"
    code = (
        "from runtime.failpoints import failpoint\n"
        "failpoint('analyzer.fold.after_opening')\n"  # not armed: goes on
        f"failpoint({point!r})\n"
        "print('never reached')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, failpoints.ENV: point},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL
    assert done.stderr == f"failpoint {point}: SIGKILL\n" and done.stdout == ""


def test_production_refuses_an_armed_failpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    failpoints.refuse_in_production("production")  # nothing armed: starts
    monkeypatch.setattr(failpoints, "ARMED", frozenset({"analyzer.fold.after_commit"}))
    failpoints.refuse_in_production("development")  # tests arm them
    with pytest.raises(ValueError, match="failpoints are for tests, never production"):
        failpoints.refuse_in_production("production")


@pytest.mark.system  # starts a process
@pytest.mark.parametrize("package", ["shuffler", "analyzer"])
def test_a_production_service_with_an_armed_failpoint_refuses_its_settings(package: str) -> None:
    prefix = f"ESA_{package.upper()}_"
    code = (
        f"from {package}.settings import {package.capitalize()}Settings\n"
        f"{package.capitalize()}Settings()\n"
    )
    env = {
        **os.environ,
        failpoints.ENV: "analyzer.fold.after_commit",
        prefix + "ENVIRONMENT": "production",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "failpoints are for tests, never production" in done.stderr
