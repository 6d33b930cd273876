"""The per-channel sensitivity walkthrough notebook executes top to bottom without errors."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "sensitivity_walkthrough.ipynb"


@pytest.mark.slow  # covered by default: the functions it calls (test_analysis_sensitivity)
def test_sensitivity_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat, nbclient and ipykernel (dev extra)")
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient (dev extra)")
    pytest.importorskip("ipykernel", reason="notebook tests need ipykernel (dev extra)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    texts = []
    images = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                pytest.fail(f"{out['ename']}: {out['evalue']}")
            texts.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
            images += "image/png" in out.get("data", {})
    text = "\n".join(texts)
    assert "MLA layers; latent" in text and "fp8 per-token SQNR" in text and "attention error" in text
    assert images >= 2
