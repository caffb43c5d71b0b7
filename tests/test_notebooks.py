"""Every notebook runs top to bottom in a real Jupyter kernel (nbclient), failing on any cell's error, and draws
its pictures; the committed notebooks carry no outputs (so they cannot rot, and diffs stay readable)."""

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what each notebook must show: text its cells print and how many pictures it draws at least
EXPECTED = {
    "inspect_plan.ipynb": (("fxpipe plan for ResNet", "profile: analytic", "chunks  4 gpipe", "simulated iteration"), 6),
    "compare_partitioners.ipynb": (("geometric mean", "blind"), 1),
    "hugging_face.ipynb": (("fxpipe plan for GPT2LMHeadModel", "largest relative gradient difference"), 3),
}


def _execute(path: Path, monkeypatch) -> tuple[str, int, float]:
    # the kernel is a subprocess: it imports this checkout's fxpipe, not whichever one is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()   # raises on a cell's error
    seconds = time.perf_counter() - started
    text, pictures = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            data = out.get("data", {})
            text.append(data.get("text/plain", ""))
            pictures += "image/png" in data
    return "".join(text), pictures, seconds


@pytest.mark.slow   # 30-40 s each with the machine's load average at 10 (a kernel, a compile or a solve)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_a_kernel(path, monkeypatch):
    text, pictures, seconds = _execute(path, monkeypatch)
    words, least = EXPECTED[path.name]
    for word in words:
        assert word in text, f"{path.name} did not print {word!r}"
    assert pictures >= least, f"{path.name} drew {pictures} pictures, expected at least {least}"
    assert seconds < 120, f"{path.name} took {seconds:.0f} s; keep a notebook under a minute"


def test_a_cell_error_fails_the_run(tmp_path, monkeypatch):
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise RuntimeError('boom')")])
    path = tmp_path / "bad.ipynb"
    nbformat.write(bad, path)
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        _execute(path, monkeypatch)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code"
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, (f"{path.name}: cells {dirty} carry outputs; strip them before committing "
                       f"(jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)})")


def test_every_notebook_is_checked():
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED)
