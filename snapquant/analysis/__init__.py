"""Analysis of sweep results and of the MLA cache itself.

- `load_results`, `build_table` (+ `SweepTable.to_markdown/to_latex/save`): benchmark tables with
  deltas vs the baseline, paired significance tests and minimum detectable effects (`significance`).
- `build_fidelity_table` (+ `FidelityTable.save`): fidelity vs the unquantized model with
  cluster-bootstrap intervals, paired comparisons and the largest-KL positions (`uncertainty`).
- `plots.plot_all`: score vs bytes/token and per-task delta figures (PNG + PDF).
- `sensitivity_report` (+ `sensitivity_plots.plot_sensitivity`): per-layer, per-channel statistics
  and quantization / attention-output error of the NoPE latent and the RoPE key.
Plot modules import matplotlib; import them explicitly.
"""

from .fidelity_tables import FidelityTable, build_fidelity_table, has_fidelity
from .results import CorruptResultWarning, baseline_of, load_results
from .sensitivity import SensitivityReport, channel_statistics, sensitivity_report
from .significance import PairedTest, mcnemar_exact, paired_permutation, paired_test
from .tables import SweepTable, build_table

__all__ = [
    "CorruptResultWarning", "FidelityTable", "PairedTest", "SensitivityReport", "SweepTable", "baseline_of", "build_fidelity_table", "build_table", "channel_statistics",
    "has_fidelity", "load_results", "mcnemar_exact", "paired_permutation", "paired_test", "sensitivity_report",
]
