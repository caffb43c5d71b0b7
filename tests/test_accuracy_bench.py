"""The accuracy benchmark's smoke run (``benchmarks/accuracy.py --quick``): every variant trains, the exact
pipelines match the unpartitioned model, and the bytes the transport counted are each codec's share."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import accuracy  # noqa: E402


def test_quick_run_rows_accuracy_and_bytes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert accuracy.main(["--quick", "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())
    by = {r["method"]: r for r in rows}
    assert list(by) == [v.name for v in accuracy.VARIANTS]
    for name in by:
        assert f"| {name} | mlp |" in out
    # exact pipelines: the same gradients up to summation order, so the same test accuracy
    assert by["gpipe"]["acc_mean"] == pytest.approx(by["sync"]["acc_mean"], abs=0.6)
    assert by["1f1b"]["acc_mean"] == pytest.approx(by["sync"]["acc_mean"], abs=0.6)
    assert by["sync"]["share"] is None and by["gpipe"]["share"] == by["1f1b"]["share"] == 1.0
    assert by["gpipe+fp16"]["share"] == by["gpipe+bf16"]["share"] == 0.5
    assert 0.25 <= by["gpipe+int8"]["share"] <= 0.30
    assert by["gpipe+topk:0.01"]["share"] <= 0.05
    assert by["gpipe+int8/topk:0.01"]["share"] == pytest.approx(
        (by["gpipe+int8"]["share"] + by["gpipe+topk:0.01"]["share"]) / 2)
