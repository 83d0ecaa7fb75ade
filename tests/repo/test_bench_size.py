"""benchmarks/benchlib.py ``sized``: the CI size of a benchmark is a knob (``BENCH_SIZE=ci``), never a cut of
the user's default; a typo in it stops the benchmark instead of running the long size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from benchlib import BENCH_SIZE_ENV, sized


def test_the_users_size_unless_ci_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BENCH_SIZE_ENV, raising=False)
    assert sized(100, 30) == 100
    monkeypatch.setenv(BENCH_SIZE_ENV, "full")
    assert sized(100, 30) == 100
    monkeypatch.setenv(BENCH_SIZE_ENV, "ci")
    assert sized(100, 30) == 30


@pytest.mark.parametrize("value", ["CI", "small", ""])
def test_any_other_size_stops_the_benchmark(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(BENCH_SIZE_ENV, value)
    with pytest.raises(SystemExit, match="expected 'full' or 'ci'"):
        sized(100, 30)
