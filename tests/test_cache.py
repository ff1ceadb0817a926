"""The compile cache across processes: level-2 hits, single-flight, remote (file://, S3), corruption, security."""
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import torch

import torch_tpu
from torch_tpu import cache, metrics

# Each run is a fresh process: imports, starts the runtime, runs a small workload
# (about ten programs), checks it against PyTorch CPU and prints its cache stats.
WORKLOAD = r"""
import json, os, sys, time
import torch, torch_tpu
from torch_tpu import cache, metrics

torch.set_float32_matmul_precision("highest")
torch.tpu.device_count()
if os.environ.get("WORKLOAD_SLOW_COMPILE"):  # hold the single-flight lock: the first compile takes long
    from torch_tpu.cache import levels
    compile_now, first = levels._compile, []
    def slow(*args, **kwargs):
        if not first:
            first.append(1)
            open(os.environ["WORKLOAD_SIGNAL"], "w").close()
            time.sleep(float(os.environ["WORKLOAD_SLOW_COMPILE"]))
        return compile_now(*args, **kwargs)
    levels._compile = slow
unpickled = []
sys.addaudithook(lambda event, args: unpickled.append(repr(args)) if event == "pickle.find_class" else None)
if os.environ.get("WORKLOAD_READY"):
    open(os.environ["WORKLOAD_READY"], "w").close()
if os.environ.get("WORKLOAD_GO"):
    while not os.path.exists(os.environ["WORKLOAD_GO"]):
        time.sleep(0.005)

torch.manual_seed(0)
a, b = torch.randn(16, 32), torch.randn(32, 8)

def f(a, b):
    h = torch.tanh(a @ b)
    return torch.softmax(h * 2 + 1, -1).sum(0), (a[:, :8] - h).abs().amax()

expected = f(a, b)
got = f(a.to("tpu"), b.to("tpu"))
ok = all(torch.allclose(g.cpu(), e, atol=1e-5, rtol=1e-5) for g, e in zip(got, expected))
cache.flush(60)
print("RESULT " + json.dumps({"ok": ok, "compiled": metrics.counts.programs_compiled, "stats": cache.stats(),
                              "unpickled": unpickled}))
"""


def _env(l2, url=None, **extra):
    env = dict(os.environ, TORCH_TPU_CACHE="1", TORCH_TPU_CACHE_DIR=str(l2), TORCH_TPU_NUM_CPU_DEVICES="1")
    env.pop("TORCH_TPU_CACHE_URL", None)
    if url:
        env["TORCH_TPU_CACHE_URL"] = url
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(tmp_path, env):
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["stderr"] = err
    assert result["ok"], "results differ from PyTorch CPU"
    assert result["unpickled"] == [], "something was unpickled"
    return result


def _run(tmp_path, env):
    return _finish(_start(tmp_path, env))


def _files(path, suffix):
    return sorted(p.name for p in path.iterdir() if p.name.endswith(suffix)) if path.exists() else []


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """One cold run with an empty cache: its level-2 directory, its file:// remote and its result."""
    root = tmp_path_factory.mktemp("populated")
    result = _run(root, _env(root / "l2", f"file://{root}/remote"))
    return root, result


def _copy(populated, tmp_path):
    root, result = populated
    shutil.copytree(root / "l2", tmp_path / "l2", symlinks=True)
    shutil.copytree(root / "remote", tmp_path / "remote")
    return result


def test_cold_run_compiles_and_fills_both_levels(populated):
    """An empty cache compiles every program, writes each to level 2 and (asynchronously) to the remote."""
    root, cold = populated
    n = cold["compiled"]
    assert n > 0 and cold["stats"]["compiles"] == n
    assert cold["stats"]["l2"]["hits"] == 0 and cold["stats"]["l2"]["misses"] == n
    assert len(_files(root / "l2", ".exe")) == n
    assert _files(root / "remote", ".exe") == _files(root / "l2", ".exe")
    assert _files(root / "remote", ".idx") == _files(root / "l2", ".idx")


