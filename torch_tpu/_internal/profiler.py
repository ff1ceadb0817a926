"""TorchTPU's `torch.tpu.profiler.TpuProfilerConfig`: an `experimental_config` for `torch.profiler.profile`.

A `torch._C._profiler._ExperimentalConfig` (what `torch.profiler.profile`
accepts there) that carries TorchTPU's device-trace settings, validated.
Device traces (XLA's XPlane files in `run_dir`) are the profiler issue's
(torch_tpu/profiler.py, issue 12): this class only holds the settings, and
`torch.profiler.profile(experimental_config=...)` records the CPU/ATen trace
as with any config.
"""
from __future__ import annotations

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
