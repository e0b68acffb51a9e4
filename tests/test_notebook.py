"""notebooks/quickstart.ipynb runs end to end with tiny sizes, so it can't rot."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


def with_tiny_parameters(notebook, tiny_model_dir: str, run_dir: Path):
    """Insert a cell after the ``parameters`` cell that overrides its sizes (as papermill does)."""
    index = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    overrides = dict(
        policy=tiny_model_dir,
        epochs=2,
        prompts_per_epoch=2,
        group_size=2,
        max_new_tokens=4,
        batch_size=4,
        val_size=4,
        compare_prompts=2,
        progress=False,
        run_dir=str(run_dir),
    )
    source = "\n".join(f"{name} = {value!r}" for name, value in overrides.items())
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(source))
    return notebook


def test_quickstart_notebook_executes_and_shows_curves_and_answers(tmp_path, tiny_model_dir):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    notebook = with_tiny_parameters(notebook, tiny_model_dir, tmp_path / "run")
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    data = [output.get("data", {}) for output in outputs]
    assert any("image/png" in d for d in data), "no curves shown"
    tables = [d["text/markdown"] for d in data if "text/markdown" in d]
    assert tables and tables[0].startswith("| prompt | before (score") and len(tables[0].splitlines()) == 2 + 2
    text = "".join(output.get("text", "") for output in outputs)
    assert "before ->" in text and "after" in text
    assert (tmp_path / "run" / "quickstart" / "version_0" / "curves.png").stat().st_size > 1000
