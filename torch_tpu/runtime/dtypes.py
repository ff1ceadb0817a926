"""torch <-> JAX/NumPy dtype mapping and the per-platform dtype policy."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import torch

_TORCH_TO_NUMPY = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    torch.float8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
    torch.float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}

# torch dtypes that torch.Tensor.numpy() cannot express (NumPy gets them from ml_dtypes).
_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
             torch.float8_e8m0fnu}

# NOTE(torch-vs-xla): TPUs have no 64-bit floats; XLA:CPU and XLA:GPU do.
_UNSUPPORTED = {"tpu": {torch.float64, torch.complex128}}


def to_numpy(dtype: torch.dtype) -> np.dtype:
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        # PyTorch's own wording for a backend without the dtype (MPS's); complex32 has no XLA type.
        raise TypeError(f"Trying to convert {dtype} to the tpu backend but it does not have support for that "
                        f"dtype") from None


to_jax = to_numpy  # JAX accepts NumPy (and ml_dtypes) dtypes directly


def cast(value, dtype):
    """`value.astype(dtype)` with PyTorch's complex-to-real rule: the real part (bool: nonzero), where
    JAX's astype warns that it will refuse such casts."""
    import jax.numpy as jnp

    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = value != 0 if jnp.dtype(dtype) == jnp.bool_ else jnp.real(value)
    dtype = jnp.dtype(dtype)
    if dtype != value.dtype and dtype == _E4M3FN:
        # c10 saturates to +-448 (infinities included; NaN stays NaN) where XLA's convert gives NaN
        if not jnp.issubdtype(value.dtype, jnp.floating) or value.dtype.itemsize < 4:
            value = value.astype(jnp.float32)  # exact for every narrower float; integers convert as c10 does
        return jnp.where(jnp.isnan(value), value, jnp.clip(value, -448, 448)).astype(dtype)
    if dtype != value.dtype and dtype == _E8M0FNU:
        return _to_e8m0fnu(value)
    return value.astype(dtype)


_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0FNU = np.dtype(ml_dtypes.float8_e8m0fnu)


def _to_e8m0fnu(value):
    """c10's float -> float8_e8m0fnu: the float32 value's exponent field (the sign is dropped), one up when the
    first dropped mantissa bit is set (subnormals: when the mantissa is past half); NaN and inf give NaN (0xff).
    XLA's convert gives NaN for zero and negatives instead."""
    import jax.numpy as jnp
    from jax import lax

    bits = lax.bitcast_convert_type(value.astype(jnp.float32), jnp.uint32)  # c10 converts through float too
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = jnp.where(exponent == 0, mantissa > 0x400000, (mantissa >> 22) == 1)
    out = jnp.where(exponent == 0xFF, exponent, exponent + up.astype(jnp.uint32))
    return lax.bitcast_convert_type(out.astype(jnp.uint8), _E8M0FNU)


def to_torch(dtype) -> torch.dtype:
    return _NUMPY_TO_TORCH[np.dtype(dtype)]


@functools.cache
def check_supported(dtype: torch.dtype, platform: str) -> None:
    """Raise a clear TypeError for a dtype the platform cannot hold."""
    to_numpy(dtype)
    if dtype in _UNSUPPORTED.get(platform, ()):
        raise TypeError(
            f"dtype {dtype} is not supported on the '{platform}' platform backing device 'tpu' "
            f"(TPUs have no 64-bit floating point); use torch.float32 or torch.bfloat16"
        )


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a NumPy array of the matching dtype (no copy)."""
    np_dtype = to_numpy(t.dtype)
    if t.dtype in _NO_NUMPY:
        raw = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
        return raw.numpy().view(np_dtype).reshape(t.shape)
    return t.numpy()


def numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    """A NumPy array as a CPU tensor (shares memory when it can)."""
    dtype = to_torch(a.dtype)
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C", copy=True)  # (np.ascontiguousarray would turn 0-d into 1-d)
    if dtype in _NO_NUMPY:
        flat = torch.from_numpy(a.reshape(-1).view(np.uint8))
        return flat.view(dtype).reshape(a.shape)
    return torch.from_numpy(a)


# PyTorch's names of dtypes as its C++ messages print them: the C++ type, and the ScalarType.
_CPP_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
              torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
              torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>"}
_SCALAR_TYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                 torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                 torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def cpp_name(dtype: torch.dtype) -> str:
    """"long int" for torch.int64, as in "expects exponent to have int dtype but got long int"."""
    return _CPP_NAMES.get(dtype, str(dtype))


def scalar_type_name(dtype: torch.dtype) -> str:
    """"Long" for torch.int64, as in "self.dtype = Float and out.dtype = Long"."""
    return _SCALAR_TYPES.get(dtype, str(dtype))


def not_implemented(kernel: str, dtype: torch.dtype) -> NotImplementedError:
    """ATen's dispatch error for a dtype a kernel has no case for: "bincount_tpu" not implemented for 'Float'."""
    return NotImplementedError(f"\"{kernel}\" not implemented for '{scalar_type_name(dtype)}'")
