"""Test doubles and probes shared by test files (a module, not a test file)."""

import collections
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class FakeBackend:
    """Records the calls the CUDA offload backend would make; copies are clones, marks are counters.

    Registered for ``"cpu"`` in ``funckpt._offload.BACKENDS``, it makes CPU tensors take the
    accelerator path of offloading, so its order of copies and waits is tested without a GPU.
    """

    def __init__(self):
        self.log = []
        self.marks = 0

    def _mark(self):
        self.marks += 1
        return self.marks

    def to_host(self, t, pinned):
        mark = self._mark()
        self.log.append(("to_host", tuple(t.shape), pinned, mark))
        return t.detach().clone(), mark

    def to_device(self, host, device, done):
        mark = self._mark()
        self.log.append(("to_device", tuple(host.shape), done, mark))
        return host.clone(), mark

    def ready(self, t, done):
        self.log.append(("ready", tuple(t.shape), done))


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators executed while active, by packet (JAX's jaxpr-text counts)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


class CountComputing(TorchDispatchMode):
    """Counts the operators that compute something (not the detach of a served value, not views)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not aten.detach.default and not any(r.alias_info is not None for r in func._schema.returns):
            self.n += 1
        return func(*args, **(kwargs or {}))


class LiveBf16Casts(TorchDispatchMode):
    """Weak references to the bfloat16 casts autocast makes under it; ``alive()`` counts those
    still held (by autocast's cast cache, or anything else)."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
            self.casts.append(weakref.ref(out))
        return out

    def alive(self):
        gc.collect()
        return sum(r() is not None for r in self.casts)
