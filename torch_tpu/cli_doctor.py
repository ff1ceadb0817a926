"""Check the installation end to end: `torch-tpu doctor`.

Platform and devices, a tiny op against PyTorch CPU, a compile, a write and a
read at each configured compile-cache level, and, where this build has them,
Pallas interpret mode, the torch.compile backend and a one-process `tpu_dist`
init. Prints each problem with its fix; exits 1 if there is any.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import warnings

OK, PROBLEM, SKIP = "ok", "PROBLEM", "skip"


class Result:
    def __init__(self, status: str, name: str, detail: str, fix: str = ""):
        self.status, self.name, self.detail, self.fix = status, name, detail, fix

    def __str__(self):
        line = f"[{self.status}] {self.name}: {self.detail}"
        return f"{line}\n        fix: {self.fix}" if self.fix else line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-dist", action="store_true", help="skip the tpu_dist init (it starts a subprocess)")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------------ checks
def check_platform() -> Result:
    import torch

    import torch_tpu  # noqa: F401  (registers the device)

    try:
        count = torch.tpu.device_count()
        own = torch.tpu.current_device()  # a launched process's is tpu:{LOCAL_RANK}: the others are not its own
        props = torch.tpu.get_device_properties(own)
    except Exception as err:
        return Result(PROBLEM, "platform", f"no XLA platform could start ({type(err).__name__}: {err})",
                      "install jax and jaxlib (pip install 'jax[tpu]' on a TPU VM; the CPU wheels elsewhere) "
                      "or choose a platform with TORCH_TPU_PLATFORM=cpu")
    from torch_tpu.config import config

    detail = f"{props.platform} ({props.name}), {count} device{'s' if count != 1 else ''}"
    if own != 0:
        detail += f", this process's is tpu:{own}"
    if config.platform in (None, "tpu") and props.platform == "cpu":
        detail += "; no TPU or GPU found, running on XLA:CPU (TPU-faithful numerics, CPU speed)"
    return Result(OK, "platform", detail)


def check_op() -> Result:
    import torch

    try:
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        expected = (x * 2 + 1).sum(dim=1)
        got = (x.to("tpu") * 2 + 1).sum(dim=1).cpu()
    except Exception as err:
        return Result(PROBLEM, "tiny op", f"failed: {type(err).__name__}: {err}",
                      "run it again with TORCH_TPU_LAUNCH_BLOCKING=1 for the failing line; reinstall torch_tpu "
                      "against this torch (pip install -e . --no-build-isolation)")
    if not torch.equal(got, expected):
        return Result(PROBLEM, "tiny op", f"wrong result {got.tolist()} (PyTorch CPU: {expected.tolist()})",
                      "report a bug with `torch-tpu info` output")
    return Result(OK, "tiny op", "(x * 2 + 1).sum(1) on tpu equals PyTorch CPU")


def check_compile() -> Result:
    import jax
    import jax.numpy as jnp
    import torch

    from torch_tpu import cache
    from torch_tpu.eager import program
    from torch_tpu.runtime import platform

    constant = float(time.time_ns() % 1_000_003)  # a program no cache has: this compiles

    def probe(x):
        return x * 2.0 + constant

    try:
        runtime = platform.get()
        own = torch.tpu.current_device()
        x = jax.device_put(jnp.arange(4, dtype=jnp.float32), runtime.devices[own])
        start = time.perf_counter()
        with cache.configured(enabled=False):  # a real compile, not a cache entry per doctor run
            executable = program.compile_function(probe, runtime.shardings[own], (x,))
        seconds = time.perf_counter() - start
        got = jax.device_get(executable(x))
    except Exception as err:
        return Result(PROBLEM, "compile", f"compiling a program failed: {type(err).__name__}: {err}",
                      "check XLA_FLAGS / LIBTPU_INIT_ARGS for bad flags; reinstall jaxlib matching jax")
    if [float(v) for v in got] != [i * 2.0 + constant for i in range(4)]:
        return Result(PROBLEM, "compile", f"the compiled program computed {list(got)}", "report a bug")
    return Result(OK, "compile", f"a fresh XLA program compiled and ran ({seconds * 1000:.0f} ms)")


def _host_fix(path: str, refused: str) -> str:
    if "other users can write" in refused:
        return f"chmod 700 {path} (or point TORCH_TPU_CACHE_DIR at a private directory)"
    if "owned by" in refused:
        return f"use a directory you own: TORCH_TPU_CACHE_DIR=$HOME/.cache/torch_tpu (or remove {path})"
    if "parent" in refused:
        return "put the cache in a private directory: TORCH_TPU_CACHE_DIR=$HOME/.cache/torch_tpu"
    return (f"make {path} creatable and writable by this user, or set TORCH_TPU_CACHE_DIR to a writable "
            "directory (TORCH_TPU_CACHE=0 turns the persistent levels off)")


def check_cache() -> list[Result]:
    from torch_tpu import cache
    from torch_tpu.cache import store

    settings = cache.settings()
    results = [Result(OK, "cache level 1 (process)", "in memory")]
    if not settings.enabled:
        results.append(Result(SKIP, "cache levels 2-3", "off (TORCH_TPU_CACHE=0): every process compiles anew"))
        return results
    path = os.path.abspath(os.path.expanduser(settings.dir or store.default_dir()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = cache.host_store()
    if host is None:
        refused = store.check_private(path) if os.path.lexists(path) else None
        if refused is None:
            probe = store.HostStore(path, 1, 1)
            refused = probe.refused or "unusable"
        results.append(Result(PROBLEM, "cache level 2 (host)", f"{path}: refused: {refused}",
                              _host_fix(path, refused)))
    else:
        name = f"doctor-{os.getpid()}.probe"
        payload = os.urandom(64)
        try:
            host.put(name, payload)
            back = host.get(name)
            host.drop(name)
        except OSError as err:
            results.append(Result(PROBLEM, "cache level 2 (host)", f"{host.path}: writing failed ({err.strerror})",
                                  _host_fix(host.path, "cannot write")))
        else:
            if back != payload:
                results.append(Result(PROBLEM, "cache level 2 (host)", f"{host.path}: read back other bytes",
                                      f"check the filesystem behind {host.path}"))
            else:
                results.append(Result(OK, "cache level 2 (host)", f"{host.path}: write and read back"))
    if not settings.url:
        results.append(Result(SKIP, "cache level 3 (remote)", "no URL configured (TORCH_TPU_CACHE_URL)"))
        return results
    fix = "check the URL, the credentials and that fsspec's filesystem for it is installed, or unset TORCH_TPU_CACHE_URL"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remote = cache.remote_store()
        if remote is None:
            failed = store.RemoteStore(settings.url, settings.storage_options)
            results.append(Result(PROBLEM, "cache level 3 (remote)", f"{settings.url}: {failed.error or 'unusable'}",
                                  fix))
            return results
        name = f"doctor-{os.getpid()}.probe"
        payload = os.urandom(64)
        remote.put(name, payload)
        flushed = remote.flush(60)
        back = remote.get(name) if flushed else None
        if remote.usable:
            try:
                remote.fs.rm_file(remote._path(name))
            except Exception:
                pass
    if back != payload:
        detail = remote.error or ("the write did not finish in 60 s" if not flushed else "read back other bytes")
        results.append(Result(PROBLEM, "cache level 3 (remote)", f"{settings.url}: {detail}", fix))
    else:
        results.append(Result(OK, "cache level 3 (remote)", f"{settings.url}: write and read back"))
    return results


def check_pallas() -> Result:
    if not _has("jax.experimental.pallas"):
        return Result(SKIP, "Pallas", "jax.experimental.pallas is not importable in this jax")
    try:
        import jax
        import jax.numpy as jnp
        from jax.experimental import pallas as pl

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        x = jnp.arange(8, dtype=jnp.float32)
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
        if [float(v) for v in out] != [float(i) + 1.0 for i in range(8)]:
            return Result(PROBLEM, "Pallas interpret mode", f"computed {list(out)}", "report a bug")
    except Exception as err:
        return Result(PROBLEM, "Pallas interpret mode", f"{type(err).__name__}: {err}",
                      "install a jax/jaxlib pair of the same version (pip install jax==X jaxlib==X)")
    note = ("" if _has("torch_tpu.pallas") else
            "; torch_tpu.pallas (jax_op) is not in this build: binding kernels to torch ops skipped")
    return Result(OK, "Pallas interpret mode", "a Pallas kernel ran in interpret mode" + note)


def check_torch_compile() -> Result:
    if not _has("torch_tpu.compile"):
        return Result(SKIP, "torch.compile", "the torch.compile backend (torch_tpu.compile) is not in this build")
    import torch

    try:
        fn = torch.compile(lambda a: torch.sin(a) * 2, backend="tpu")
        x = torch.linspace(-1, 1, 8)
        got = fn(x.to("tpu")).cpu()
    except Exception as err:
        fix = "run with TORCH_LOGS=+dynamo for the failing graph; Strict eager still works without it"
        if type(err).__name__ == "InvalidBackend":  # the package's torch_dynamo_backends entry point is missing
            fix = ("reinstall torch_tpu (pip install -e . or make install) so Dynamo finds the 'tpu' backend "
                   "through its entry point; until then call torch_tpu.compile.register()")
        return Result(PROBLEM, "torch.compile", f"backend 'tpu' failed: {type(err).__name__}: {err}", fix)
    if not torch.allclose(got, torch.sin(x) * 2, atol=1e-5):
        return Result(PROBLEM, "torch.compile", "backend 'tpu' computed a wrong result", "report a bug")
    return Result(OK, "torch.compile", "backend 'tpu' compiled and ran a function")


_DIST_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import torch_tpu
    dist.init_process_group("tpu_dist", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
    t = torch.ones(4, device="tpu")
    dist.all_reduce(t)
    assert t.cpu().tolist() == [1.0] * 4, t.cpu().tolist()
    dist.destroy_process_group()
    print("ok")
""")


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_dist() -> Result:
    if not _has("torch_tpu.distributed"):
        return Result(SKIP, "tpu_dist", "the tpu_dist backend (torch_tpu.distributed) is not in this build")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The child is a one-process job of its own: a launcher's variables (this doctor run under
    # torchrun) would make it one rank of this job, claiming this process's device.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    try:
        done = subprocess.run([sys.executable, "-c", _DIST_SCRIPT % port], capture_output=True, text=True,
                              timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return Result(PROBLEM, "tpu_dist", "a one-process init_process_group did not finish in 180 s",
                      "check that 127.0.0.1 is reachable (firewall) and MASTER_ADDR/MASTER_PORT are not set to a "
                      "dead host")
    if done.returncode != 0 or "ok" not in done.stdout:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return Result(PROBLEM, "tpu_dist", f"a one-process init/all_reduce failed: {tail[0]}",
                      "run the same with TORCH_TPU_LAUNCH_BLOCKING=1; see docs/distributed.md")
    return Result(OK, "tpu_dist", "one-process init_process_group, all_reduce and destroy")


def checks(dist: bool = True) -> list[Result]:
    """Run every check; the platform failing stops the device checks."""
    results = [check_platform()]
    if results[0].status == PROBLEM:
        return results
    results.append(check_op())
    results.append(check_compile())
    results.extend(check_cache())
    results.append(check_pallas())
    results.append(check_torch_compile())
    if dist:
        results.append(check_dist())
    return results


def run(args: argparse.Namespace) -> int:
    problems = 0
    with warnings.catch_warnings():  # what they warn about, the checks report with a fix
        warnings.simplefilter("ignore")
        results = checks(dist=not args.no_dist)
    for result in results:
        print(result, flush=True)
        problems += result.status == PROBLEM
    if problems:
        print(f"{problems} problem{'s' if problems != 1 else ''} found")
        return 1
    print("no problems found")
    return 0
