"""Names of dtype objects from torch and numpy (incl. ml_dtypes), without
importing either framework unless the object comes from it."""

from __future__ import annotations

from typing import Any, Optional


def dtype_name(obj: Any) -> Optional[str]:
    """Returns the canonical name of a dtype-like object ("bfloat16",
    "float8_e4m3fn", ...), or None when `obj` is not a dtype.

    Accepts strings, torch dtypes (torch.bfloat16), numpy dtypes and scalar
    types (np.float16, np.dtype("float16"), ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn)."""
    if isinstance(obj, str):
        return obj
    if obj is None:
        return None
    mod = type(obj).__module__ or ""
    if mod.startswith("torch"):
        s = str(obj)  # "torch.bfloat16"
        return s[len("torch."):] if s.startswith("torch.") else s
    # numpy dtype instances, numpy scalar types and ml_dtypes scalar types
    np = _numpy()
    if np is not None:
        try:
            return np.dtype(obj).name
        except TypeError:
            pass
    name = getattr(obj, "name", None)
    if isinstance(name, str):
        return name
    return None


def _numpy():
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy
