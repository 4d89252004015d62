"""How a stopping signal unwinds a command (``services.tools.stopping``), in this process with
real signals: SIGTERM becomes :class:`Stopped` and exit status 143 after every ``finally``
ran; a signal while a process is being started waits for the end of that section; one while
an event loop runs cancels its main task and is raised once the loop has wound down, with no
task left pending or logged; a second signal while stopping is only acknowledged. The real
commands: tests/services/test_stopping.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.tools import stopping


@pytest.fixture(autouse=True)
def _handlers() -> Iterator[None]:
    """The test process's own handlers, put back whatever the test left."""
    saved = {number: signal.getsignal(number) for number in stopping.SIGNALS}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)


def test_sigterm_runs_every_finally_then_exits_143_saying_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cleaned = []
    with pytest.raises(SystemExit) as ended, stopping.stops_cleanly("esa test"):
        try:
            _send(signal.SIGTERM)
            time.sleep(5)  # interrupted at once
        finally:
            cleaned.append("the processes it started")
            _send(signal.SIGTERM)  # again, while stopping: only acknowledged
            time.sleep(0.05)
    assert ended.value.code == 143 and cleaned == ["the processes it started"]
    err = capsys.readouterr().err
    assert "esa test stopped by SIGTERM: every process it started has ended" in err
    assert "SIGTERM again: still stopping" in err


def test_ctrl_c_exits_130() -> None:
    with pytest.raises(SystemExit) as ended, stopping.stops_cleanly("esa test"):
        _send(signal.SIGINT)
        time.sleep(5)
    assert ended.value.code == 130


def test_a_signal_while_a_process_starts_is_raised_once_it_is_recorded() -> None:
    recorded = []
    with stopping.raising(), pytest.raises(stopping.Stopped) as stopped:
        with stopping.held():
            _send(signal.SIGTERM)
            time.sleep(0.1)
            recorded.append("process")
        recorded.append("after")  # never: raised at the end of the held section
    assert stopped.value.signum == signal.SIGTERM and recorded == ["process"]


def test_a_signal_in_an_event_loop_cancels_its_task_and_is_raised_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = []

    async def helper() -> None:
        try:
            await asyncio.sleep(5)
        finally:
            seen.append("helper's finally")

    async def main() -> None:
        task = asyncio.create_task(helper())
        await asyncio.sleep(0)  # the helper started: its finally is due
        try:
            _send(signal.SIGTERM)
            await asyncio.gather(task, asyncio.sleep(5))
        finally:
            seen.append("main's finally")

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, "asyncio"), stopping.raising():
        with pytest.raises(stopping.Stopped) as stopped:
            stopping.run(main())
        gc.collect()  # an abandoned task would be logged now
    assert stopped.value.signum == signal.SIGTERM and time.monotonic() - start < 2
    assert sorted(seen) == ["helper's finally", "main's finally"]
    assert not caplog.records, caplog.text


def test_run_answers_as_asyncio_run_and_the_handlers_are_put_back() -> None:
    async def answer() -> int:
        return 42

    before = signal.getsignal(signal.SIGTERM)
    assert stopping.run(answer()) == 42
    with stopping.raising():
        assert stopping.run(answer()) == 42
    assert signal.getsignal(signal.SIGTERM) is before  # put back at a normal end
