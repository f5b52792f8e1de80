"""Every Python block of the README runs as written, in order, in one namespace (as a reader pasting them would),
on CPU: all but the released-checkpoint example, which needs a download of hundreds of GB."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS_DOWNLOAD = 'from_pretrained("deepseek-ai/'


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
@pytest.mark.xdist_group("readme_tiny_s32")  # with examples/quickstart.ipynb, which compiles the same graph
def test_readme_python_blocks_run_on_cpu(capsys):
    blocks = python_blocks()
    assert len(blocks) >= 4
    runnable = [block for block in blocks if NEEDS_DOWNLOAD not in block]
    assert len(runnable) == len(blocks) - 1
    namespace: dict = {}
    for block in runnable:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "dsfuse report:" in out and "indexer_topk" in out
    assert "torch.Size([1, 48])" in out
