"""Argument checks and error types shared by the fake (meta) kernels and the Python API.

The compiled kernels report every error as a RuntimeError whose message reads
`<Kind>: <op>: <what>`, with <Kind> one of IndexError, ValueError or TypeError. `check_tensors` and
`check_args` do the argument, shape, dtype and device checks of the compiled kernels, in the same
order and with the same messages, on real, meta or fake tensors (sizes may be symbolic: nothing here reads a concrete size
unless a check fails). `typed_error` turns such a message into the exception it names, which is
what the public functions raise.
"""
import numbers
import re
from typing import Optional

import torch

OPS = ("scatter_add", "index_add", "gather")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
FLOAT_NAMES = "float32, float64, bfloat16 or float16"
INDEX_DTYPES = (torch.int32, torch.int64)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Names as the compiled kernels print dtypes (c10::ScalarType).
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.bool: "Bool", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble", torch.qint8: "QInt8", torch.quint8: "QUInt8", torch.qint32: "QInt32",
}


def dtype_name(dtype: torch.dtype) -> str:
    """`Float` for torch.float32, `Float8_e4m3fn` for torch.float8_e4m3fn, ..."""
    name = _SCALAR_TYPE_NAMES.get(dtype)
    if name is not None:
        return name
    name = str(dtype).rpartition(".")[2]
    if name.startswith("uint"):
        return "UInt" + name[4:]
    return name[:1].upper() + name[1:]


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check(kind: str, op: str, cond, what) -> None:
    # torch._check_with accepts symbolic conditions (a guard, or a runtime assert when unbacked)
    # and builds the message only when the check fails.
    torch._check_with(RuntimeError, cond, lambda: f"{kind}: {op}: {what()}")


def check_args(op: str, input: torch.Tensor, index: torch.Tensor, src: Optional[torch.Tensor],
               weight: Optional[torch.Tensor]) -> None:
    """The compiled kernels' shape, dtype and device checks (src is None for gather)."""
    V = "ValueError"
    _check(V, op, input.dim() == 2, lambda: f"input must be 2-D [N, D], got shape {_shape(input)}")
    _check(V, op, index.dim() == 1, lambda: f"index must be 1-D [K], got shape {_shape(index)}")
    _check(V, op, index.dtype in INDEX_DTYPES, lambda: f"index must be int32 or int64, got {dtype_name(index.dtype)}")
    _check(V, op, input.dtype in FLOAT_DTYPES, lambda: f"input must be {FLOAT_NAMES}, got {dtype_name(input.dtype)}")
    _check(V, op, index.device == input.device, lambda: f"index is on {index.device} but input is on {input.device}")
    k = index.shape[0]
    if src is not None:
        _check(V, op, src.dim() == 2, lambda: f"src must be 2-D [K, D], got shape {_shape(src)}")
        _check(V, op, src.dtype == input.dtype,
               lambda: f"src dtype {dtype_name(src.dtype)} does not match input dtype {dtype_name(input.dtype)}")
        _check(V, op, src.device == input.device, lambda: f"src is on {src.device} but input is on {input.device}")
        _check(V, op, src.shape[0] == k, lambda: f"src has {src.shape[0]} rows but index has {k} entries")
        _check(V, op, src.shape[1] == input.shape[1],
               lambda: f"src has {src.shape[1]} columns but input has {input.shape[1]}")
    if weight is not None:
        _check(V, op, weight.dim() == 1 and weight.shape[0] == k,
               lambda: f"weight must be 1-D with {k} entries (one per index), got shape {_shape(weight)}")
        _check(V, op, weight.dtype in FLOAT_DTYPES,
               lambda: f"weight must be {FLOAT_NAMES}, got {dtype_name(weight.dtype)}")
        _check(V, op, weight.device == input.device,
               lambda: f"weight is on {weight.device} but input is on {input.device}")


def check_tensors(op: str, input, index, src=None, has_src: bool = False) -> None:
    """The compiled kernels' first check: None given for a tensor argument (weight may be None) is
    refused as `TypeError: <op>: <name> must be a tensor, got None`, before anything reads it."""
    for name, t in (("input", input), ("index", index)) + ((("src", src),) if has_src else ()):
        if t is None:
            raise RuntimeError(f"TypeError: {op}: {name} must be a tensor, got None")


def _type_name(x) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_types(op: str, **tensors) -> None:
    """TypeError naming the first argument that is not a tensor (weight may be None)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name == "weight"):
            raise TypeError(f"{op}: {name} must be a torch.Tensor{' or None' if name == 'weight' else ''}, "
                            f"got {_type_name(t)}")


def ignore_index_arg(op: str, value) -> int:
    """ignore_index as a Python int in the int64 range (numpy integers accepted)."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{op}: ignore_index must be an int or None, got {value!r}")
        value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{op}: ignore_index must be in the int64 range [-2**63, 2**63 - 1], got {value}")
    return value


def lnc_arg(op: str, value) -> None:
    """lnc: a positive int or None (numpy integers accepted); no effect off Neuron."""
    if value is None or (type(value) is int and value > 0):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: lnc must be a positive int (logical NeuronCores), got {value!r}")
    if value <= 0:
        raise ValueError(f"{op}: lnc must be a positive int (logical NeuronCores), got {value!r}")


_TAG = re.compile(r"(?:^|, )(IndexError|ValueError|TypeError): ([^\n]*)")
_TYPES = {"IndexError": IndexError, "ValueError": ValueError, "TypeError": TypeError}


def typed_error(op: str, e: BaseException) -> Optional[BaseException]:
    """The exception the Python API raises for the error `e` of a kernel call made for `op`:
    a tagged RuntimeError becomes the exception its tag names, with the message after the tag;
    an IndexError / ValueError / TypeError is kept. A message naming another of our ops (as
    index_add under scatter_add with autograd) is renamed to `op`. None for anything else (an
    untagged RuntimeError: pass it through unchanged)."""
    if isinstance(e, RuntimeError):
        m = _TAG.search(str(e))
        if m is None:
            return None
        cls, msg = _TYPES[m.group(1)], m.group(2)
    elif type(e) in (IndexError, ValueError, TypeError):
        cls, msg = type(e), str(e)
    else:
        return None
    callee, sep, rest = msg.partition(": ")
    if sep and callee in OPS and callee != op:
        msg = f"{op}: {rest}"
    if type(e) is cls and msg == str(e):
        return e
    return cls(msg)
