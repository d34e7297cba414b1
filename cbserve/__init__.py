"""cbserve: disaggregated prefill/decode LLM serving. `cbserve.cli` is the command line."""

__version__ = "0.1.0"

import engine  # noqa: E402,F401 - first, for its OpenMP setting (engine/__init__.py): before torch loads