def test_second_process_compiles_nothing(populated, tmp_path):
    """A process run after the first compiles nothing: every program is a level-2 hit, found by its program key."""
    cold = _copy(populated, tmp_path)
    warm = _run(tmp_path, _env(tmp_path / "l2"))
    n = cold["compiled"]
    assert warm["compiled"] == 0 and warm["stats"]["compiles"] == 0
    assert warm["stats"]["l2"]["hits"] == n and warm["stats"]["index_hits"] == n
    assert warm["stats"]["lowerings"] == 0  # no tracing or lowering either
    assert warm["stats"]["l2"]["saved_seconds"] > 0


@pytest.mark.one_mode  # the store's machinery; test_second_process_compiles_nothing covers fused programs
def test_remote_serves_when_host_level_is_wiped(populated, tmp_path):
    """With level 2 wiped, a file:// remote serves every program, and they are copied back to level 2."""
    cold = _copy(populated, tmp_path)
    shutil.rmtree(tmp_path / "l2")
    warm = _run(tmp_path, _env(tmp_path / "l2", f"file://{tmp_path}/remote"))
    n = cold["compiled"]
    assert warm["compiled"] == 0
    assert warm["stats"]["l3"]["hits"] == n and warm["stats"]["l2"]["hits"] == 0
    assert len(_files(tmp_path / "l2", ".exe")) == n


