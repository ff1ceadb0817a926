"""Value checks inside lowerings: the error flag a program computes beside its result.

PyTorch checks some arguments by their *values* (an index out of range, a
target past the last class, a negative probability). XLA cannot raise from a
program, and a program that waited for its values before running would block
every op. So a lowering states what must hold (`require`); the op's program
computes a small flag beside its results, and the executor checks it at the
next materialization point (eager/valuecheck.py), as CUDA surfaces a
device-side assertion at the next synchronization.

A flag is int64[4]: (code, offending value, dimension, size); code 0 means
every check passed, otherwise it names one entry of `ERRORS` (the exception
type and PyTorch's message). Codes are fixed here, not numbered at trace time,
so an executable loaded from the compile cache by another process reports the
same errors.

`require` does nothing unless a program is being traced for an executor that
collects flags (`collecting`): lowerings stay pure JAX functions, and a trace
for another consumer (torch.compile) sees no flag.

Owns: the error codes, `require`, collecting and combining flags. Does not own:
checking flags or raising (eager/valuecheck.py), which lowerings check (the
`@checked` marks in ops/).
"""
from __future__ import annotations

import contextlib
import struct
import threading
import zlib

import jax
import jax.numpy as jnp

FLAG_SIZE = 4

# code -> (exception type, PyTorch's message; {value}, {dim}, {size} come from the flag)
ERRORS = {
    1: (IndexError, "index out of range in self"),
    2: (IndexError, "index {value} is out of bounds for dimension {dim} with size {size}"),
    3: (RuntimeError, "index {value} is out of bounds for dimension {dim} with size {size}"),
    4: (IndexError, "Target {value} is out of bounds."),
    5: (IndexError, "out of range: tried to access index {value} on a tensor of {size} elements."),
    6: (RuntimeError, "probability tensor contains either `inf`, `nan` or element < 0"),
    7: (RuntimeError, "invalid multinomial distribution (sum of probabilities <= 0)"),
    8: (RuntimeError, "Expected p_in >= 0 && p_in <= 1 to be true, but got false.  (Could this error message be "
                      "improved?  If so, please report an enhancement request to PyTorch.)"),
    9: (RuntimeError, "Class values must be smaller than num_classes."),
    10: (RuntimeError, "Class values must be non-negative."),
    11: (IndexError, "index_copy_(): index {value} is out of bounds for dimension {dim} with size {size}"),
    12: (RuntimeError, "Index {dim} of input takes value {value} which is not in the valid range [0, {size})"),
    16: (RuntimeError, "torch.histc: range of [{fvalue:g}, {fsize:g}] is not finite"),
    17: (RuntimeError, "torch.searchsorted(): sorter index out of range"),
    18: (RuntimeError, "repeats can not be negative"),
    19: (RuntimeError, "normal expects all elements of std >= 0.0"),
    21: (RuntimeError, "Number of elements of source < number of ones in mask"),
}
INDEX_IN_SELF, INDEX_BOUNDS, GATHER_BOUNDS, TARGET, TAKE = 1, 2, 3, 4, 5
MULTINOMIAL_INVALID, MULTINOMIAL_SUM, BERNOULLI, ONE_HOT_BIG, ONE_HOT_NEGATIVE = 6, 7, 8, 9, 10
INDEX_COPY, EMBEDDING_BAG = 11, 12  # 13, 14 and 20 were checks of Python scalars, now made on the host
# PyTorch's `_linalg_check_errors` (a LAPACK-style info != 0): the exception is PyTorch's own, made by
# that op on the host from the flag (`linalg_api` names the API; see `_linalg_error`).
LINALG = 15
HISTC_RANGE, SORTER_RANGE, NEGATIVE_REPEATS, NORMAL_STD, MASKED_SCATTER_SOURCE = 16, 17, 18, 19, 21
_linalg_apis: dict[int, str] = {}

_state = threading.local()


def checked(fn):
    """Mark a lowering that calls `require`: its programs carry a flag (see program.py)."""
    fn.value_checks = True
    return fn


def declares(fn) -> bool:
    return getattr(fn, "value_checks", False)


@contextlib.contextmanager
def collecting():
    """Collect the flags `require` makes while tracing one op's lowering; yields the list."""
    previous = getattr(_state, "flags", None)
    flags = _state.flags = []
    try:
        yield flags
    finally:
        _state.flags = previous


def require(ok, code: int, value=None, dim: int = 0, size: int = 0) -> None:
    """State that every element of `ok` holds; otherwise the op fails with error `code`.

    `value` (broadcast to `ok`'s shape) gives the offending value reported for the first failing
    element; `dim` and `size` fill the message.
    """
    flags = getattr(_state, "flags", None)
    if flags is None:
        return
    ok = jnp.asarray(ok)
    if ok.size == 0:
        return
    bad = ~ok.reshape(-1)
    first = jnp.argmax(bad)
    offending = jnp.zeros((), jnp.int64) if value is None else (
        jnp.broadcast_to(jnp.asarray(value), ok.shape).reshape(-1)[first].astype(jnp.int64))
    flag = jnp.stack([jnp.asarray(code, jnp.int64), offending, jnp.asarray(dim).astype(jnp.int64),
                      jnp.asarray(size).astype(jnp.int64)])
    flags.append(jnp.where(jnp.any(bad), flag, jnp.zeros((FLAG_SIZE,), jnp.int64)))


def require_index(index, size: int, code: int, dim: int = 0, negative: bool = False) -> None:
    """Indices in [0, size) (or [-size, size) with `negative`)."""
    index = jnp.asarray(index)
    low = -size if negative else 0
    require((index >= low) & (index < size), code, index, dim, size)


def float_bits(x):
    """A float64 value carried in a flag's int64 value field (shown with {fvalue})."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float64), jnp.int64)


def linalg_api(api_name: str, is_matrix: bool) -> int:
    """A flag's `size` field for `_linalg_check_errors(info, api_name, is_matrix=...)`: a hash of the name
    (remembered here, so a process that plans the graph can name it again) and the is_matrix bit."""
    code = zlib.crc32(api_name.encode()) & 0x3FFFFFFF
    _linalg_apis[code] = api_name
    return code * 2 + int(is_matrix)


def _linalg_error(info: int, index: int, api: int) -> Exception | None:
    """PyTorch's exception for the first nonzero info (`index`: its position among the batch's infos)."""
    import torch

    is_matrix = bool(api & 1)
    infos = torch.zeros(() if is_matrix else (index + 1,), dtype=torch.int32)
    infos.view(-1)[-1] = info
    try:
        torch.ops.aten._linalg_check_errors(infos, _linalg_apis.get(api >> 1, "torch.linalg"), is_matrix=is_matrix)
    except Exception as err:  # noqa: BLE001  (the exception is the result)
        return err
    return None


def combine(flags: list):
    """One flag for a program: the first failed check's, or zeros."""
    out = jnp.zeros((FLAG_SIZE,), jnp.int64)
    for flag in reversed(flags):
        out = jnp.where(flag[0] != 0, flag, out)
    return out


def error(flag) -> Exception | None:
    """The exception a host copy of a flag stands for (None if it passed)."""
    code, value, dim, size = (int(v) for v in flag)
    if code == 0:
        return None
    if code == LINALG:
        return _linalg_error(value, dim, size)
    kind, template = ERRORS.get(code, (RuntimeError, "value check {value} failed"))
    def as_float(bits):  # a value carried by float_bits
        return struct.unpack("<d", struct.pack("<q", bits))[0]

    return kind(template.format(value=value, dim=dim, size=size, fvalue=as_float(value), fsize=as_float(size)))
