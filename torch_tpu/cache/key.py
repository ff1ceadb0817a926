"""Fingerprints: the keys of the compile cache.

Two keys, both SHA-256 hex digests that also cover the environment a
compiled program depends on (platform and its version, device kind and id,
jax/jaxlib/torch/torch_tpu versions, XLA flags, the JAX settings that change
lowerings):

- executable key: the lowered StableHLO text plus the compile options. Equal
  text means an equal program, whoever lowered it (strict executor,
  defer-and-fuse, torch.compile).
- program key: the strict executor's signature (op, dtypes, sizes, strides,
  static arguments, ...) plus a hash of torch_tpu's own source files. It
  records which executable a signature lowers to, so a warm process skips
  tracing and lowering as well as compiling. Only for programs built from
  torch_tpu's lowerings and JAX: code outside the package (a user's lowering)
  could change without changing this key.

The device id is part of both keys: XLA bakes the device assignment into an
executable (JAX's own persistent cache keys by it too, except on GPU).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib

from torch_tpu import xla_options

FORMAT = 1  # bump when the entry layout or key recipe changes

# JAX settings that change what a traced function lowers to.
_JAX_SETTINGS = (
    "jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion",
    "jax_default_prng_impl", "jax_threefry_partitionable",
)
_ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")

_code_hash: str | None = None
_environments: dict = {}


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def code_hash() -> str:
    """SHA-256 of torch_tpu's Python and C++ sources (computed once per process)."""
    global _code_hash
    if _code_hash is None:
        root = pathlib.Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for path in sorted(p for pattern in ("*.py", "*.cpp") for p in root.rglob(pattern)):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes())
        _code_hash = h.hexdigest()
    return _code_hash


def environment(device) -> str:
    """A digest of everything outside the program that its executable depends on."""
    env = _environments.get(device)
    if env is None:
        import jax
        import torch

        import torch_tpu

        settings = tuple((name, repr(getattr(jax.config, name, None))) for name in _JAX_SETTINGS)
        env = _environments[device] = _digest(
            FORMAT, device.platform, device.client.platform_version, device.device_kind, device.id,
            jax.__version__, _version("jaxlib"), torch.__version__, torch_tpu.__version__,
            tuple(os.environ.get(name, "") for name in _ENV_FLAGS), settings,
        )
    return env


def executable_key(hlo_text: str, device, options=()) -> str:
    """The key of the executable compiled from `hlo_text` for `device` with compile `options`."""
    return _digest("executable", environment(device), tuple(options), hlo_text.encode())


def program_key(signature, device) -> str:
    """The key of a strict-executor signature (a tuple of ops, dtypes, types, ints, strings).

    XLA options other than the defaults (torch_tpu.xla_options) are part of it: they change the executable.
    """
    return _digest("program", environment(device), code_hash(), signature, *xla_options.key())
