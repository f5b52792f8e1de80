"""Run notebooks top to bottom in this Python process, without a Jupyter kernel, and keep their outputs.

    python benchmarks/execute_notebooks.py examples/*.ipynb               # writes the outputs in place
    python benchmarks/execute_notebooks.py --out /tmp/nb examples/*.ipynb # writes executed copies to /tmp/nb

The GPU machine has no ipykernel or zmq, so this runner does a kernel's work with the standard library and
matplotlib: each code cell runs in one namespace shared by the notebook; what it prints becomes "stream" outputs,
its last expression an "execute_result", every matplotlib figure open at the end of the cell (or shown with
`plt.show()`) a PNG "display_data", and `display(...)` works as IPython's builtin does (objects with
`_repr_html_` / `_repr_markdown_` / `_repr_png_`, figures, or mime bundles with `raw=True`). The first exception
stops the notebook and is kept as an "error" output with its traceback; the notebook is still written (so the
failure can be read) and the exit status is 1.

The notebook's metadata records the run under "dsfuse_execution": UTC date, device, commit (`DSFUSE_COMMIT` or
`git rev-parse --short HEAD`), torch / triton / transformers versions and wall time, so committed outputs are
dated. With several notebooks each runs in a child process of its own: a notebook's models, compiled graphs and
environment (the kernels notebook sets TRITON_INTERPRET before importing triton on CPU) do not reach the next.
"""

from __future__ import annotations

import argparse
import ast
import base64
import builtins
import datetime
import io
import json
import linecache
import os
import platform
import subprocess
import sys
import time
import traceback
from importlib import metadata as package_metadata
from pathlib import Path

METADATA_KEY = "dsfuse_execution"


def _lines(text: str) -> list[str]:
    """Text as nbformat stores it in files: a list of lines, each keeping its newline."""
    return text.splitlines(keepends=True)


class _CellOutputs:
    """The outputs of one cell in the order they happen; consecutive writes to one stream are merged."""

    def __init__(self):
        self.items: list[dict] = []

    def stream(self, name: str, text: str) -> None:
        if self.items and self.items[-1]["output_type"] == "stream" and self.items[-1]["name"] == name:
            self.items[-1]["text"] += text
        else:
            self.items.append({"output_type": "stream", "name": name, "text": text})

    def display(self, data: dict) -> None:
        self.items.append({"output_type": "display_data", "data": data, "metadata": {}})

    def result(self, data: dict, count: int) -> None:
        self.items.append({"output_type": "execute_result", "execution_count": count, "data": data, "metadata": {}})

    def error(self, err: BaseException) -> None:
        # the cell's own frames only: the runner's exec() frame says nothing to a reader
        summary = traceback.extract_tb(err.__traceback__)
        cell_frames = traceback.StackSummary.from_list([f for f in summary if f.filename != __file__])
        lines = ["Traceback (most recent call last):\n", *cell_frames.format(),
                 *traceback.format_exception_only(type(err), err)]
        self.items.append({"output_type": "error", "ename": type(err).__name__, "evalue": str(err),
                           "traceback": "".join(lines).rstrip("\n").split("\n")})

    def for_file(self) -> list[dict]:
        for item in self.items:
            if item["output_type"] == "stream":
                item["text"] = _lines(item["text"])
            for mime, value in item.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    item["data"][mime] = _lines(value)
        return self.items


class _Tee(io.TextIOBase):
    """A stdout / stderr that records what is written as the cell's stream output and still shows it."""

    def __init__(self, name: str, outputs: _CellOutputs, echo):
        self.name, self.outputs, self.echo = name, outputs, echo

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.outputs.stream(self.name, text)
        self.echo.write(text)
        return len(text)

    def flush(self) -> None:
        self.echo.flush()


def _figure_png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def mime_bundle(obj) -> dict:
    """What a notebook front end shows for `obj`: its repr, and HTML / Markdown / PNG where it has them."""
    from matplotlib.figure import Figure

    data = {"text/plain": repr(obj)}
    if isinstance(obj, Figure):
        data["image/png"] = _figure_png(obj)
        return data
    if isinstance(obj, type):  # a class: its _repr_*_ are functions of an instance
        return data
    for mime, method in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
                         ("image/png", "_repr_png_")):
        value = getattr(obj, method, lambda: None)()
        if value is not None:
            data[mime] = base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
    return data


