"""Meta values: the tensors ``passes.analysis`` interprets a graph on when it does not use ``FakeTensorMode``.

``FakeTensorMode()`` imports ``torch._dynamo`` (~1 s cold, in its constructor, for its configuration). The
analysis needs far less of it: every op run on a meta kernel, outputs that stand for tensors of the
device their inputs claim, and views of one storage kept views of one storage. This module gives that
and nothing more.

Terms
- meta value (``MetaValue``): a meta tensor (shape, stride, offset, dtype, grad flag; no data) that
  stands for a tensor of ``device`` (``cpu``, ``cuda:0``, ``meta``). It is made as ``FakeTensor`` is
  (``Tensor._make_subclass`` of a meta tensor, its device answered through Python dispatch, its
  dispatch keys those of ``device``), so that autograd, the dispatcher and the modes above see the
  same ops as they do for fake tensors, the ``prim.device`` queries autograd makes included: the
  analysis counts those in ``NodeCost.num_ops`` (``passes.analysis``), and the two paths must count alike.
- ``MetaValueMode``: the dispatch mode under which ops on meta values run: tensors that are not meta
  values (parameters, constants the graph makes) get a twin (``twin``: one meta storage per real
  storage, memoised); every op runs its meta kernel; its tensor outputs become meta values of the
  device of its inputs (or of its ``device`` argument, for factories). An op without a meta kernel
  raises, as on ``meta``; ``passes.analysis`` then interprets the graph on fake tensors instead.
- deferred ``torch._dynamo`` (``dynamo_deferred``): torch wraps many of its own functions, the Python
  meta kernels among them (``torch._prims_common.wrappers``: ``pow``, ``mean``...), in
  ``torch._disable_dynamo``, which imports ``torch._dynamo`` on a function's first call to make the
  function that keeps the compiler out of it. While ``torch._dynamo`` is not imported nothing can be
  compiling, so that function is the function itself; ``dynamo_deferred`` lets those first calls take a
  stand-in (``_DeferredDisable``) that calls the function as it is until ``torch._dynamo`` is imported,
  and then puts torch's own in its place.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.passes.flop_formulas import GroupedMmCounting

__all__ = ["MetaValue", "MetaValueMode", "flop_total_mode", "dynamo_deferred"]

_DEVICE = torch.ops.prim.device.default
# In-place ops that change a tensor's shape or strides (as ``passes.analysis._METADATA_INPLACE``).
_METADATA_INPLACE = frozenset({"resize_", "resize_as_", "unsqueeze_", "squeeze_", "t_", "transpose_", "as_strided_",
                               "swapdims_", "swapaxes_", "set_", "detach_", "_resize_output_"})


class MetaValue(torch.Tensor):
    """A meta tensor standing for a tensor on ``value_device`` (module docstring)."""

    value_device: torch.device
    elem: torch.Tensor           # the plain meta tensor (same storage and metadata) kernels run on

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device, requires_grad: bool | None = None):
        self = torch.Tensor._make_subclass(cls, elem, elem.requires_grad if requires_grad is None else requires_grad,
                                           dispatch_device=True, device_for_backend_keys=device)
        self.value_device = device
        self.elem = elem
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:   # as FakeTensor's, without the dispatch
        return self.value_device

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            return args[0].value_device
        raise RuntimeError(f"MetaValue: {func} called outside MetaValueMode")

    def __repr__(self) -> str:   # noqa: D105
        return f"MetaValue({tuple(self.shape)}, {self.dtype}, device={self.value_device})"


class MetaValueMode(TorchDispatchMode):
    """Run ops on meta values (module docstring). ``twin(t)`` gives the meta value of a tensor."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False   # else torch wraps __torch_dispatch__ in torch._dynamo.disable, importing torch._dynamo

    def __init__(self):
        super().__init__()
        self._storages: dict[Any, Any] = {}
        self._twins: dict[int, tuple[torch.Tensor, MetaValue]] = {}   # id -> (original kept alive, twin)

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        """The meta value standing for ``t`` (memoised: the same object for the same tensor; views of one
        storage on one meta storage); a meta value is its own twin."""
        if isinstance(t, MetaValue):
            return t
        got = self._twins.get(id(t))
        if got is not None:
            return got[1]
        from torch.multiprocessing.reductions import StorageWeakRef

        with torch._C._DisableTorchDispatch():
            src = t.untyped_storage()
            key = StorageWeakRef(src)
            st = self._storages.get(key)
            if st is None:
                # A new storage even for a meta tensor, as FakeTensorMode gives: a module's own parameter,
                # which autograd saves as it is, is then told apart from the twin (``passes.analysis``).
                st = self._storages[key] = (torch.UntypedStorage(src.nbytes(), device="meta"), src)
            elem = torch.empty(0, dtype=t.dtype, device="meta").set_(st[0], t.storage_offset(), t.shape, t.stride())
        out = MetaValue(elem, t.device, t.requires_grad)
        self._twins[id(t)] = (t, out)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:
            return args[0].value_device if isinstance(args[0], MetaValue) else args[0].device
        if "out" in kwargs or func.__name__.split(".")[0] in _METADATA_INPLACE:
            # The kernel would change its plain meta tensor's shape, not the meta value's.
            raise NotImplementedError(f"MetaValueMode: {func} changes a tensor's metadata in place")
        flat, spec = tree_flatten((args, kwargs))
        device = scalar_device = None
        by_elem = {}
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                x = self.twin(x)
                elem = getattr(x, "elem", None)
                if elem is None:
                    raise NotImplementedError(f"MetaValueMode: {func} got a meta value made elsewhere")
                flat[i] = elem
                by_elem[id(elem)] = x
                if x.dim() == 0 and x.value_device.type == "cpu":
                    scalar_device = scalar_device or x.value_device   # a CPU scalar goes with any device
                elif device is None:
                    device = x.value_device
        args2, kwargs2 = spec.unflatten(flat)
        if kwargs2.get("device") is not None:
            device = torch.device(kwargs2["device"])
            kwargs2 = dict(kwargs2, device="meta")
        device = device or scalar_device or torch.get_default_device()
        with torch._C._DisableTorchDispatch():
            out = func(*args2, **kwargs2)

        def wrap(o):
            if not isinstance(o, torch.Tensor):
                return o
            got = by_elem.get(id(o))      # an input returned (in place) is that input
            return got if got is not None else MetaValue(o, device)
        return tree_map(wrap, out)


