"""The inference engine: scheduler, KV cache manager, model runner and sampler (no I/O).

Importing it sets `OMP_WAIT_POLICY=PASSIVE` unless the environment says otherwise. torch's CPU
kernels run on libgomp, whose idle threads otherwise spin at every barrier (up to ~300k cycles):
with more runnable threads than cores (a local cluster's router and pods, test workers, several
pods on one node) the spinners take the cores from the threads with work, and a tiny model's step
measured 20x slower (1.6 s against 0.085 s for 12 tokens at load ~3 on 2 cores). libgomp reads the
variable when it is loaded, so this holds only for processes that import `engine` before torch:
`cbserve` imports it first, and every process it starts inherits the variable.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
