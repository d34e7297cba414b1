"""`inference_mode`: `torch.inference_mode()` around a per-step function, entered only when the
caller is not inside one already.

Why: entering inference mode costs more than the rest of a small decode step's Python (a few
microseconds on a quiet host, tens on a busy one: measured with `bench/host_step.py`), and the
runner and the sampler each entered it once per step. `Engine.step` now enters it once, and the
runner and sampler inside it take it as given; called on their own, they still enter it.
"""

from __future__ import annotations

import functools

import torch


def inference_mode(fn):
    """Decorator: run `fn` in inference mode, entering it only if it is not on already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return run
