"""An accelerator on the CPU: which tensors a run would put on the device, which of them it mixes with host tensors, and
how often the host waits for one.

``StandInDevice`` is a ``torch.overrides.TorchFunctionMode``. Inside it the given modules' parameters and buffers
are *on the device*, and so is every tensor computed from one, created with ``device=`` the stand-in device (which is
what ``.device`` of a device tensor, and so ``model.device``, reports: ``cpu:0``), or moved there with ``.to``. Every
other tensor is a host tensor. The mode then does on the CPU what CUDA does to a program:

- an op that mixes device tensors with host tensors of one element or more (0-d host tensors are scalars, which CUDA
  accepts; indexing with host indices and copies across are allowed) is a *violation*, as CUDA's "Expected all
  tensors to be on the same device" error would be;
- a random op whose generator is not on the device of the tensor it draws (``torch.Generator()`` is a host
  generator; ``torch.Generator(device=model.device)`` a device one) is a violation, as CUDA's "Expected a 'cuda'
  device type for generator" would be;
- every read of a device tensor's value by the host (``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()``,
  ``__index__``, ``torch.equal``, ``.cpu()`` / ``.to("cpu")``, ``.numpy()``, printing, and the ops whose output size
  depends on the data: ``nonzero``, a boolean mask index, ``masked_select``, ``unique``) is a *sync*: on a GPU the
  host waits there for every queued kernel; every copy of host data to the device (``torch.tensor(..., device=)``,
  ``.to(device)``) an *upload* (on CUDA a pageable copy also waits for the stream, but seldom for long: the host has
  usually just synced).

Counts and violations are kept per label (``mode.label = "draft"``), each violation with the project line it came
from. The code under test must not know it is watched: this is how ``tests/verify/test_device.py`` checks device
placement and ``benchmarks/bench_syncs.py`` counts host syncs per decode step, without a GPU.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

STAND_IN = torch.device("cpu", 0)
_DEVICE, _DATA = torch._C.TensorBase.device, torch._C.TensorBase.data  # the descriptors whose __get__ / __set__ matter
PROJECT = str(Path(__file__).resolve().parents[1])

_FACTORIES = set(
    "tensor as_tensor arange zeros ones full empty rand randn randint randperm linspace logspace eye empty_strided scalar_tensor "
    "tril_indices triu_indices".split()
)
_RANDOM = set(
    "rand randn randint randperm multinomial bernoulli normal uniform_ normal_ exponential_ random_ bernoulli_ geometric_ "
    "cauchy_ log_normal_ rand_like randn_like randint_like poisson".split()
)
#: reads of a value by the host, and the ops whose output's size is the data's: on a GPU the host waits for the stream
_HOST_READS = set(
    "item tolist numpy __bool__ __int__ __float__ __index__ __format__ __repr__ __str__ __array__ nonzero masked_select "
    "unique equal argwhere nonzero_static".split()
)
_CROSSING = set("__getitem__ __setitem__ copy_ to cpu cuda type index_put_ index_put".split())  # CUDA lets these mix devices
_QUIET = set(
    "__get__ __set__ dim size numel is_floating_point _parse_to _set_grad_enabled is_complex _has_compatible_shallow_copy_type "
    "stride data_ptr storage_offset is_contiguous element_size requires_grad_ _is_view untyped_storage __len__ __hash__".split()
)


class StandInDevice(TorchFunctionMode):
    """Run code as if ``modules`` sat on an accelerator; collect ``violations``, ``syncs`` and ``uploads`` per label.

    Args:
        modules: the models (target, draft, heads) whose parameters and buffers are on the device.
        record_stacks: keep the project line of every sync too (``sync_sites``), for finding them.
    """

    def __init__(self, *modules: nn.Module, record_stacks: bool = False):
        super().__init__()
        self.device_tensors = WeakIdKeyDictionary()
        self.device_generators = WeakIdKeyDictionary()
        self.label = "all"
        self.syncs: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()
        self.violations: list[str] = []
        self.sync_sites: Counter[str] = Counter()
        self.record_stacks = record_stacks
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                self.device_tensors[tensor] = True
        self._generator = None

    # -- entering and leaving: torch.Generator reports where each generator was made ----------

    def __enter__(self):
        mode, real = self, torch.Generator
        self._generator = real

        class Generator(real):
            def __new__(cls, device="cpu"):
                generator = real.__new__(cls, device)
                if _is_stand_in(device):
                    mode.device_generators[generator] = True
                return generator

        torch.Generator = Generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = self._generator
        return super().__exit__(*exc)

    # -- the rules ---------------------------------------------------------------------------

    def on_device(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self.device_tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        descriptor = getattr(func, "__self__", None)
        if descriptor is _DEVICE and name == "__get__":
            return STAND_IN if self.on_device(args[0]) else torch.device("cpu")
        if name in _QUIET:
            result = func(*args, **kwargs)
            if descriptor is _DATA and name == "__set__" and self.on_device(args[1]):  # Module.to swaps a parameter's data
                self.device_tensors[args[0]] = True
            return result
        inputs = _tensors((args, kwargs))
        device_inputs = [t for t in inputs if self.on_device(t)]
        target = _device_argument(name, args, kwargs)
        other = _to_other(name, args)
        if other is not None:
            target = STAND_IN if self.on_device(other) else torch.device("cpu")
        result = func(*args, **kwargs)
        on_device = self._result_on_device(name, args, device_inputs, target)
        if not on_device and device_inputs and any(result is t for t in device_inputs):
            result = result.clone()  # .cpu() of a CPU tensor is the tensor itself: the host's copy must be another
        self._check(name, inputs, device_inputs, kwargs, on_device)
        self._count(name, args, device_inputs, target, on_device)
        if on_device:
            for tensor in _tensors(result):
                self.device_tensors[tensor] = True
        return result

    def _result_on_device(self, name, args, device_inputs, target) -> bool:
        if target is not None:  # a device named: a factory, .to(device), new_* / *_like with device=
            return _is_stand_in(target)
        if name in _FACTORIES:
            return name == "as_tensor" and bool(device_inputs)  # as_tensor(t) is t
        return bool(device_inputs)

    def _check(self, name, inputs, device_inputs, kwargs, on_device) -> None:
        host = [t for t in inputs if not self.on_device(t) and t.dim() > 0]
        if device_inputs and host and name not in _CROSSING:
            self._violate(f"{name} mixes device tensors with host tensors of shape {[tuple(t.shape) for t in host]}")
        generator = kwargs.get("generator")
        if generator is not None and name in _RANDOM:
            if (generator in self.device_generators) != on_device:
                where = "device" if on_device else "host"
                self._violate(f"{name} draws a {where} tensor with a {'device' if not on_device else 'host'} generator")

    def _count(self, name, args, device_inputs, target, on_device) -> None:
        reads = name in _HOST_READS or (name in ("to", "cpu") and target is not None and not _is_stand_in(target))
        if name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _tensors(args[1:])):
            reads = True  # a boolean mask: the output's size is the data's
        if reads and device_inputs:
            self.syncs[self.label] += 1
            if self.record_stacks:
                self.sync_sites[f"{name} at {_project_line()}"] += 1
        elif on_device and (name in ("tensor", "as_tensor") or (name == "to" and not device_inputs)):
            self.uploads[self.label] += 1

    def _violate(self, message: str) -> None:
        self.violations.append(f"[{self.label}] {message} at {_project_line()}")


def _is_stand_in(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.Tensor):
        return False
    try:
        return torch.device(device) == STAND_IN
    except (TypeError, RuntimeError):
        return False


def _device_argument(name: str, args, kwargs):
    """The device an op names for its result (a factory's ``device=``, ``.to(device)``), or None."""
    if "device" in kwargs:
        return kwargs["device"]
    if name == "to":
        for arg in args[1:]:
            if isinstance(arg, (torch.device, str)):
                return arg
            if isinstance(arg, torch.Tensor):
                return None  # .to(other): the other's device, followed by the inputs rule
    if name == "cpu":
        return torch.device("cpu")
    return None


def _to_other(name: str, args):
    """For ``a.to(b)`` with a tensor ``b``: ``b``; else None."""
    if name == "to":
        return next((arg for arg in args[1:] if isinstance(arg, torch.Tensor)), None)
    return None


def _tensors(tree) -> list[torch.Tensor]:
    found = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def _project_line() -> str:
    """The innermost frame of this repository outside this file: where the op came from."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(PROJECT) and not frame.filename.endswith("device_mode.py"):
            return f"{Path(frame.filename).relative_to(PROJECT)}:{frame.lineno}"
    return "outside the project"