@pytest.mark.one_mode  # the store's machinery; test_second_process_compiles_nothing covers fused programs
def test_corrupt_entries_are_dropped_and_recompiled(populated, tmp_path):
    """Truncated executables and flipped index records are detected, dropped and recompiled, never loaded."""
    cold = _copy(populated, tmp_path)
    l2 = tmp_path / "l2"
    for name in _files(l2, ".exe"):
        data = (l2 / name).read_bytes()
        (l2 / name).write_bytes(data[: len(data) // 2])
    flipped = _files(l2, ".idx")[:3]
    for name in flipped:
        data = bytearray((l2 / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (l2 / name).write_bytes(bytes(data))
    n = cold["compiled"]
    run = _run(tmp_path, _env(l2))
    assert run["compiled"] == n and run["stats"]["l2"]["hits"] == 0
    assert run["stats"]["corrupt"] == n + len(flipped)
    assert "corrupt compile cache entry" in run["stderr"]
    again = _run(tmp_path, _env(l2))  # the rewritten entries are whole
    assert again["compiled"] == 0 and again["stats"]["corrupt"] == 0


@pytest.mark.one_mode  # the store's machinery; test_second_process_compiles_nothing covers fused programs
def test_two_processes_started_together_compile_each_program_once(tmp_path):
    """Two processes missing the same programs at the same moment compile each program once in total."""
    env = [_env(tmp_path / "l2", WORKLOAD_READY=tmp_path / f"ready{i}", WORKLOAD_GO=tmp_path / "go") for i in (0, 1)]
    procs = [_start(tmp_path, e) for e in env]
    deadline = time.time() + 300
    while not all((tmp_path / f"ready{i}").exists() for i in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "workers did not start"
        time.sleep(0.01)
    (tmp_path / "go").touch()
    first, second = (_finish(p) for p in procs)
    programs = len(_files(tmp_path / "l2", ".exe"))
    assert programs > 0
    assert first["compiled"] + second["compiled"] == programs
    for run in (first, second):  # each program: compiled here, or waited for / loaded from the other process
        assert run["compiled"] + run["stats"]["l2"]["hits"] == programs


@pytest.mark.heavy
def test_waiting_process_loads_instead_of_compiling(tmp_path):
    """While one process compiles a program, another that needs it waits for the entry and loads it."""
    signal = tmp_path / "compiling"
    holder = _start(tmp_path, _env(tmp_path / "l2", WORKLOAD_SLOW_COMPILE=4, WORKLOAD_SIGNAL=signal))
    waiter = _start(tmp_path, _env(tmp_path / "l2", WORKLOAD_GO=signal))
    held, waited = _finish(holder), _finish(waiter)
    programs = len(_files(tmp_path / "l2", ".exe"))
    assert waited["stats"]["waits"] >= 1 and waited["stats"]["lock_timeouts"] == 0
    assert waited["stats"]["l2"]["hits"] >= 1
    assert held["compiled"] + waited["compiled"] == programs


@pytest.mark.heavy
def test_lock_timeout_compiles_anyway(tmp_path):
    """A process that waits longer than TORCH_TPU_CACHE_LOCK_TIMEOUT compiles the program itself."""
    signal = tmp_path / "compiling"
    holder = _start(tmp_path, _env(tmp_path / "l2", WORKLOAD_SLOW_COMPILE=8, WORKLOAD_SIGNAL=signal))
    waiter = _start(tmp_path, _env(tmp_path / "l2", WORKLOAD_GO=signal, TORCH_TPU_CACHE_LOCK_TIMEOUT=1))
    _finish(holder)
    waited = _finish(waiter)
    assert waited["stats"]["lock_timeouts"] >= 1 and waited["compiled"] >= 1


@pytest.mark.one_mode
def test_world_writable_dir_is_refused(tmp_path):
    """A cache directory others can write is refused with a warning; programs still run (compiled)."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    l2.chmod(0o777)
    run = _run(tmp_path, _env(l2))
    assert "refused" in run["stderr"] and "other users can write" in run["stderr"]
    assert run["stats"]["l2"]["enabled"] is False
    assert run["compiled"] > 0 and list(l2.iterdir()) == []


@pytest.mark.one_mode
def test_failing_remote_is_warned_once_and_skipped(tmp_path):
    """A remote that errors is warned about once; the run goes on with level 2."""
    (tmp_path / "afile").write_bytes(b"not a directory")
    run = _run(tmp_path, _env(tmp_path / "l2", f"file://{tmp_path}/afile/cache"))
    assert run["stderr"].count("skipped for the rest of this process") == 1
    assert run["stats"]["l3"]["enabled"] is False and run["stats"]["l3"]["error"]
    assert run["compiled"] > 0 and len(_files(tmp_path / "l2", ".exe")) == run["compiled"]


# ---------------------------------------------------------------- S3 (moto server on loopback)


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible server (moto) on a free loopback port, with a bucket; stopped after the module."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    pytest.importorskip("s3fs", reason="s3fs is in the test extra")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    import s3fs

    s3fs.S3FileSystem(endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"], key="testing", secret="testing").mkdir("tpu-cache")
    yield env
    server.stop()


@pytest.mark.one_mode
def test_s3_remote_serves_a_fresh_host(s3_server, tmp_path):
    """Entries written to S3 by one host's process serve another with an empty level 2."""
    url = "s3://tpu-cache/run1"
    cold = _run(tmp_path, _env(tmp_path / "l2a", url, **s3_server))
    n = cold["compiled"]
    assert n > 0 and cold["stats"]["l3"]["writes"] == 2 * n  # executables and program-index records
    warm = _run(tmp_path, _env(tmp_path / "l2b", url, **s3_server))
    assert warm["compiled"] == 0 and warm["stats"]["l3"]["hits"] == n
    assert len(_files(tmp_path / "l2b", ".exe")) == n


# ---------------------------------------------------------------- in process


@pytest.fixture
def private_cache(tmp_path):
    with cache.configured(enabled=True, dir=str(tmp_path / "l2"), url=None):
        cache.clear(host=False)
        yield tmp_path / "l2"
    cache.clear(host=False)


def test_hot_path_does_not_touch_the_cache(private_cache):
    """Once the executor holds a program, running it again does no fingerprinting, lookup or compile."""
    def run():  # DeferAndFuse runs the five ops as one fused program, compiled on the first run
        x = torch.ones(37, device="tpu")
        for _ in range(5):
            x = x * 3
        return x.cpu()

    # Under DeferAndFuse an earlier test's unread results may still be pending: the first run would
    # flush them with its own ops, a graph the second run does not repeat (an order-dependent compile).
    torch.tpu.synchronize()
    run()
    before = cache.stats()
    hits = metrics.counts.cache_hits
    torch.testing.assert_close(run(), torch.full((37,), 3.0**5))
    assert metrics.counts.cache_hits == hits + 6  # ones + five products
    assert cache.stats() == before


def test_executor_programs_are_persisted(private_cache):
    """Each program the executor compiles writes one executable and one program-index record to level 2."""
    before = cache.stats()["compiles"]
    (torch.arange(41.0).to("tpu") * 2).cpu()
    compiled = cache.stats()["compiles"] - before
    assert compiled >= 1
    assert len(_files(private_cache, ".exe")) == compiled and len(_files(private_cache, ".idx")) == compiled


def test_compile_api_levels_for_any_lowering(private_cache):
    """cache.compile serves any jax lowering: level 1 returns the same executable, level 2 a loaded one."""
    device = jax.devices("cpu")[0]
    fn = jax.jit(lambda x, y, scale: {"sum": x + y * scale, "prod": [x * y]}, keep_unused=True)
    x = jax.device_put(np.arange(6.0, dtype=np.float32), device)
    y = jax.device_put(np.ones(6, np.float32), device)
    scale = jax.device_put(np.float32(2.0), device)
    lowered = fn.lower(x, y, scale=scale)
    first = cache.compile(lowered, device)
    assert cache.compile(lowered, device) is first  # level 1
    cache.clear(host=False)
    hits = cache.stats()["l2"]["hits"]
    loaded = cache.compile(lowered, device)
    assert cache.stats()["l2"]["hits"] == hits + 1 and loaded is not first
    out = loaded(x, y, scale=scale)
    np.testing.assert_allclose(np.asarray(out["sum"]), np.arange(6.0) + 2.0)
    np.testing.assert_allclose(np.asarray(out["prod"][0]), np.arange(6.0))


def test_loaded_executable_with_lists_of_arrays(private_cache):
    """DeferAndFuse's convention (several flat lists in, one flat list out, a donated list) loads as a
    plain call on level 2 and gives the compiled results; the donated input is consumed."""
    device = jax.devices("cpu")[0]
    fn = jax.jit(lambda donated, kept, scalars: [donated[0] * kept[0] + scalars[0], kept[1] - 1],
                 donate_argnums=(0,), keep_unused=True)

    def args():
        put = functools.partial(jax.device_put, device=device)
        return ([put(np.arange(4.0, dtype=np.float32))],
                [put(np.full(4, 2.0, np.float32)), put(np.ones(3, np.float32))], [put(np.float32(0.5))])

    cache.compile(fn.lower(*args()), device)
    cache.clear(host=False)
    loaded = cache.compile(fn.lower(*args()), device)
    donated, kept, scalars = args()
    out = loaded(donated, kept, scalars)
    assert isinstance(out, list) and len(out) == 2
    np.testing.assert_allclose(np.asarray(out[0]), np.arange(4.0) * 2 + 0.5)
    np.testing.assert_allclose(np.asarray(out[1]), np.zeros(3))
    assert donated[0].is_deleted()


def test_stats_and_report(private_cache):
    """stats() has every level's hits, misses, load time and time saved; the metrics report shows them."""
    stats = cache.stats()
    for level in ("l1", "l2", "l3"):
        assert {"hits", "misses", "load_seconds", "saved_seconds"} <= set(stats[level])
    assert {"compiles", "waits", "corrupt", "index_hits"} <= set(stats)
    report = metrics.report()
    assert "compile cache: L2 host hits / misses" in report and "compile cache: single-flight waits" in report


@pytest.mark.one_mode
def test_cli_info_and_clear(private_cache, capsys):
    """`torch-tpu cache info` describes the levels; `cache clear` empties level 2."""
    from torch_tpu import cli

    (torch.arange(43.0).to("tpu") + 1).cpu()
    assert _files(private_cache, ".exe")
    assert cli.main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(private_cache) in out and "executables: " in out and "level 3 (remote): off" in out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert _files(private_cache, ".exe") == []


@pytest.mark.one_mode
def test_keys_name_the_program_and_its_device():
    """Equal inputs give equal keys; another program, device or signature gives another key."""
    torch.zeros(1, device="tpu")  # the runtime sets up the CPU devices before JAX is asked for them
    d0, d1 = jax.devices("cpu")[:2]
    text = "module @m { func.func public @main() { return } }"
    assert cache.executable_key(text, d0) == cache.executable_key(text, d0)
    assert cache.executable_key(text, d0) != cache.executable_key(text + " ", d0)
    assert cache.executable_key(text, d0) != cache.executable_key(text, d1)  # XLA bakes in the device assignment
    assert cache.executable_key(text, d0) != cache.executable_key(text, d0, ("opt",))
    sig = (torch.ops.aten.mul.Tensor, 0, ("T", torch.float32, (3,), (1,), 0, 0), ((torch.float32, 12),))
    other = (torch.ops.aten.add.Tensor, *sig[1:])
    assert cache.program_key(sig, d0) == cache.program_key(sig, d0)
    assert cache.program_key(sig, d0) != cache.program_key(other, d0)
    assert len(cache.program_key(sig, d0)) == 64


@pytest.mark.one_mode
def test_configure_returns_previous_settings(tmp_path):
    """configure() changes the settings in force and returns the old ones; configured() restores them."""
    before = cache.settings()
    with cache.configured(enabled=True, dir=str(tmp_path), max_bytes=1 << 20) as now:
        assert now.dir == str(tmp_path) and cache.settings().max_bytes == 1 << 20
        assert cache.host_store().path == str(tmp_path)
        previous = cache.configure(url=f"file://{tmp_path}/remote")
        assert previous.url is None and cache.remote_store() is not None
    assert cache.settings() == before


@pytest.mark.one_mode
def test_reset_stats_zeroes_counters(private_cache):
    """reset_stats() zeroes hits, misses and compiles (entries stay)."""
    (torch.arange(47.0).to("tpu") - 1).cpu()
    assert cache.stats()["compiles"] > 0
    cache.reset_stats()
    stats = cache.stats()
    assert stats["compiles"] == 0 and stats["l2"]["misses"] == 0 and stats["index_misses"] == 0
    assert _files(private_cache, ".exe")


@pytest.mark.one_mode
def test_cli_remote_info_and_clear(tmp_path, capsys):
    """`cache info --remote` lists the remote level; `cache clear --remote` empties it too."""
    from torch_tpu import cli

    with cache.configured(enabled=True, dir=str(tmp_path / "l2"), url=f"file://{tmp_path}/remote"):
        cache.clear(host=False)
        (torch.arange(53.0).to("tpu") * 5).cpu()
        assert cache.flush(30)
        assert _files(tmp_path / "remote", ".exe")
        assert cli.main(["cache", "info", "--remote"]) == 0
        assert f"level 3 (remote): file://{tmp_path}/remote" in capsys.readouterr().out
        assert cli.main(["cache", "clear", "--remote"]) == 0
        assert "host directory and remote URL" in capsys.readouterr().out
        assert _files(tmp_path / "remote", ".exe") == [] and _files(tmp_path / "l2", ".exe") == []
    cache.clear(host=False)


def test_programs_with_host_callbacks_stay_in_the_process(private_cache):
    """A program that calls back into Python is kept in level 1 only, and still runs."""
    device = jax.devices("cpu")[0]

    def fn(x):
        doubled = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return doubled + 1

    x = jax.device_put(np.arange(4, dtype=np.float32), device)
    before = cache.stats()["process_bound"]
    executable = cache.compile(jax.jit(fn).lower(x), device)
    assert cache.stats()["process_bound"] == before + 1
    assert _files(private_cache, ".exe") == []
    np.testing.assert_allclose(np.asarray(executable(x)), np.arange(4) * 2 + 1)


@pytest.mark.one_mode  # Strict's hit path (set below)
def test_cache_hits_launch_directly_compiled_and_loaded(private_cache):
    """A Strict cache hit launches its executable through PJRT (`_native.DirectLaunch`, JAX's own result
    handlers) whether the program was compiled here or loaded from level 2, with the CPU results."""
    def step(x, y):
        return torch.addcmul(x * 0.5, y, y, value=2.0) - 1.25

    xc, yc = torch.randn(29), torch.randn(29)
    expected = step(step(xc, yc), yc)
    with torch_tpu.execution_mode("strict"):
        _check_direct_launches(xc, yc, expected, step)


def _check_direct_launches(xc, yc, expected, step):
    from torch_tpu import _native
    from torch_tpu.eager import defer, executor

    def run():
        x, y = xc.to("tpu"), yc.to("tpu")
        out = step(step(x, y), y)  # the second call of each op is a hit
        launches = [p.fast[5] for p in executor.programs.values()
                    if p.fast is not None and p.key[0] in ("aten.mul.Tensor", "aten.addcmul.default", "aten.sub.Tensor")]
        return out.cpu(), launches

    defer.forget()  # only this test's programs are counted
    got, launches = run()
    torch.testing.assert_close(got, expected)
    assert len(launches) == 3 and all(isinstance(f, _native.DirectLaunch) for f in launches)
    defer.forget()
    cache.clear(host=False)
    hits = cache.stats()["l2"]["hits"]
    got, launches = run()
    assert cache.stats()["l2"]["hits"] >= hits + 3  # loaded, not compiled
    torch.testing.assert_close(got, expected)
    assert len(launches) == 3 and all(isinstance(f, _native.DirectLaunch) for f in launches)


@pytest.mark.filterwarnings("ignore::torch_tpu.recompiles.RecompileWarning")  # one per new shape
def test_level_1_is_bounded(private_cache, monkeypatch):
    """Past L1_LIMIT live programs the least recently used are dropped (live XLA:CPU executables hold
    memory mappings, and a process past vm.max_map_count crashes): the tables stay bounded, mappings
    stop growing, and a dropped signature runs again from the compile cache with the right values.
    In DeferAndFuse the fused plans and programs are bounded the same way."""
    from torch_tpu.cache import levels
    from torch_tpu.eager import defer, executor

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    limit = 24
    monkeypatch.setattr(levels, "L1_LIMIT", limit)
    torch.tpu.synchronize()

    def new_shapes(first, n):  # three programs per shape: ones, the product, the sum
        for i in range(first, first + n):
            assert (torch.ones(i, device="tpu") * 2).sum().item() == 2 * i

    new_shapes(1000, limit)
    before, evictions = maps(), cache.stats()["l1"]["evictions"]
    new_shapes(2000, 2 * limit)  # 144 more executables; unbounded they held ~4 mappings each
    assert len(executor.programs) <= limit and len(levels._l1) <= limit
    assert len(defer._executables) <= limit and len(defer._plans) <= limit
    assert cache.stats()["l1"]["evictions"] > evictions
    # unbounded: ~3-4 mappings per new executable, over 1,000 here; bounded, what the tables hold
    # between their limit and its three quarters moves the count by tens
    assert maps() - before < 3 * limit, "the mappings grew with every new executable"
    compiles = cache.stats()["compiles"]
    new_shapes(1000, 3)  # dropped long ago: found in level 2, not compiled again
    assert cache.stats()["compiles"] == compiles


def test_many_mappings_make_the_cache_and_the_executors_drop_executables(private_cache, monkeypatch):
    """Some executables hold ~45 mappings (a boolean-mask write), so L1_LIMIT alone is not enough: past
    half of vm.max_map_count mappings (checked every _MAPS_EVERY stores) level 1, the executor's
    program table and DeferAndFuse's plans and fused programs each drop half of theirs."""
    from torch_tpu.cache import levels
    from torch_tpu.eager import defer, executor

    monkeypatch.setattr(levels, "_MAPS_EVERY", 1)
    monkeypatch.setattr(levels, "_map_budget", lambda: 0)  # always under pressure
    torch.tpu.synchronize()
    evictions = cache.stats()["l1"]["evictions"]
    for i in range(3000, 3040):
        assert (torch.ones(i, device="tpu") * 2).sum().item() == 2 * i
    assert len(executor.programs) <= 4 and len(levels._l1) <= 4  # halved on every store
    assert len(defer._executables) <= 4 and len(defer._plans) <= 4
    assert cache.stats()["l1"]["evictions"] > evictions
