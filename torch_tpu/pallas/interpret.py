"""Where Pallas kernels compile natively and where they run in interpret mode.

Pallas lowers natively for TPU (Mosaic) and GPU (Triton / Mosaic GPU); XLA:CPU
has no Pallas compiler. A `pl.pallas_call` traced inside a `jax_op` on a CPU
platform therefore runs in Pallas interpret mode: the kernel body becomes plain
HLO (a loop over the grid) inside the same program, so it still fuses with the
ops around it. `TORCH_TPU_PALLAS_INTERPRET` chooses: `auto` (default:
interpret where the platform cannot compile Pallas), `1` (always), `0` (never:
a CPU run then fails with Pallas's own error), `tpu` (always, with Pallas's TPU
interpreter, which also simulates TPU memory spaces, DMAs and semaphores; it
uses host callbacks, so programs using it are not stored in the compile cache's
persistent levels).

Owns: that decision, its one-time notice and the `pallas_interpret` counter (operator shapes whose
Pallas kernels run interpreted).
"""
from __future__ import annotations

import contextlib
import logging

from torch_tpu import metrics
from torch_tpu.config import config

_log = logging.getLogger("torch_tpu.pallas")
_NATIVE = ("tpu", "gpu", "cuda", "rocm")
_noticed = False


def platform_name() -> str:
    from torch_tpu.runtime import platform

    return platform.get().platform


def mode() -> str | None:
    """None (compile natively), "hlo" (interpret as HLO) or "tpu" (Pallas's TPU interpreter)."""
    setting = config.pallas_interpret
    if setting == "tpu":
        return "tpu"
    if setting in ("1", "true", "yes", "on"):
        return "hlo"
    if setting in ("0", "false", "no", "off"):
        return None
    return None if platform_name() in _NATIVE else "hlo"


def native() -> bool:
    """Whether Pallas kernels compile natively on this platform (what kernel routing asks)."""
    return mode() is None


def uses_pallas(jaxpr) -> bool:
    """Whether a (closed) jaxpr calls a Pallas kernel, looking into nested jaxprs (jit, cond, scan...)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in getattr(inner, "eqns", ()):
        if eqn.primitive.name == "pallas_call":
            return True
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                    if uses_pallas(v):
                        return True
    return False


def note(name: str) -> None:
    """An operator calling a Pallas kernel got a new shape here: count it; say once that kernels are interpreted."""
    if mode() is None:
        return
    global _noticed
    metrics.counts.pallas_interpret += 1
    if not _noticed:
        _noticed = True
        _log.warning("Pallas kernels run in interpret mode on the %r platform (first: %s): correct but slow; "
                     "they compile natively on TPU and GPU. TORCH_TPU_PALLAS_INTERPRET=0 turns this off.",
                     platform_name(), name)


@contextlib.contextmanager
def interpreting(name: str):
    """Trace a kernel function under the chosen Pallas mode (a no-op where Pallas compiles natively)."""
    chosen = mode()
    if chosen is None:
        yield
        return
    from jax.experimental.pallas import tpu as pltpu

    # NOTE(jax 0.10): pallas_call reads this setting when it is bound; True selects the HLO
    # interpreter, an InterpretParams the TPU interpreter.
    params = pltpu.InterpretParams() if chosen == "tpu" else True
    with pltpu.force_tpu_interpret_mode(params):
        yield
