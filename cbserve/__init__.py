"""cbserve: disaggregated prefill/decode LLM serving. `cbserve.cli` is the command line."""

__version__ = "0.1.0"
