"""KV cache groups: a mixed local/global model's layers split by window, one block table each.

`spec` (torch-free): which layers form which group and where in a KV page each layer's KV sits.
`tables` (torch-free): the local groups' block tables, freed behind their windows, beside the
manager's own (group 0). See docs/architecture.md ("KV cache groups").
"""
