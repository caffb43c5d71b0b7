"""Every notebook's code cells run top to bottom (so the notebooks cannot rot)."""

import contextlib
import io
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code"
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for source in code:
            exec(compile(source, str(path), "exec"), scope)
    assert "simulated iteration" in out.getvalue() and "geometric mean" in out.getvalue()


def test_there_is_a_notebook():
    assert NOTEBOOKS
