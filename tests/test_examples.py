"""Every notebook in examples/ runs top to bottom (on CPU with the tiny presets here); the outputs committed with a
notebook come from a dated run of benchmarks/execute_notebooks.py, whose recording is tested on a small notebook."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "benchmarks" / "execute_notebooks.py"
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
# ablation.ipynb runs test_bench.py's ablation (tiny, S=16, indexer_topk): on that test's pytest-xdist worker, after
# it, Inductor's FX graph cache serves the notebook's graphs. quickstart.ipynb compiles the README's example graph
# (tiny, fp32, 1 x 32): the README test, on the same worker, is served the compile. v4.ipynb's CPU run is
# test_bench.py's V4 prefill bench (v4-tiny, S=12, eager,dsfuse): the same graph, on the same worker. generate.ipynb's
# tiny run on CPU is test_bench_generate.py's (prompt 17, 2 new tokens, chunks of 16): its three graphs, served.
GROUPS = {"ablation.ipynb": pytest.mark.xdist_group("bench_tiny_s16"),
          "generate.ipynb": pytest.mark.xdist_group("generate_tiny_p17"),
          "quickstart.ipynb": pytest.mark.xdist_group("readme_tiny_s32"),
          "v4.ipynb": pytest.mark.xdist_group("bench_v4_tiny_s12")}
RUN_RECORD = ("date", "device", "commit", "torch", "triton", "transformers")


def code_cells(notebook) -> list:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def undated_outputs(notebook) -> list[str]:
    """What a notebook with outputs lacks of the runner's record of when, where and at which commit they were made."""
    if not any(cell.get("outputs") for cell in code_cells(notebook)):
        return []
    record = notebook["metadata"].get("dsfuse_execution", {})
    return [key for key in RUN_RECORD if record.get(key) in (None, "", "unknown")]


def test_the_examples_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "ablation.ipynb", "kernels.ipynb", "generate.ipynb",
                                           "v4.ipynb"}


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=GROUPS.get(p.name, ())) for p in NOTEBOOKS])
def test_notebook_runs_on_cpu(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in code_cells(notebook):
        cell.outputs, cell.execution_count = [], None
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    cells = code_cells(notebook)
    assert all(cell.execution_count for cell in cells)
    assert not [o for cell in cells for o in cell.outputs if o.output_type == "error"]
    assert any(cell.outputs for cell in cells)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in NOTEBOOKS])
def test_committed_outputs_are_valid_and_dated(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    refresh = f"python benchmarks/execute_notebooks.py examples/{path.name}"
    assert not undated_outputs(notebook), f"outputs without the runner's record of the run: refresh them with {refresh}"


CELLS = [
    "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nprint('more stdout')",
    "answer = 6 * 7\nanswer",
    "import matplotlib.pyplot as plt\nfigure, axes = plt.subplots()\naxes.bar(['a', 'b'], [1, 2])\nNone",
    "display({'text/markdown': '| a |\\n|---|'}, raw=True)\nplt.plot([1, 2])\nplt.show()",
    "def fails():\n    return answer / 0\n\nfails()",
    "print('never run')",
]


def _synthetic_notebook(path: Path, cells: list[str]) -> None:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# synthetic")]
                                        + [nbformat.v4.new_code_cell(source) for source in cells])
    path.write_text(nbformat.writes(notebook))


def test_runner_records_streams_results_figures_and_the_first_error(tmp_path):
    _synthetic_notebook(tmp_path / "cells.ipynb", CELLS)
    _synthetic_notebook(tmp_path / "fine.ipynb", ["print('fine')"])
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(RUNNER), "--out", str(out), str(tmp_path / "fine.ipynb"),
                          str(tmp_path / "cells.ipynb")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DSFUSE_COMMIT": "abc1234"})
    assert run.returncode == 1, run.stderr  # one of the two notebooks raised
    assert "cell 5 raised" in run.stderr
    fine = nbformat.read(out / "fine.ipynb", as_version=4)
    assert [o.text for o in fine.cells[1].outputs] == ["fine\n"] and not undated_outputs(fine)

    notebook = nbformat.read(out / "cells.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert not undated_outputs(notebook) and notebook.metadata.dsfuse_execution.commit == "abc1234"
    assert not any(cell.get("outputs") for cell in code_cells(json.loads((tmp_path / "cells.ipynb").read_text())))
    printed, expression, figure, display, error, after = code_cells(notebook)
    assert [(o.output_type, o.name, o.text) for o in printed.outputs] == [
        ("stream", "stdout", "to stdout\n"), ("stream", "stderr", "to stderr\n"), ("stream", "stdout", "more stdout\n")]
    assert [(o.output_type, o.execution_count, o.data["text/plain"]) for o in expression.outputs] == [
        ("execute_result", 2, "42")]
    assert [o.output_type for o in figure.outputs] == ["display_data"]  # a None result shows nothing
    assert figure.outputs[0].data["image/png"].startswith("iVBORw0KGgo")  # PNG's signature in base64
    assert [sorted(o.data) for o in display.outputs] == [["text/markdown"], ["image/png", "text/plain"]]
    assert [(o.output_type, o.ename) for o in error.outputs] == [("error", "ZeroDivisionError")]
    traceback = "\n".join(error.outputs[0].traceback)
    assert "<cell 5>" in traceback and "return answer / 0" in traceback and "execute_notebooks" not in traceback
    assert [c.execution_count for c in code_cells(notebook)] == [1, 2, 3, 4, 5, None] and after.outputs == []


def test_runner_writes_in_place_without_out(tmp_path):
    _synthetic_notebook(tmp_path / "fine.ipynb", ["print('fine')"])
    subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "fine.ipynb")], check=True, timeout=300,
                   capture_output=True)
    notebook = nbformat.read(tmp_path / "fine.ipynb", as_version=4)
    assert [o.text for o in notebook.cells[1].outputs] == ["fine\n"] and notebook.metadata.dsfuse_execution.date


def test_outputs_without_the_runners_record_are_caught():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    assert undated_outputs(notebook) == []
    notebook.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "1"}, execution_count=1)]
    assert undated_outputs(notebook) == list(RUN_RECORD)
    notebook.metadata["dsfuse_execution"] = {key: "x" for key in RUN_RECORD}
    assert undated_outputs(notebook) == []
    notebook.metadata["dsfuse_execution"]["commit"] = "unknown"  # the runner's word for "no git, no DSFUSE_COMMIT"
    assert undated_outputs(notebook) == ["commit"]
