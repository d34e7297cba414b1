"""Generated wire modules (from proto/wire/cbserve.proto); regenerate with `python proto/generate.py`."""