def flop_total_mode():
    """A ``torch.utils.flop_counter.FlopCounterMode(display=False)`` that counts as it counts (its own
    dispatch code and module tracker) without importing ``torch._dynamo``: torch wraps every dispatch
    mode's ``__torch_dispatch__`` in ``torch._dynamo.disable`` (imported on first use, ~1 s); the
    counting mode here is ``_FlopCounterMode`` with the unwrapped function."""
    return _flop_total_class()(display=False)


@functools.cache
def _flop_total_class():
    from torch.utils import flop_counter   # imports triton (~0.2 s)

    raw = flop_counter._FlopCounterMode.__dict__["__torch_dispatch__"]

    class _Mode(flop_counter._FlopCounterMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        __torch_dispatch__ = getattr(raw, "__wrapped__", raw)

    class FlopTotal(GroupedMmCounting, flop_counter.FlopCounterMode):
        def __enter__(self):   # FlopCounterMode.__enter__ with ``_Mode``
            self.flop_counts.clear()
            self.mod_tracker.__enter__()
            self.mode = _Mode(self)
            self.mode.__enter__()
            return self

    return FlopTotal


class _DeferredDisable:
    """``torch._dynamo.disable(fn, recursive, wrapping=False)``, deferred (module docstring)."""

    __slots__ = ("_fn", "_recursive")

    def __init__(self, fn, recursive: bool = True):
        self._fn, self._recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        disable = None if dynamo is None or getattr(dynamo, "_autopar_stand_in", False) else \
            getattr(dynamo, "disable", None)       # None too while torch._dynamo is being imported
        if disable is None:
            return self._fn(*args, **kwargs)
        real = disable(self._fn, self._recursive, wrapping=False)
        setattr(self._fn, "__dynamo_disable", real)   # what torch._compile._disable_dynamo caches
        return real(*args, **kwargs)


def _stand_in_disable(fn=None, recursive=True, *, wrapping=True, reason=None):
    """The stand-in's ``disable``: only what ``torch._compile._disable_dynamo`` asks (a function, no
    wrapper); any other use (a decorator, ``torch.compiler.disable``) raises, and the analysis then runs
    on fake tensors with the real ``torch._dynamo``."""
    if fn is None or wrapping:
        raise RuntimeError("torch._dynamo stand-in (passes.meta_values): disable() beyond _disable_dynamo")
    return _DeferredDisable(fn, recursive)


def _other_threads() -> int:
    """Threads besides this one that could import ``torch._dynamo``: not tqdm's monitor, which only
    polls its progress bars (torch.fx's ``Interpreter.run`` makes a disabled bar where tqdm is
    installed, and tqdm then starts the monitor: with transformers installed, every analysis did)."""
    me = threading.current_thread()
    return sum(1 for t in threading.enumerate() if t is not me and type(t).__name__ != "TMonitor")


@contextlib.contextmanager
def dynamo_deferred():
    """While this lasts, ``import torch._dynamo`` gives a stand-in whose ``disable`` is ``_DeferredDisable``
    (module docstring); anything else asked of it raises (``AttributeError``, ``ModuleNotFoundError`` for
    its submodules), which ``passes.analysis`` answers by interpreting on fake tensors after the stand-in
    is gone. Process-wide while it lasts, so only where this is the process's one thread (another could
    import ``torch._dynamo`` meanwhile); elsewhere, and where ``torch._dynamo`` is already imported,
    nothing changes (the first such call imports it)."""
    if "torch._dynamo" in sys.modules or _other_threads():
        yield
        return
    stand_in = types.ModuleType("torch._dynamo", "autopar's stand-in while it analyses a graph (passes.meta_values)")
    stand_in._autopar_stand_in = True
    stand_in.disable = _stand_in_disable
    sys.modules["torch._dynamo"] = stand_in
    torch._dynamo = stand_in
    try:
        yield
    finally:
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stand_in:
            del torch._dynamo
