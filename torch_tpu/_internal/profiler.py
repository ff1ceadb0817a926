"""TorchTPU's `torch.tpu.profiler.TpuProfilerConfig`: an `experimental_config` for `torch.profiler.profile`.

A `torch._C._profiler._ExperimentalConfig` (what `torch.profiler.profile` accepts
there) carrying TorchTPU's device-trace settings, validated. While a profile with
the tpu device activity (the default activities include it) and such a config runs,
XLA's device trace runs too (`jax.profiler`, at the config's host/python tracer
levels; `device_tracer_level=0` turns it off) and is written as XPlane to
`run_dir/plugins/profile/<run>/<host>[_<worker_rank>].xplane.pb` (TensorBoard's
profile plugin, xprof). The CPU/ATen trace and our device rows are recorded as with
any config (torch_tpu/profiler.py).
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
import warnings

from torch._C._profiler import _ExperimentalConfig

__all__ = ["TpuProfilerConfig"]


def _level(name: str, value, top: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
        raise ValueError(f"{name} must be an int in 0..{top}, got {value!r}")
    return value


class TpuProfilerConfig(_ExperimentalConfig):
    def __init__(self, *, host_tracer_level: int = 2, device_tracer_level: int = 1, python_tracer_level: int = 0,
                 run_dir: str | None = None, worker_rank: int | None = None, experimental_options: dict | None = None,
                 check_experimental_options: bool = True):
        super().__init__()
        self.host_tracer_level = _level("host_tracer_level", host_tracer_level, 3)
        self.device_tracer_level = _level("device_tracer_level", device_tracer_level, 1)
        self.python_tracer_level = _level("python_tracer_level", python_tracer_level, 1)
        if worker_rank is not None and (not isinstance(worker_rank, int) or worker_rank < 0):
            raise ValueError(f"worker_rank must be a non-negative int, got {worker_rank!r}")
        if experimental_options is not None and not isinstance(experimental_options, dict):
            raise TypeError(f"experimental_options must be a dict, got {type(experimental_options).__name__}")
        if check_experimental_options and experimental_options:
            raise ValueError(f"unknown experimental_options {sorted(experimental_options)} (pass "
                             "check_experimental_options=False to keep them)")
        self.run_dir = run_dir
        self.worker_rank = worker_rank
        self.experimental_options = dict(experimental_options or {})

    def __repr__(self):
        return (f"TpuProfilerConfig(host_tracer_level={self.host_tracer_level}, "
                f"device_tracer_level={self.device_tracer_level}, python_tracer_level={self.python_tracer_level}, "
                f"run_dir={self.run_dir!r}, worker_rank={self.worker_rank})")


def default_run_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"torch_tpu-profile-{os.geteuid()}")


def _live_config():
    """The TpuProfilerConfig of the profile starting now: the `experimental_config` of a caller's profiler.

    torch.profiler hands the config to C++ (a copy); the Python object is only on the caller's
    stack (torch.autograd.profiler.profile.experimental_config), which starts the session.
    """
    frame = sys._getframe(1)
    while frame is not None:
        config = getattr(frame.f_locals.get("self"), "experimental_config", None)
        if isinstance(config, TpuProfilerConfig):
            return config
        frame = frame.f_back
    return None


_tracing = None  # (config, run_dir, files there before) while an XLA trace we started runs


def _session(start: bool) -> None:
    global _tracing
    if start:
        config = _live_config()
        if config is None or config.device_tracer_level == 0 or _tracing is not None:
            return
        import jax

        run_dir = config.run_dir or default_run_dir()
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = config.host_tracer_level
        options.python_tracer_level = config.python_tracer_level
        before = set(glob.glob(os.path.join(run_dir, "plugins", "profile", "*", "*.xplane.pb")))
        try:
            jax.profiler.start_trace(run_dir, profiler_options=options)
        except RuntimeError as err:  # another XLA trace runs (jax.profiler.trace, torch_tpu.profiler.trace)
            warnings.warn(f"TpuProfilerConfig: XLA's device trace not started ({err})", stacklevel=2)
            return
        _tracing = (config, run_dir, before)
    elif _tracing is not None:
        import jax

        config, run_dir, before = _tracing
        _tracing = None
        jax.profiler.stop_trace()
        if config.worker_rank is not None:  # TorchTPU's name: <host>_<rank>.xplane.pb
            for path in set(glob.glob(os.path.join(run_dir, "plugins", "profile", "*", "*.xplane.pb"))) - before:
                host = os.path.basename(path)[:-len(".xplane.pb")]
                os.replace(path, os.path.join(os.path.dirname(path), f"{host}_{config.worker_rank}.xplane.pb"))


def written(run_dir: str) -> list[str]:
    """The XPlane files under `run_dir` (newest run last)."""
    return sorted(glob.glob(os.path.join(run_dir, "plugins", "profile", "*", "*.xplane.pb")), key=os.path.getmtime)


def _install() -> None:
    from torch_tpu import profiler

    if _session not in profiler.session_hooks:
        profiler.session_hooks.append(_session)


_install()
