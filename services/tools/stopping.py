"""How a command that starts processes stops: Ctrl-C (SIGINT), SIGTERM (``timeout``,
systemd, ``docker stop``, a cancelled CI job) and SIGHUP (its terminal closed) all unwind the
main thread as :class:`Stopped`, so every ``finally`` on the way stops what it started and
removes the folders it made; :func:`stops_cleanly` then logs one line saying why and exits with
128 + the signal's number (130, 143, 129), without a traceback (docs/operations.md,
"Stopping").

A signal that arrives while a process is being started (:func:`held`) waits until that process
is recorded, so no start is ever lost to the unwinding; one that arrives while an event loop
runs (:func:`run`) cancels its main task, as asyncio's own Ctrl-C handling does, and is raised
once the loop has wound down (raised in the middle of the loop, it would leave tasks half-done
and logged). A second signal while stopping is only acknowledged: the stopping itself is
bounded (``services.cli.launcher.stop``).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Any, NoReturn, TypeVar

import click

#: The signals that stop a command, and what a person reads for each.
SIGNALS: dict[int, str] = {
    signal.SIGINT: "Ctrl-C (SIGINT)",
    signal.SIGTERM: "SIGTERM",
    signal.SIGHUP: "SIGHUP (its terminal closed)",
}


def describe(signum: int) -> str:
    """What a person reads for a signal's number."""
    return SIGNALS.get(signum) or f"signal {signum}"


class Stopped(KeyboardInterrupt):
    """A stopping signal arrived: raised in the main thread by :func:`raising`'s handler.

    A :class:`KeyboardInterrupt`, so that code which already unwinds on Ctrl-C (``finally``,
    ``except BaseException`` that cleans up and re-raises, asyncio's runner) does the same for
    SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


T = TypeVar("T")


class _State:
    """The main thread's critical sections (:func:`held`), a signal deferred meanwhile, and
    the main task of the event loop :func:`run` runs there."""

    depth = 0
    pending: int | None = None
    stopping = False
    task: asyncio.Task[Any] | None = None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _stop(signum: int) -> NoReturn:
    """Raise :class:`Stopped`, from now on only acknowledging further signals."""
    _State.stopping, _State.pending = True, None
    _acknowledge_further()
    raise Stopped(signum)


def _acknowledge_further() -> None:
    for number in SIGNALS:
        signal.signal(number, _acknowledge)


def _handler(signum: int, _: FrameType | None) -> None:
    task = _State.task
    if _State.depth:
        _State.pending = signum
    elif task is not None and not task.done():
        _State.pending = signum
        _acknowledge_further()
        task.cancel()
        task.get_loop().call_soon_threadsafe(_nothing)  # wake the loop to see it
    else:
        _stop(signum)


def _nothing() -> None:
    """A callback that only wakes an event loop up."""


def _acknowledge(signum: int, _: FrameType | None) -> None:
    with suppress(OSError):  # a closed terminal
        say(f"{describe(signum)} again: still stopping what was started")


def say(message: str) -> None:
    """One line on stderr with the time of day (as ``esa up`` logs its supervision)."""
    click.echo(f"{time.strftime('%H:%M:%S')} {message}", err=True)


@contextmanager
def held() -> Iterator[None]:
    """A critical section of the main thread (starting a process and recording it): a
    stopping signal that arrives inside is raised at its end. Elsewhere than in the main
    thread (where no handler runs) it does nothing."""
    if not _in_main_thread():
        yield
        return
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if not _State.depth and _State.pending is not None and not _State.stopping:
            _stop(_State.pending)


@contextmanager
def raising() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Stopped` in the main thread meanwhile (the
    handlers before are put back at a normal end; after a stop the command is ending). In
    another thread, or when the handlers are already in place, it changes nothing."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) in (_handler, _acknowledge):
        yield
        return
    previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {
        number: signal.getsignal(number) for number in SIGNALS
    }
    _State.depth, _State.pending, _State.stopping = 0, None, False
    for number in SIGNALS:
        signal.signal(number, _handler)
    try:
        yield
    finally:
        if not _State.stopping:  # a stopped command is ending: further signals only noted
            for number, handler in previous.items():
                signal.signal(number, handler)


@contextmanager
def stops_cleanly(command: str) -> Iterator[None]:
    """Run ``command``'s body so that a stopping signal ends it as a person expects: every
    ``finally`` inside runs (stopping its processes, removing its folders), then one line
    says what stopped it, and the exit status is 128 + the signal (130 for Ctrl-C, 143 for
    SIGTERM), with no traceback."""
    try:
        with raising():
            yield
    except KeyboardInterrupt as error:  # Stopped, or Ctrl-C before the handlers were in place
        signum = error.signum if isinstance(error, Stopped) else signal.SIGINT.value
        with suppress(OSError):
            say(f"{command} stopped by {describe(signum)}: every process it "
                "started has ended")  # fmt: skip
        raise SystemExit(128 + signum) from None


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, which a stopping signal ends as a whole while :func:`raising`'s
    handlers are in place: it cancels the main task (whose ``finally`` blocks run), and
    :class:`Stopped` is raised once the loop has wound down. A signal while the loop starts
    or winds down is raised after it."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not _handler:
        return asyncio.run(main)
    with held():
        try:
            return asyncio.run(_cancellable(main))
        except asyncio.CancelledError:
            if _State.pending is None:
                raise
            _stop(_State.pending)
    raise AssertionError("unreachable: held() suppresses no exception")


async def _cancellable(main: Coroutine[Any, Any, T]) -> T:
    """``main`` as the task a stopping signal cancels, out of :func:`run`'s held section."""
    _State.task, _State.depth = asyncio.current_task(), _State.depth - 1
    try:
        return await main
    finally:
        _State.task, _State.depth = None, _State.depth + 1
