"""When the host waits for the device. Off the CPU, kernels queue up and the host runs ahead; it waits where it reads
a tensor's values (`tolist`, `item`, a truth value, a boolean mask's places, ...) and where it copies host values
onto the device from pageable memory (PyTorch then waits for the device's queue before the copy). A decode step
should wait once, for its draws.

`to_device` moves a step's small host values without waiting; `Waits` counts the operations that would wait, by call
site, on any device: on the CPU, where nothing waits, it shows where a GPU step would (`tests/test_waits.py`)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# the operations that read a tensor's values on the host (on a device: a wait for everything queued before them)
READS = frozenset({"item", "tolist", "numpy", "cpu", "nonzero", "unique", "masked_select",
                   "__bool__", "__int__", "__float__", "__index__"})


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values (numbers, nested lists, or a host tensor) as a tensor on `device`; off the CPU through pinned memory and
    a copy that does not wait for the device's queued work."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu" or host.device == device:
        return host
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)  # contiguous: an expanded mask pins too


def _masked(index: Any) -> bool:
    """Whether an index holds a boolean mask (indexing with one finds its True places on the host)."""
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool
               for part in (index if isinstance(index, tuple) else (index,)))


class Waits(TorchFunctionMode):
    """While active, counts by call site (file, line) the operations that make the host wait off the CPU: the `READS`,
    indexing with a boolean mask, and tensors built from host values straight onto a named device
    (`torch.tensor(..., device=...)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[tuple[str, int]] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS or name in ("__getitem__", "__setitem__") and _masked(args[1])
                or name in ("tensor", "as_tensor") and kwargs.get("device") is not None):
            caller = sys._getframe(1)
            self.sites[(caller.f_code.co_filename, caller.f_lineno)] += 1
        return func(*args, **kwargs)
