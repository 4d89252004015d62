"""How ``make test`` splits the suite between pytest-xdist workers (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import work_unit


def test_a_module_runs_whole_in_one_worker_and_tests_deploy_shares_one() -> None:
    """Every deploy test shares one compose project, so the folder is one unit; elsewhere a
    module is (its fixtures start once, and its tests run in order)."""
    first = work_unit("tests/deploy/test_compose_up.py::test_down_and_up_keep_keys_and_data")
    second = work_unit("tests/deploy/test_monitoring.py::test_prometheus_scrapes[a-b]")
    assert first == second == "tests/deploy"
    assert work_unit("tests/e2e/test_pipeline.py::test_pipeline_end_to_end[sqlite]") == (
        "tests/e2e/test_pipeline.py"
    )
    assert work_unit("tests/test_readme.py::test_x") == "tests/test_readme.py"
