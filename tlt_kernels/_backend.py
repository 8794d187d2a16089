"""Backend registry and dispatch.

Every public op owns a table ``{backend_name: "module:function"}``; implementations are imported
lazily so importing :mod:`tlt_kernels` never imports Triton or the CUDA extension and never queries
a GPU. ``backend="auto"`` picks the first *available* backend in the op's preference order for the
device of the inputs; an explicitly requested backend that is unavailable raises
:class:`BackendUnavailableError` carrying the reason.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from . import _switches

BACKENDS: Tuple[str, ...] = ("torch", "triton", "cuda")

# Eager calls (verify_tree, compact_kv, tree attention's plan.run) skip the torch.library custom op around a kernel
# launch when nothing needs it: its Python dispatch can cost more than the kernel at small batch (figures:
# docs/ARCHITECTURE.md, "Direct dispatch"; python -m tools.profile_dispatch). The op stays the path under
# torch.compile and any tracing (see direct_dispatch_ok). TLT_DIRECT_DISPATCH=0 (tlt_kernels._switches) always takes the op.
DIRECT_DISPATCH = _switches.DIRECT_DISPATCH.get()
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_jit_tracing_state = getattr(torch._C, "_get_tracing_state", None)
try:  # functorch transforms (vmap, grad) wrap tensors that still report type torch.Tensor
    from torch._C._functorch import peek_interpreter_stack as _functorch_level
except ImportError:  # pragma: no cover - depends on the torch build
    _functorch_level = None
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class BackendUnavailableError(RuntimeError):
    """Raised when a requested backend cannot run the given inputs (with the reason)."""


def triton_interpret_enabled() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET``, read at each call)."""
    return _switches.triton_interpret()


def process_constant(fn):
    """Cache ``fn`` (a fixed fact of the process: an import probe, a device property) and let ``torch.compile``
    call it eagerly and keep its value, instead of tracing through ``functools.lru_cache`` (which dynamo does with
    a warning). ``__wrapped__`` is the uncached ``fn``."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args):
        return cached(*args)

    # What torch.compiler.assume_constant_result(call) sets; calling it here would import torch._dynamo (and with it
    # Triton) when tlt_kernels is imported. A test checks that dynamo still honours the mark.
    call._dynamo_marked_constant = True
    return call


@process_constant
def _triton_import_error() -> Optional[str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


@process_constant
def _cuda_ext_import_error() -> Optional[str]:
    try:
        importlib.import_module("tlt_kernels._C")
    except Exception as exc:
        return (
            "the CUDA extension tlt_kernels._C is not built "
            f"({type(exc).__name__}: {exc}); reinstall with nvcc on PATH or TLT_BUILD_CUDA=1"
        )
    return None


@process_constant
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> Tuple[int, int]:
    """``(major, minor)`` of a CUDA device, queried once per device (path rules ask on every run)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@process_constant
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device, queried once per device (grid-sizing rules ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def backend_unavailable_reason(backend: str, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` (None when it can)."""
    if backend == "torch":
        return None
    if backend == "triton":
        err = _triton_import_error()
        if err:
            return err
        if device.type == "cuda" or triton_interpret_enabled():
            return None
        return f"triton needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run it on the CPU"
    if backend == "cuda":
        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors (got {device})"
        return _cuda_ext_import_error()
    raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {BACKENDS}")


def direct_dispatch_ok(*tensors) -> bool:
    """Whether a kernel may be launched without its custom op: plain eager execution only (see
    :data:`DIRECT_DISPATCH`). Not under torch.compile, a dispatch or torch-function mode (FakeTensor,
    functionalization, profilers), torch.jit.trace or a functorch transform (vmap, grad), and not when any of
    ``tensors`` (``None`` entries and lists of tensors allowed) is a subclass or an input autograd would track."""
    if not DIRECT_DISPATCH or torch.compiler.is_compiling():
        return False
    if None in (_dispatch_stack_len, _function_mode_on, _jit_tracing_state, _functorch_level):
        return False  # an unknown torch: stay on the op
    if _dispatch_stack_len() > 0 or _function_mode_on() or _jit_tracing_state() is not None:
        return False
    if _functorch_level() is not None:  # inside vmap / grad: the op's (missing) batching rule must decide
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        for x in (t if isinstance(t, (list, tuple)) else (t,)):
            if x is None:
                continue
            # A subclass, or an input autograd would track: the op (with no autograd formula) must handle it, so a
            # backward through it fails loudly instead of silently getting no gradient. A Parameter (a model's
            # weights) overrides nothing of torch's dispatch, so it launches directly like the plain tensor it holds.
            if type(x) not in _PLAIN_TENSOR_TYPES or (grad and x.requires_grad):
                return False
    return True


def cuda_extension_available() -> bool:
    return _cuda_ext_import_error() is None


class OpBackends:
    """The backend table of one public op.

    ``impls`` maps a backend name to ``"module:function"`` (imported on first use);
    ``preference`` is the order ``auto`` tries on a CUDA device. On the CPU ``auto`` is ``torch``.
    """

    def __init__(self, op_name: str, impls: Dict[str, str], preference: Sequence[str]):
        self.op_name = op_name
        self.impls = dict(impls)
        self.preference = tuple(preference)
        self._cache: Dict[str, Callable] = {}

    def available(self, device: torch.device) -> Dict[str, Optional[str]]:
        """``{backend: None if usable else reason}`` for every backend of :data:`BACKENDS`."""
        out = {}
        for name in BACKENDS:
            if name not in self.impls:
                out[name] = f"{self.op_name} has no {name} backend"
            else:
                out[name] = backend_unavailable_reason(name, device)
        return out

    def choose(self, backend: str, device: torch.device) -> str:
        if backend == "auto":
            if device.type != "cuda":
                return "torch"
            for name in self.preference:
                if name in self.impls and backend_unavailable_reason(name, device) is None:
                    return name
            return "torch"
        if backend not in BACKENDS:
            raise ValueError(f"{self.op_name}: unknown backend {backend!r}; expected 'auto' or one of {BACKENDS}")
        if backend not in self.impls:
            raise BackendUnavailableError(f"{self.op_name} has no {backend!r} backend (it has {sorted(self.impls)})")
        reason = backend_unavailable_reason(backend, device)
        if reason is not None:
            raise BackendUnavailableError(f"{self.op_name}: backend {backend!r} is unavailable: {reason}")
        return backend

    def get(self, name: str) -> Callable:
        fn = self._cache.get(name)
        if fn is None:
            module_name, _, attr = self.impls[name].partition(":")
            fn = getattr(importlib.import_module(module_name), attr)
            self._cache[name] = fn
        return fn

    def resolve(self, backend: str, device: torch.device) -> Tuple[str, Callable]:
        name = self.choose(backend, device)
        return name, self.get(name)


_REGISTRY: Dict[str, OpBackends] = {}


def register_op(op_name: str, impls: Dict[str, str], preference: Sequence[str] = ("cuda", "triton", "torch")) -> OpBackends:
    table = OpBackends(op_name, impls, preference)
    _REGISTRY[op_name] = table
    return table


def available_backends(op_name: Optional[str] = None, device: "torch.device | str" = "cuda") -> Dict:
    """Report which backends can run each op on ``device``: ``{op: {backend: None | reason}}``."""
    device = torch.device(device)
    names = [op_name] if op_name else sorted(_REGISTRY)
    return {name: _REGISTRY[name].available(device) for name in names}
