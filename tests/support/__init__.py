"""Helpers shared by several test modules (no tests here): `patching` (an independent reference model and
the run helpers of the patch tests), `sweep_fakes` (a fast deterministic sweep evaluator), `log_capture`
(what transformers logs), `import_graph` (snapquant's import graph read from the sources), `kernel_cases`
(the decode shapes and kernel variants the kernel tests compile)."""
