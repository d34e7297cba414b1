"""Tool calling in the router: the request fields (`fields`) and their checks (`request`),
conversation messages for chat templates (`messages`), the per-model formats (`formats`), the
streaming call parser (`stream`, over `call_reader` and `json_scan`), and the grammars that force
calls (`grammar`)."""
