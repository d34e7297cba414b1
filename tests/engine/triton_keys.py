"""What Triton keys a compiled kernel on, recorded at every launch instead of running the kernel.

`KeyRecorder` stands in for every jitted kernel of `kernels/*_triton.py`: a launch goes through
the real launcher code (grids, constexprs, strides, the step's staged tensors) and, instead of
compiling or interpreting anything, records the specialisation Triton would look its compiled
kernel up by: each constexpr's value, each pointer's 16-byte alignment and each integer's
`== 1` / `% 16` class (unless the kernel lists it in `do_not_specialize`), plus the launch
options. The key comes from Triton's own binder (`triton.runtime.jit.create_function_from_signature`,
the code `JITFunction.run` calls) where this Triton has it, else from the same rules written out.
A new key while serving is a compile of seconds on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _dns_lists(kernel) -> tuple[list, list]:
    """(do_not_specialize, do_not_specialize_on_alignment) of a JITFunction or InterpretedFunction."""
    if hasattr(kernel, "kwargs"):    # the interpreter keeps the decorator's arguments
        kw = kernel.kwargs
        return list(kw.get("do_not_specialize") or []), list(kw.get("do_not_specialize_on_alignment") or [])
    return list(kernel.do_not_specialize or []), list(getattr(kernel, "do_not_specialize_on_alignment", None) or [])


class _Stub:
    def __init__(self, name: str, kernel, keys: list, raw_keys: list, launches: list) -> None:
        self.name, self.keys, self.raw_keys, self.launches = name, keys, raw_keys, launches
        fn = kernel.fn
        dns, dns_align = _dns_lists(kernel)
        self._bind = _binder(fn, dns, dns_align)
        self._bind_raw = _binder(fn, [], [])      # as if nothing were kept out of the key

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = self._bind(*args, **kwargs)
            self.keys.append((self.name, key))
            self.raw_keys.append((self.name, self._bind_raw(*args, **kwargs)))
            self.launches.append((self.name, tuple(grid), key))
        return launch


def _binder(fn, dns: list, dns_align: list):
    """args, kwargs -> the hashable key Triton's JITFunction.run would compute for this launch."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError:
        return _rules_binder(fn, dns, dns_align)
    jit = JITFunction(fn, do_not_specialize=dns, do_not_specialize_on_alignment=dns_align)
    bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)

    def key(*args, **kwargs):
        _, specialization, options = bind(*args, **kwargs)
        return tuple(tuple(s) for s in specialization), tuple(sorted(options.items()))
    return key


def _rules_binder(fn, dns: list, dns_align: list):
    """The same key from Triton's documented rules (for a Triton without the binder above)."""
    sig = inspect.signature(fn)
    names = list(sig.parameters)

    def kept_out(name, lst):
        return name in lst or names.index(name) in lst

    def key(*args, **kwargs):
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
        out = []
        for name, param in sig.parameters.items():
            value = bound.arguments.get(name, param.default)
            if "constexpr" in str(param.annotation):
                out.append(("constexpr", value))
            elif isinstance(value, torch.Tensor):
                aligned = not (kept_out(name, dns) or kept_out(name, dns_align)) and value.data_ptr() % 16 == 0
                out.append((str(value.dtype), "D" if aligned else ""))
            elif isinstance(value, bool) or not isinstance(value, int) or kept_out(name, dns):
                out.append((type(value).__name__, None))
            else:
                out.append(("int", "1" if value == 1 else "D" if value % 16 == 0 and not kept_out(name, dns_align)
                            else ""))
        return tuple(out), options
    return key


class KeyRecorder:
    """Replaces every `*_kernel` of `kernels/*_triton.py` (through `monkeypatch`) with a stub that
    records each launch's key in `keys` (and, ignoring `do_not_specialize`, in `raw_keys`), and
    each launch's grid beside it in `launches`."""

    def __init__(self, monkeypatch) -> None:
        self.keys: list[tuple[str, tuple]] = []
        self.raw_keys: list[tuple[str, tuple]] = []
        self.launches: list[tuple[str, tuple, tuple]] = []     # (kernel, grid, key) in launch order
        self.kernels: list[str] = []
        for path in sorted(KERNELS.glob("*_triton.py")):
            module = importlib.import_module(f"kernels.{path.stem}")
            for name, obj in list(vars(module).items()):
                if name.endswith("_kernel") and hasattr(obj, "fn"):
                    monkeypatch.setattr(module, name, _Stub(f"{path.stem}.{name}", obj, self.keys, self.raw_keys,
                                                             self.launches))
                    self.kernels.append(f"{path.stem}.{name}")

    def take(self) -> tuple[set, set]:
        """The distinct (keys, raw keys) recorded since the last call."""
        keys, raw = set(self.keys), set(self.raw_keys)
        self.keys.clear()
        self.raw_keys.clear()
        return keys, raw
