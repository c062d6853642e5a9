"""The notebooks run top to bottom on 8 fake CPU devices, and are stored clean (no outputs)."""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on 2 cores; the README test command runs it

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the [test] extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the [test] extra")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_both_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "partitioning.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean_with_badge_and_install_cell(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name
    assert "colab.research.google.com" in nb.cells[0].source
    install = nb.cells[1].source
    assert "import t5lite" in install and "%pip install" in install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this environment: conftest's 8 fake CPU devices, CPU only.
    env_keys = ("XLA_FLAGS", "JAX_PLATFORMS")
    assert all(k in os.environ for k in env_keys)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "\n".join(
        o.get("text", "") or "".join(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "8 devices" in text
    if path.stem == "quickstart":
        assert "checkpoint_8" in text and "step 8" in text and "->" in text
    else:
        assert "fully_sharded" in text and "all-reduce" in text
