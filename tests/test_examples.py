"""Every notebook in examples/ runs top to bottom (on CPU with the tiny preset here)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ipynb"))
# ablation.ipynb runs test_bench.py's ablation (tiny, S=16, indexer_topk): on that test's pytest-xdist worker, after
# it, Inductor's FX graph cache serves the notebook's four graphs.
GROUPS = {"ablation.ipynb": pytest.mark.xdist_group("bench_tiny_s16")}


def test_notebooks_exist():
    assert NOTEBOOKS, "examples/ holds the notebook demos"


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=GROUPS.get(p.name, ())) for p in NOTEBOOKS])
def test_notebook_runs_and_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "clear outputs before committing"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    assert any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")