class _Kernel:
    """One notebook's namespace and the cell being run; gives the cells `display` and an inline `plt.show`."""

    def __init__(self):
        import matplotlib.pyplot as plt

        plt.switch_backend("Agg")  # resolved now, so the plain function below stays pyplot's show

        def show(*args, **kwargs) -> None:
            self.show_figures()

        self.plt = plt
        plt.show = show
        self.outputs = _CellOutputs()
        self.namespace = {"__name__": "__main__", "__builtins__": builtins, "display": self.display}

    def display(self, *objs, raw: bool = False) -> None:
        from matplotlib.figure import Figure

        for obj in objs:
            self.outputs.display(dict(obj) if raw else mime_bundle(obj))
            if isinstance(obj, Figure):
                self.plt.close(obj)

    def show_figures(self) -> None:
        for number in self.plt.get_fignums():
            figure = self.plt.figure(number)
            self.outputs.display({"text/plain": repr(figure), "image/png": _figure_png(figure)})
            self.plt.close(figure)

    def run_cell(self, source: str, count: int) -> list[dict]:
        """Run one cell; its outputs, the last of them an "error" output if it raised."""
        self.outputs = _CellOutputs()
        filename = f"<cell {count}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee("stdout", self.outputs, stdout), _Tee("stderr", self.outputs, stderr)
        try:
            tree = ast.parse(source, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), self.namespace)
                if value is not None:
                    from matplotlib.figure import Figure

                    self.outputs.result(mime_bundle(value), count)
                    if isinstance(value, Figure):
                        self.plt.close(value)
            self.show_figures()
        except Exception as err:  # the notebook's failure is its last output
            self.plt.close("all")
            self.outputs.error(err)
        finally:
            sys.stdout, sys.stderr = stdout, stderr
        return self.outputs.for_file()


def _version(package: str) -> str | None:
    try:
        return package_metadata.version(package)
    except package_metadata.PackageNotFoundError:
        return None


def run_record(wall_s: float) -> dict:
    """When, where and on what the outputs were made."""
    commit = os.environ.get("DSFUSE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
        except OSError:
            commit = ""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "commit": commit or "unknown", "torch": torch.__version__,
            "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(), "wall_s": round(wall_s, 1),
            "runner": "benchmarks/execute_notebooks.py"}


def execute_notebook(path: Path, out: Path) -> bool:
    """Run `path` top to bottom with the notebook's folder as working directory; write it with its outputs to
    `out`. Returns whether every cell ran."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    started = time.perf_counter()
    kernel = _Kernel()
    count, failed = 0, False
    cwd = os.getcwd()
    os.chdir(path.resolve().parent)
    try:
        for cell in notebook["cells"]:
            if cell["cell_type"] != "code":
                continue
            cell["outputs"], cell["execution_count"] = [], None
            if failed:
                continue
            count += 1
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            cell["outputs"], cell["execution_count"] = kernel.run_cell(source, count), count
            failed = any(output["output_type"] == "error" for output in cell["outputs"])
            if failed:
                print(f"{path}: cell {count} raised; the following cells were not run", file=sys.stderr)
    finally:
        os.chdir(cwd)
    notebook["metadata"][METADATA_KEY] = run_record(time.perf_counter() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write executed copies here (default: in place)")
    args = parser.parse_args(argv)
    if len(args.notebooks) == 1:
        path = args.notebooks[0]
        out = args.out / path.name if args.out else path
        started = time.perf_counter()
        ok = execute_notebook(path, out)
        print(f"{path}: {'ran' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s, wrote {out}",
              flush=True)
        return 0 if ok else 1
    out_args = ["--out", str(args.out)] if args.out else []
    statuses = [subprocess.run([sys.executable, __file__, *out_args, str(path)]).returncode
                for path in args.notebooks]
    return 0 if not any(statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
