"""Executes every notebook in notebooks/ end to end on CPU, as CI does (nbclient, a fresh kernel each).

The kernel is the interpreter running the tests (a kernelspec written to a temporary JUPYTER_PATH
whose argv starts with ``sys.executable``), so the notebooks see this environment's jax and jax_moe
whatever kernels the machine has installed. Notebooks are committed with their outputs (executed top to
bottom on CPU), so a reader sees the figures without running them; CI runs them again.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import time

import pytest

# The [test] extra installs them; where it is absent (the GPU machine) the notebooks skip, not the run.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"quickstart.ipynb", "scratch_sharing.ipynb", "performance.ipynb", "hf_model.ipynb"}
KERNEL_NAME = "jax_moe_tests"
CELL_TIMEOUT_S = 300
MAX_COMMITTED_BYTES = 400 * 1024  # outputs included: PNG figures at 72 dpi


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec for this interpreter, and the environment the notebook kernels inherit."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"jax_moe tests ({sys.executable})",
        "language": "python",
    }))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(jupyter_dir))
        # Connection files and the IPython profile go to a temporary directory, not $HOME.
        mp.setenv("JUPYTER_RUNTIME_DIR", str(jupyter_dir / "runtime"))
        mp.setenv("IPYTHONDIR", str(jupyter_dir / "ipython"))
        mp.setenv("JAX_PLATFORMS", "cpu")  # the notebooks are documented to run on CPU
        mp.delenv("MPLBACKEND", raising=False)  # ipykernel's inline backend renders the figures
        mp.delenv("JAX_MOE_RESULTS_DIR", raising=False)
        yield mp


def execute(path: pathlib.Path) -> tuple[nbformat.NotebookNode, float]:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    return notebook, time.perf_counter() - start


def outputs(notebook, output_type=None, name=None):
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            if (output_type is None or out["output_type"] == output_type) and (name is None or out.get("name") == name):
                yield out


def images(notebook) -> int:
    return sum("image/png" in out.get("data", {}) for out in outputs(notebook))


def markdowns(notebook) -> list[str]:
    return [out["data"]["text/markdown"] for out in outputs(notebook, "display_data") if "text/markdown" in out["data"]]


def stdout(notebook) -> str:
    return "".join(out["text"] for out in outputs(notebook, "stream", "stdout"))


def test_expected_notebooks_exist():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}, sorted(p.name for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_its_outputs(path):
    """A reader sees the outputs and plots on GitHub without running anything, and they stay small."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code, "no code cells"
    assert notebook.cells[0].cell_type == "markdown", "a notebook opens with a markdown cell saying what it shows"
    unrun = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"cells {unrun} were not executed: commit the notebook with its outputs"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not one top-to-bottom run: {counts}"
    assert not list(outputs(notebook, "error"))
    if path.name in EXPECTED:
        assert images(notebook) >= 1, "commit the notebook with its figures"
    assert path.stat().st_size < MAX_COMMITTED_BYTES, path.stat().st_size
    # Read as committed (nbformat.read would fill missing ids in): nbformat 4.5 cells need unique ids.
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), ids


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_env):
    notebook, seconds = execute(path)
    print(f"{path.name}: {seconds:.1f} s")
    assert not list(outputs(notebook, "error"))
    text = stdout(notebook)
    stderr = "".join(out["text"] for out in outputs(notebook, "stream", "stderr"))
    assert "donated buffers were not usable" not in stderr + text
    if path.name in EXPECTED:
        assert images(notebook) >= 1, "expected the notebook to draw its figures"
    if path.name == "quickstart.ipynb":
        assert "every buffer reused in place" in text
        assert "scratch reused in place through training: True" in text
        first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in", text).groups())
        assert last < first
    if path.name == "hf_model.ipynb":
        assert text.count("max error relative to transformers") == 2 and "load-balancing loss" in text
        assert "FP8 stack vs bf16 stack" in text and "FP8 with scales" in text
    if path.name == "scratch_sharing.ipynb":
        assert "flat in depth" in text and "per-layer scratches at L=32" in text
    if path.name == "performance.ipynb":
        assert images(notebook) >= 4, "expected the decode, speed-up, training and pieces figures"
        assert "skipped for lack of" not in text, "a committed result file the notebook reads is missing"
        markdown = markdowns(notebook)
        assert "| model | T | forward µs (% roofline) |" in markdown[0]
        # The committed outputs are those of the committed results: its tables come out the same.
        assert markdowns(nbformat.read(path, as_version=4)) == markdown


def test_performance_notebook_without_results(kernel_env, tmp_path):
    """performance.ipynb on a results folder without the files (a fork, a fresh checkout): notes, no figures."""
    kernel_env.setenv("JAX_MOE_RESULTS_DIR", str(tmp_path))
    try:
        notebook, _ = execute(NOTEBOOK_DIR / "performance.ipynb")
    finally:
        kernel_env.delenv("JAX_MOE_RESULTS_DIR", raising=False)
    text = stdout(notebook)
    assert "bench_decode_h200.json is missing" in text and "skipped for lack of" in text
    assert images(notebook) == 0
