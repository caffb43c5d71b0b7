"""benchmarks/gpu_check.py's small mode (tiny models on CPU workers): every row of the GPU table is there,
the correctness rows pass (pipe.step's loss, outputs and gradients against the model), the measured rows
carry their figures, and the table and its JSON are written. So the script a GPU run depends on cannot rot
between GPUs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_small_mode_prints_every_row_and_the_correctness_rows_pass(tmp_path, capsys):
    rc = gpu_check.main(["--small", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    table = (tmp_path / "gpu_check.txt").read_text()

    expected = [name for name, _, _ in gpu_check.plan_rows(gpu_check.Context(small=True)) if name != "tests"]
    expected += [f"tests:{Path(f).stem.removeprefix('test_')}" for f in gpu_check.cuda_test_files()]
    assert gpu_check.cuda_test_files(), "the CUDA test files are no longer found by cuda_test_files()"
    assert sorted(rows) == sorted(expected)
    for name in expected:
        assert name in table and name in printed
    failed = {n: r["detail"] for n, r in rows.items() if r["status"] != "PASS" and r["status"] != "INFO"}
    assert not failed and rc == 0
    assert doc["header"]["mode"].startswith("small") and doc["header"]["torch"]

    for name, row in rows.items():
        if name.startswith(("exec:", "bf16", "compiled")):   # correctness: measured errors within tolerance
            assert row["status"] == "PASS"
            for key, tol in row["figures"]["tolerance"].items():
                assert row["figures"][key] <= tol, (name, key)
    assert rows["exec:4st:zb-v"]["figures"]["workers"] == 2
    speed = rows["speed:resnet18"]["figures"]
    assert speed["naive_samples_s"] > 0 and speed["pipeline_samples_s"] > 0
    assert speed["ratio"] == pytest.approx(speed["pipeline_samples_s"] / speed["naive_samples_s"])
    for model in ("resnet18", "gpt2", "llama"):
        fig = rows[f"fidelity:{model}"]["figures"]
        assert len(fig["stages"]) == 2 and len(fig["memory"]) == 2
        assert all(s["meas_ms"] > 0 and s["pred_ms"] > 0 for s in fig["stages"])
        assert all(m["meas_MiB"] > 0 for m in fig["memory"]) and fig["compile_s"] > 0
    assert rows["compiled"]["figures"]["stages"] == 2
    over, bf16 = rows["overhead:gpt"]["figures"], rows["bf16"]["figures"]
    assert over["ratio"] == pytest.approx(over["model_step_s"] / over["pipe_step_s"], rel=0.5) and over["ratio"] > 0
    assert bf16["gain_ratio"] > 0 and bf16["model_bf16_step_s"] > 0


def test_a_failing_row_prints_fail_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    def broken(ctx, stages, schedule):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(gpu_check, "row_executor", broken)
    rc = gpu_check.main(["--small", "--only", "exec:2st:gpipe", "exec:2st:1f1b", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["name"], r["status"], r["detail"]) for r in rows] == [
        ("exec:2st:gpipe", "FAIL", "RuntimeError: boom"), ("exec:2st:1f1b", "FAIL", "RuntimeError: boom")]
    assert rc == 1 and "exec:2st:1f1b            FAIL" in capsys.readouterr().out


def test_rows_past_the_budget_are_skipped_and_listed(tmp_path):
    rc = gpu_check.main(["--small", "--budget-s", "0", "--only", "bf16", "compiled", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["name"], r["status"]) for r in rows] == [("bf16", "SKIPPED (budget)"),   # --only bf16: both bf16 rows
                                                        ("bf16-mixed", "SKIPPED (budget)"),
                                                        ("compiled", "SKIPPED (budget)")]
    assert rc == 0


def test_a_row_over_its_time_limit_is_stopped(monkeypatch):
    import time

    monkeypatch.setitem(gpu_check.ROW_LIMIT_S, "bf16", 0.2)
    monkeypatch.setattr(gpu_check, "row_bf16", lambda ctx: time.sleep(5))
    started = time.perf_counter()
    assert gpu_check.main(["--small", "--only", "bf16"]) == 1
    assert time.perf_counter() - started < 4
