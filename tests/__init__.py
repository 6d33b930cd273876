"""snapquant's test suite: a package, so tests import their shared helpers as `tests.support.*` (pytest puts
the repository root on sys.path for a rootdir package)."""
