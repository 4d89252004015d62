"""``esa simulate`` end to end through the console script, at small sizes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from common.accounting import BinaryRR, plan_eps0
from services.tools.simulation import COLUMNS, balanced_fragment_eps

pytestmark = pytest.mark.system  # starts real processes

ESA = [sys.executable, "-m", "services.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ESA, *args], capture_output=True, text=True, timeout=300, check=False)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        return list(reader)


def test_image_run_writes_results_and_figure(tmp_path: Path) -> None:
    out = run(
        "simulate",
        "histogram",
        "--dataset",
        "camera",
        "--n",
        "400000",
        "--eps-c",
        "0.5,1",
        "--delta",
        "1e-8",
        "--tau",
        "1,4",
        "--out",
        str(tmp_path),
        "--seed",
        "3",
    )
    assert out.returncode == 0, out.stderr
    rows = _rows(tmp_path / "results.csv")
    assert len(rows) == 8
    figure = tmp_path / "camera_reconstructions.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in rows:
        assert float(row["rmse"]) == pytest.approx(float(row["rmse_predicted"]), rel=0.15)
        if row["bound"] == "paper":
            planned = plan_eps0(
                float(row["eps_c"]), 1e-8, 400_000, BinaryRR(), bound="cheu-lemma-ii6"
            )
            assert float(row["eps0"]) == pytest.approx(planned.eps0)
    for eps_c in ("0.5", "1.0"):
        by_bound = {(r["bound"], r["tau"]): float(r["rmse"]) for r in rows if r["eps_c"] == eps_c}
        assert by_bound[("tightest", "1")] < by_bound[("paper", "1")]


def test_words_run_draws_top_bars(tmp_path: Path) -> None:
    out = run(
        "simulate",
        "histogram",
        "--dataset",
        "words",
        "--n",
        "300000",
        "--eps-c",
        "1",
        "--delta",
        "1e-8",
        "--bound",
        "tightest",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "words_top.png").stat().st_size > 10_000
    assert _rows(tmp_path / "results.csv")[0]["bound"] == "tightest"


def test_longitudinal_run(tmp_path: Path) -> None:
    out = run(
        "simulate",
        "longitudinal",
        "--n",
        "50000",
        "--d",
        "16",
        "--k",
        "2",
        "--eps-c",
        "1",
        "--delta",
        "1e-8",
        "--out",
        str(tmp_path),
        "--repeats",
        "30",
    )
    assert out.returncode == 0, out.stderr
    rows = _rows(tmp_path / "results.csv")
    assert {r["bound"] for r in rows} == {"paper", "tightest"}
    for row in rows:
        assert float(row["rmse"]) == pytest.approx(float(row["rmse_predicted"]), rel=0.15)
    assert (tmp_path / "longitudinal_counts.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "zipf", "--eps-c", "a,b", "--delta", "1e-8"], "comma-separated numbers"),
        (["--dataset", "mnist", "--eps-c", "1", "--delta", "1e-8"], "mnist"),
        (["--dataset", "zipf", "--eps-c", "1", "--delta", "1e-8", "--tau", "1.5"], "whole numbers"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    out = run("simulate", "histogram", *args, "--out", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr


def test_balanced_fragment_eps_matches_variance() -> None:
    import math

    for eps_b, tau in ((2.94, 4), (8.55, 16), (5.0, 256)):
        eps_f = balanced_fragment_eps(eps_b, tau)
        fragment_term = math.exp(eps_f) / (tau * math.expm1(eps_f) ** 2)
        backstop_term = math.exp(eps_b) / math.expm1(eps_b) ** 2
        assert fragment_term == pytest.approx(backstop_term, rel=1e-9)
