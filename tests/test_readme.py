"""Issue 20: the README's runnable code blocks run as written, so a README that lies fails CI.

A block is runnable when the line before its opening fence is an HTML comment starting with
``<!-- runnable``. ``console`` blocks are ``$ esa ...`` command lines, each followed by what it
prints: every printed line shown must appear in the real output (whitespace-insensitive, ``...``
stands for anything, a trailing ``  # comment`` is the README's and not printed). ``bash``
blocks are ``esa`` command lines that must succeed. ``python`` blocks run, as the README tells
the user, in a folder where ``esa up`` is running (a fresh deployment; its port is the only
thing changed). Compose blocks are checked by tests/services/test_compose.py, not here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.cli.launcher import ANALYZER_PORT, free_base_port

from .support import wait_until

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- runnable"
LANGUAGES = ("bash", "console", "python")


@dataclass(frozen=True)
class Block:
    """A runnable fenced block: its language, text and the README line it starts on."""

    language: str
    code: str
    line: int

    @property
    def id(self) -> str:
        return f"README.md:{self.line}:{self.language}"


def runnable_blocks(text: str) -> list[Block]:
    """Every fenced block whose opening fence follows a ``<!-- runnable ...-->`` line."""
    lines = text.splitlines()
    blocks = []
    for number, line in enumerate(lines[:-1]):
        if not line.strip().startswith(MARKER):
            continue
        fence = lines[number + 1].strip()
        assert fence.startswith("```"), f"README.md:{number + 1}: marker not before a fence"
        language = fence[3:].strip()
        assert language in LANGUAGES, f"README.md:{number + 2}: cannot run {language!r} blocks"
        end = next(i for i in range(number + 2, len(lines)) if lines[i].strip() == "```")
        blocks.append(Block(language, "\n".join(lines[number + 2 : end]) + "\n", number + 3))
    return blocks


BLOCKS = runnable_blocks(README.read_text())


def test_the_readme_marks_its_examples_runnable() -> None:
    """The SDK example and the accounting commands are marked (a marker lost in an edit must
    not silently turn this file into a test of nothing)."""
    languages = [b.language for b in BLOCKS]
    assert languages.count("python") >= 1 and languages.count("console") >= 1, BLOCKS
    assert any("encoder_client" in b.code for b in BLOCKS if b.language == "python")


def _esa(arguments: list[str]) -> list[str]:
    """The ``esa`` the README means: the console script next to this interpreter."""
    assert arguments[0] == "esa", f"only esa commands run here: {shlex.join(arguments)}"
    script = Path(sys.executable).with_name("esa")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]
    return command + arguments[1:]


def _commands(block: Block) -> list[tuple[list[str], list[str]]]:
    """(argv, the printed lines shown after it) for every command of a console/bash block."""
    out: list[tuple[list[str], list[str]]] = []
    for line in block.code.splitlines():
        if block.language == "bash" or line.startswith("$ "):
            argv = shlex.split(line.removeprefix("$ "), comments=True)
            if argv:
                out.append((argv, []))
        elif line.strip():
            assert out, f"{block.id}: output before any command: {line!r}"
            out[-1][1].append(re.sub(r"\s{2,}#.*$", "", line))
    return out


def _pattern(shown: str) -> re.Pattern[str]:
    """A printed line as shown: words in order, any whitespace between, ``...`` for anything."""
    parts = [r"\s+".join(map(re.escape, p.split())) for p in shown.split("...")]
    return re.compile(r"(?s)" + r".*?".join(parts))


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.system
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language != "python"], ids=lambda b: b.id)
def test_commands_print_what_the_readme_shows(block: Block) -> None:
    for argv, shown in _commands(block):
        done = subprocess.run(_esa(argv), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}{done.stderr}"
        printed = _flat(done.stdout)
        for line in shown:
            assert _pattern(_flat(line)).search(printed), (
                f"{block.id}: `{shlex.join(argv)}` does not print {line!r}; it printed:\n"
                f"{done.stdout}"
            )


@pytest.fixture(scope="module")
def esa_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """``esa up`` in a fresh folder, as the README tells the user: (the folder, its port)."""
    folder = tmp_path_factory.mktemp("readme")
    base = free_base_port(4)
    up = subprocess.Popen(
        [*_esa(["esa", "up"]), "--base-port", str(base)],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: up.poll() is not None or _ready(base), timeout=120, interval=0.5)
        assert up.poll() is None, "esa up exited"
        yield folder, base
    finally:
        up.terminate()  # SIGTERM: esa up stops every service it started
        up.wait(60)


def _ready(base: int) -> bool:
    """Every service ready, and the analyzer serving its config: it answers 503
    shufflers_unavailable until it has every shuffler's own signed descriptor, which
    ``/readyz`` does not wait for (``esa up`` waits for both before printing its URLs)."""
    try:
        urls = [f"http://127.0.0.1:{base + i}/readyz" for i in range(4)]
        urls.append(f"http://127.0.0.1:{base}/v1/config")
        return all(httpx.get(url, timeout=2).status_code == 200 for url in urls)
    except httpx.HTTPError:
        return False


@pytest.mark.system
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python"], ids=lambda b: b.id)
def test_python_examples_run_as_written_after_esa_up(
    block: Block, esa_up: tuple[Path, int]
) -> None:
    folder, base = esa_up
    assert (folder / "var" / "trust.json").exists()  # what the example reads
    default = f"127.0.0.1:{ANALYZER_PORT}"
    code = block.code.replace(default, f"127.0.0.1:{base}")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{block.id}:\n{done.stdout}{done.stderr}"
    assert "not reported" not in done.stdout, done.stdout  # no EsaError was caught
    if "outbox_size()" in code:  # the SDK example: its report was delivered (a 202)
        assert re.search(r"^device [0-9a-f]{32} outbox 0$", done.stdout, re.M), done.stdout
