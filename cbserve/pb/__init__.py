"""Generated wire modules (from proto/cbserve/pb/cbserve.proto); regenerate with `python proto/generate.py`."""
