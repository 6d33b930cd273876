"""Helpers shared by several test modules (no tests here): `patching` (an independent reference model and
the run helpers of the patch tests), `sweep_fakes` (a fast deterministic sweep evaluator), `log_capture`
(what transformers logs)."""
