"""Strict vs DeferAndFuse: a GPT training step and an MLP training step, speed and peak memory.

Models (AdamW, float32 parameters; the float32 matmul precision, the default unless
--precision says otherwise, is printed with the results):
  gpt  the demo GPT (examples/gpt.py): 4 layers, d_model 256, 4 heads, seq 128, batch 8
  mlp  256 -> 1024 -> 1024 -> 10 with GELU, batch 64
  gpt-small  the same GPT at 4 layers, d_model 64, seq 32, batch 8: per-op overhead
             dominates (the regime of a real accelerator), not XLA:CPU's matmuls

Speed: both modes run in this process in interleaved rounds after a warm-up
(compilation is not counted), so a shared, noisy machine slows both alike;
the median step time per mode and their ratio are reported. Only ratios from
one run mean something. A round waits for the device at both ends, so its last
step's device work overlaps no Python (in a training loop it overlaps the next
step's); 8 steps per round keep that edge small. Process CPU time per step is
reported too: on an oversubscribed machine wall time also depends on how many
threads a mode keeps runnable (Strict keeps the Python thread dispatching while
XLA runs), while CPU time measures the work each mode does, also split by thread
group (main Python thread, XLA's compute threads, autograd engine, other: see
_thread_cpu).

Peak memory: every (model, mode) runs again in a fresh subprocess, where every
compiled program (through program.compile_function, both modes) is wrapped to
run one at a time, in program order:
  buffers_temp_peak  the maximum, over program runs, of the bytes of all live
                device arrays (inputs and outputs of the run included) plus the
                program's XLA temporary space (memory_analysis()): the device
                memory curve a synchronous device would see. Deterministic.
  device_peak   XLA's own peak_bytes_in_use (jax.Device.memory_stats()) where
                the platform reports it (TPU, GPU); None on XLA:CPU.
  rss_peak      on XLA:CPU device buffers live in host memory: the peak resident
                set size during the measured steps above the resident size before
                them (VmHWM reset through /proc/self/clear_refs; glibc's mmap
                threshold fixed at 64 KiB so freed buffers return to the OS).
                Counts everything the process touches; on a shared machine it
                jumps by tens of MiB between identical runs (allocator caching).
  storage_peak  torch.tpu.max_memory_allocated() over the measured steps: bytes
                of live tpu storages. DeferAndFuse counts a storage whose value
                is pending although it has no device buffer, so this is not
                where its saving shows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import torch_tpu  # noqa: E402
from torch_tpu import metrics, recompiles  # noqa: E402

MODES = ("strict", "defer_and_fuse")


def _gpt(block_size=128, n_embd=256):
    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, block_size=block_size, n_layer=4, n_head=4, n_embd=n_embd)
    model = GPT(config)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (8, config.block_size), generator=g)
    y = torch.randint(0, config.vocab_size, (8, config.block_size), generator=g)
    return model, (x, y), lambda m, batch: m(*batch)[1]


def _mlp():
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 10),
    )
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g))
    return model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


MODELS = {"gpt": _gpt, "mlp": _mlp, "gpt-small": lambda: _gpt(block_size=32, n_embd=64)}


class Trainer:
    """One model on "tpu" with its optimizer; `step()` is one training step ending in loss.item()."""

    def __init__(self, name: str):
        torch.manual_seed(0)
        model, batch, loss_fn = MODELS[name]()
        self.model = model.to("tpu")
        self.batch = tuple(t.to("tpu") for t in batch)
        self.loss_fn = loss_fn
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, self.batch)
        loss.backward()
        self.opt.step()
        return loss.item()  # the materialization point of the step


THREADS = ("main", "xla", "autograd", "other")


def _thread_cpu() -> dict:
    """CPU seconds so far per thread group (Linux /proc; empty elsewhere).

    main: the Python thread running the model (dispatch or recording, flushes); xla: XLA's
    compute threads (on XLA:CPU, the device); autograd: the autograd engine's threads (backward
    ops); other: the rest, e.g. the PJRT runtime's threads that launch programs.
    """
    import threading

    main, groups = str(threading.get_native_id()), dict.fromkeys(THREADS, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended
            continue
        group = ("main" if tid == main else "xla" if name.startswith("tf_XLA")
                 else "autograd" if name.startswith("pt_autograd") else "other")
        groups[group] += (int(fields[11]) + int(fields[12])) / tick
    return groups


def _timed(trainer: Trainer, mode: str, steps: int) -> tuple[float, float, dict]:
    """(wall seconds, process CPU seconds, {thread group: CPU seconds}) per step."""
    torch_tpu.set_execution_mode(mode)
    torch.tpu.synchronize()
    start, cpu, threads = time.perf_counter(), time.process_time(), _thread_cpu()
    for _ in range(steps):
        trainer.step()
    torch.tpu.synchronize()  # the steps' device work is done (loss.item() waits for the loss only)
    elapsed, cpu = (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps
    threads = {group: (seconds - threads[group]) / steps for group, seconds in _thread_cpu().items()}
    torch_tpu.set_execution_mode("strict")
    return elapsed, cpu, threads


def speed(name: str, steps: int, rounds: int, warmup: int) -> dict:
    trainers = {mode: Trainer(name) for mode in MODES}
    for mode in MODES:
        _timed(trainers[mode], mode, warmup)
    compiled = metrics.counts.programs_compiled
    times = {mode: [] for mode in MODES}
    cpu = {mode: [] for mode in MODES}
    threads = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            wall, work, by_thread = _timed(trainers[mode], mode, steps)
            times[mode].append(wall)
            cpu[mode].append(work)
            threads[mode].append(by_thread)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    cpu_median = {mode: statistics.median(values) for mode, values in cpu.items()}
    return {
        "strict_ms": median["strict"] * 1e3,
        "defer_ms": median["defer_and_fuse"] * 1e3,
        "speedup": median["strict"] / median["defer_and_fuse"],
        "strict_cpu_ms": cpu_median["strict"] * 1e3,
        "defer_cpu_ms": cpu_median["defer_and_fuse"] * 1e3,
        "cpu_ratio": cpu_median["strict"] / cpu_median["defer_and_fuse"],
        "thread_cpu_ms": {  # per thread group (see _thread_cpu), median over rounds
            mode: {group: statistics.median(t[group] for t in values) * 1e3 for group in values[0]}
            for mode, values in threads.items() if values[0]
        },
        "rounds_ms": {mode: [round(t * 1e3, 1) for t in values] for mode, values in times.items()},
        "compiled_while_measuring": metrics.counts.programs_compiled - compiled,
    }


# ------------------------------------------------------------------ memory (one subprocess per model and mode)
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class _Tracked:
    """A compiled program that records the device bytes in use when it runs (memory worker only).

    After each run (waited for: programs run one at a time, in program order)
    the bytes of every live device array, inputs and outputs included, plus
    the program's XLA temporary space (`memory_analysis()`), is a point of the
    device memory curve; `peak` is its maximum.
    """

    peak = 0

    def __init__(self, compiled):
        self.compiled = compiled
        analysis = compiled.memory_analysis()
        self.temp = getattr(analysis, "temp_size_in_bytes", 0) if analysis is not None else 0

    def __call__(self, *args):
        import jax

        out = self.compiled(*args)
        jax.block_until_ready(out)
        live = sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
        _Tracked.peak = max(_Tracked.peak, live + self.temp)
        return out

    def __getattr__(self, name):
        if name == "_call":  # OpProgram.adopt_direct_call would call the executable around this wrapper
            raise AttributeError(name)
        return getattr(self.compiled, name)


def memory_worker(name: str, mode: str, steps: int, warmup: int) -> dict:
    from torch_tpu.eager import program

    compile_function = program.compile_function
    program.compile_function = lambda *a, **k: _Tracked(compile_function(*a, **k))  # every program, both modes
    trainer = Trainer(name)
    _timed(trainer, mode, warmup)
    torch_tpu.set_execution_mode(mode)
    torch.tpu.synchronize()
    torch.tpu.reset_peak_memory_stats()
    _Tracked.peak = 0
    device = torch.tpu.get_device_properties(0)
    import jax

    jax_device = jax.devices(device.platform)[0]
    rss_base = rss_peak = None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        rss_base = _rss_kib("VmRSS")
    except OSError:
        pass
    for _ in range(steps):
        trainer.step()
    torch.tpu.synchronize()
    if rss_base is not None:
        rss_peak = (_rss_kib("VmHWM") - rss_base) * 1024
    stats = jax_device.memory_stats() or {}
    torch_tpu.set_execution_mode("strict")
    return {
        "storage_peak": torch.tpu.max_memory_allocated(),
        "device_peak": stats.get("peak_bytes_in_use"),
        "buffers_temp_peak": _Tracked.peak,
        "rss_peak": rss_peak,
    }


def memory(name: str, steps: int, warmup: int, precision: str) -> dict:
    out = {}
    # No persistent compile cache: an executable loaded from it would skip program.compile_function
    # (the wrapper that measures each program's memory).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TORCH_TPU_CACHE="0")
    for mode in MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{name}:{mode}", "--steps", str(steps),
               "--warmup", str(warmup), "--precision", precision]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"memory worker {name}:{mode} failed:\n{proc.stderr[-3000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def main() -> dict:
    # Every model runs through the same Trainer lines, so the recompile explainer sees a later model's
    # new shapes there as recompiles of the first one's: expected here, not a warning to show.
    warnings.filterwarnings("ignore", category=recompiles.RecompileWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,mlp,gpt-small")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (compilation)")
    parser.add_argument("--precision", default=None, choices=("highest", "high", "medium"),
                        help="float32 matmul precision (default: the current default; medium: TPU-style bf16 "
                             "multiply, f32 accumulate)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision is None:
        # tpu's level now: "medium" unless chosen (torch.get_float32_matmul_precision() would say
        # "highest", PyTorch's CPU default, and setting that would move tpu to "highest" too).
        args.precision = torch_tpu.precision.matmul_precision()
    torch.set_float32_matmul_precision(args.precision)

    if args.worker:
        name, mode = args.worker.split(":")
        print(json.dumps(memory_worker(name, mode, args.steps, args.warmup)))
        return {}

    device = torch.tpu.get_device_name(0)
    results = {"benchmark": "modes", "device": device, "precision": args.precision, "models": {}}
    print(f"modes: Strict vs DeferAndFuse training steps on {device}, float32 matmul precision '{args.precision}'")
    for name in args.models.split(","):
        result = speed(name, args.steps, args.rounds, args.warmup)
        if not args.no_memory:
            result["memory"] = memory(name, args.steps, args.warmup, args.precision)
        results["models"][name] = result
        print(f"  {name}: strict {result['strict_ms']:.1f} ms/step, defer_and_fuse {result['defer_ms']:.1f} ms/step, "
              f"speedup {result['speedup']:.2f}x (median of {args.rounds} interleaved rounds of {args.steps} steps); "
              f"CPU time {result['strict_cpu_ms']:.1f} vs {result['defer_cpu_ms']:.1f} ms/step "
              f"({result['cpu_ratio']:.2f}x less work)")
        for mode, groups in result["thread_cpu_ms"].items():
            print(f"    {mode:15s} CPU ms/step by thread: " + ", ".join(f"{g} {ms:.1f}" for g, ms in groups.items()))
        for mode in MODES:
            if "memory" in result:
                m = result["memory"][mode]
                print(f"    {mode:15s} buffers+temp peak {_mib(m['buffers_temp_peak'])}, "
                      f"XLA device peak {_mib(m['device_peak'])}, resident peak +{_mib(m['rss_peak'])}, "
                      f"storage peak {_mib(m['storage_peak'])}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
