"""TorchTPU 0.2's public API on torch_tpu, used the way its docs use it (docs/compat.md).

Each result is compared with PyTorch CPU, or with our own API running the same program.
"""
import datetime
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import torch_tpu
import torch_tpu.compile
from torch_tpu import metrics, xla_options

# The tests compare float32 at "highest" (conftest): its one-time performance warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::torch_tpu.TpuPerformanceWarning")

# Every public name of TorchTPU 0.2's torch.tpu (its _internal/public_api.py export table).
TORCHTPU_PUBLIC = [
    "is_available", "device_count", "current_device", "set_device", "device", "device_of", "synchronize",
    "Stream", "Event", "current_stream", "default_stream", "set_stream", "stream",
    "manual_seed", "manual_seed_all", "initial_seed", "get_rng_state", "set_rng_state", "default_generators",
    "is_initialized", "get_device_name", "get_device_properties", "get_amp_supported_dtype",
    "precision", "Precision", "allow_excess_precision", "eager_mode", "EagerMode", "set_eager_mode",
    "topology_aware_mesh",
]
TORCHTPU_PRIVATE = ["_get_cache_stats", "_get_cache_requests", "_get_cache_hits", "_get_cache_misses",
                    "_clear_cache", "_set_cache_only", "_set_dump_on_cache_miss", "_get_dump_on_cache_miss",
                    "_lazy_init", "_is_autocast_enabled", "_get_autocast_dtype", "_set_autocast_dtype"]
TORCHTPU_SUBMODULES = ["compiler", "distributed", "profiler", "pallas", "ops", "optimizers"]


def _program(x, w):
    return torch.nn.functional.gelu(x @ w + 1).sum(1) * 0.5


def _inputs(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randn(32, 24, generator=g)


def test_dir_has_every_public_name():
    """dir(torch.tpu) lists all 30 public names of TorchTPU's torch.tpu, its cache helpers and submodules."""
    assert len(TORCHTPU_PUBLIC) == 30
    names = dir(torch.tpu)
    missing = [n for n in TORCHTPU_PUBLIC + TORCHTPU_PRIVATE + TORCHTPU_SUBMODULES if n not in names]
    assert not missing
    for name in TORCHTPU_PUBLIC + TORCHTPU_PRIVATE + TORCHTPU_SUBMODULES:
        getattr(torch.tpu, name)


def test_eager_mode_property_is_our_execution_mode():
    """torch.tpu.eager_mode reads and sets torch_tpu's execution mode; results match ours and CPU."""
    E = torch.tpu.EagerMode
    assert torch.tpu.eager_mode == E(torch_tpu.get_execution_mode())
    assert [m.value for m in E] == list(torch_tpu.modes.MODES)
    x, w = _inputs()
    expected = _program(x, w)
    previous = torch.tpu.eager_mode
    try:
        for mode in E:
            torch.tpu.eager_mode = mode
            assert torch_tpu.get_execution_mode() == mode.value
            deferred, waits = metrics.counts.ops_deferred, metrics.counts.synchronous_waits
            got = _program(x.to("tpu"), w.to("tpu")).cpu()
            assert (metrics.counts.ops_deferred > deferred) == (mode is E.DEFER_AND_FUSE)
            assert (metrics.counts.synchronous_waits > waits) == (mode is E.DEFER_NEVER_AND_LAUNCH_BLOCKING)
            with torch_tpu.execution_mode(mode.value):  # ours, same program
                ours = _program(x.to("tpu"), w.to("tpu")).cpu()
            assert torch.equal(got, ours)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="EagerMode"):
            torch.tpu.eager_mode = "strict"
    finally:
        torch.tpu.eager_mode = previous
    from torch_tpu._internal import execution_mode

    assert execution_mode.eager_mode == torch.tpu.eager_mode
    execution_mode.eager_mode = E.DEFER_AND_FUSE
    try:
        assert torch.tpu.eager_mode is E.DEFER_AND_FUSE
    finally:
        execution_mode.eager_mode = previous
    assert execution_mode.enable_cpu_fallback == (torch_tpu.config.config.fallback != "error")


def test_set_eager_mode_scope():
    """`with torch.tpu.set_eager_mode(mode):` pushes the mode, nests, and pops back (even on error)."""
    E = torch.tpu.EagerMode
    outer = torch.tpu.eager_mode
    x, w = _inputs(1)
    with torch.tpu.set_eager_mode(E.DEFER_AND_FUSE):
        assert torch_tpu.get_execution_mode() == "defer_and_fuse"
        fused = _program(x.to("tpu"), w.to("tpu"))
        with torch.tpu.set_eager_mode(E.DEFER_NEVER_AND_LAUNCH_BLOCKING):
            assert torch.tpu.eager_mode is E.DEFER_NEVER_AND_LAUNCH_BLOCKING
            debug = _program(x.to("tpu"), w.to("tpu"))
        assert torch.tpu.eager_mode is E.DEFER_AND_FUSE
    assert torch.tpu.eager_mode is outer
    torch.testing.assert_close(fused.cpu(), debug.cpu(), atol=1e-5, rtol=1e-5)  # fusion may reorder sums
    torch.testing.assert_close(fused.cpu(), _program(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(KeyError):
        with torch.tpu.set_eager_mode(E.DEFER_AND_FUSE):
            raise KeyError("inside")
    assert torch.tpu.eager_mode is outer
    with pytest.raises(ValueError):
        torch.tpu.set_eager_mode("defer_and_fuse")


def test_scoped_settings_refused_inside_torch_compile():
    """set_eager_mode, precision and custom_compiler_options cannot be traced by torch.compile (fullgraph)."""
    scopes = [lambda: torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE),
              lambda: torch.tpu.precision(torch.tpu.Precision.HIGHEST),
              lambda: torch.tpu.compiler.custom_compiler_options({"xla_cpu_enable_fast_math": False})]
    for scope in scopes:
        def f(x):
            with scope():
                return x + 1

        torch._dynamo.reset()
        with pytest.raises(Exception, match="inside torch.compile|exception"):
            torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()


def test_precision_scope_matches_ours_and_cpu():
    """`with torch.tpu.precision(Precision.X):` is `torch_tpu.precision.use(level)`: same programs, same numbers."""
    P = torch.tpu.Precision
    assert {p.name: p.value for p in P} == {"DEFAULT": "medium", "HIGH": "high", "HIGHEST": "highest"}
    a, b = _inputs(2)
    ta, tb = a.to("tpu"), b.to("tpu")
    results = {}
    for p in P:
        with torch.tpu.precision(p):
            assert torch_tpu.precision.matmul_precision() == p.value
            got = (ta @ tb).cpu()
        with torch_tpu.precision.use(p.value):
            assert torch.equal(got, (ta @ tb).cpu())
        results[p] = got
    exact = a @ b
    torch.testing.assert_close(results[P.HIGHEST], exact, atol=1e-5, rtol=1e-5)
    bf16 = (a.bfloat16().float() @ b.bfloat16().float())
    torch.testing.assert_close(results[P.DEFAULT], bf16, atol=1e-4, rtol=1e-4)
    assert (results[P.DEFAULT] - exact).abs().max() > (results[P.HIGH] - exact).abs().max()
    with pytest.raises(ValueError, match="Precision"):
        torch.tpu.precision("highest")
    # Thread-local: another thread keeps its own level.
    seen = []
    with torch.tpu.precision(P.HIGH):
        t = threading.Thread(target=lambda: seen.append(torch_tpu.precision.matmul_precision()))
        t.start()
        t.join()
    assert seen == [torch_tpu.precision.matmul_precision()]


def test_allow_excess_precision_changes_the_program_key():
    """torch.tpu.allow_excess_precision (default False) recompiles the same op once per value."""
    assert torch.tpu.allow_excess_precision is False
    x = torch.randn(7, 5, device="tpu", dtype=torch.bfloat16)
    expected = (x.cpu() * 3 + 1).float()
    torch.testing.assert_close((x * 3 + 1).float().cpu(), expected)
    compiled = metrics.counts.programs_compiled
    torch.tpu.allow_excess_precision = True
    try:
        assert ("xla_allow_excess_precision", True) in xla_options.current()
        torch.testing.assert_close((x * 3 + 1).float().cpu(), expected)
        assert metrics.counts.programs_compiled > compiled  # other programs, compiled with the flag
    finally:
        torch.tpu.allow_excess_precision = False
    compiled = metrics.counts.programs_compiled
    torch.testing.assert_close((x * 3 + 1).float().cpu(), expected)
    assert metrics.counts.programs_compiled == compiled  # back to the programs of the default
    with pytest.raises(TypeError):
        torch.tpu.allow_excess_precision = 1


def test_custom_compiler_options_merge_and_key():
    """custom_compiler_options: nested blocks merge (inner wins), programs recompile inside, results agree."""
    x, w = _inputs(3, n=9)
    tx, tw = x.to("tpu"), w.to("tpu")
    outside = _program(tx, tw).cpu()
    assert torch.equal(_program(tx, tw).cpu(), outside)  # warm (DeferAndFuse: a plan settles on its second run)
    compiled = metrics.counts.programs_compiled
    from torch.tpu.compiler import custom_compiler_options

    with custom_compiler_options({"xla_optimization_level": "O1", "xla_cpu_enable_fast_math": True}):
        with custom_compiler_options({"xla_cpu_enable_fast_math": False}):
            assert xla_options.custom() == {"xla_optimization_level": "O1", "xla_cpu_enable_fast_math": False}
            options = dict(xla_options.current())
            assert options["optimization_level"] == 19 and options["xla_cpu_enable_fast_math"] is False
            inside = _program(tx, tw).cpu()
        assert xla_options.custom()["xla_cpu_enable_fast_math"] is True
    assert xla_options.custom() == {}
    assert metrics.counts.programs_compiled > compiled
    torch.testing.assert_close(inside, outside, atol=1e-5, rtol=1e-5)
    compiled = metrics.counts.programs_compiled
    assert torch.equal(_program(tx, tw).cpu(), outside)
    assert metrics.counts.programs_compiled == compiled  # the default programs are still cached
    with pytest.raises(ValueError, match="No such compile option|refused"):
        with custom_compiler_options({"xla_no_such_option": 1}):
            pass
    with pytest.raises(ValueError, match="O0"):
        with custom_compiler_options({"xla_optimization_level": "O7"}):
            pass
    assert xla_options.custom() == {}


def test_cache_stats_warm_second_run_hits():
    """_get_cache_stats: a second run of the same program is all hits, compiles nothing, reads entries."""
    torch.tpu._clear_cache()
    cleared = torch.tpu._get_cache_stats()
    assert cleared.per_entry_stats == ()
    x, w = _inputs(4, n=11)
    expected = _program(x, w)
    first_out = _program(x.to("tpu"), w.to("tpu")).cpu()
    first = torch.tpu._get_cache_stats()
    second_out = _program(x.to("tpu"), w.to("tpu")).cpu()
    second = torch.tpu._get_cache_stats()
    torch.testing.assert_close(first_out, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(first_out, second_out)
    assert second.num_compilations == first.num_compilations > 0
    assert second.num_cache_reqs > first.num_cache_reqs
    assert second.num_cache_hits - first.num_cache_hits == second.num_cache_reqs - first.num_cache_reqs
    assert second.num_cache_misses == first.num_cache_misses
    assert second.num_cache_hits / second.num_cache_reqs > 0
    assert len(second.per_entry_stats) == second.num_compilations - cleared.num_compilations  # one per executable
    start = datetime.datetime.now()
    for entry in second.per_entry_stats:  # compiled here: read once (its compile), with a duration
        assert entry.compilation_duration.total_seconds() > 0 and entry.read_count >= 1
        assert entry.last_read <= start
    assert torch.tpu._get_cache_requests() >= second.num_cache_reqs
    assert torch.tpu._get_cache_hits() - torch.tpu._get_cache_misses() <= torch.tpu._get_cache_requests()
    # A program cleared from the process compiles again (persistent levels are off in tests).
    torch.tpu._clear_cache()
    _program(x.to("tpu"), w.to("tpu")).cpu()
    assert torch.tpu._get_cache_stats().num_compilations > second.num_compilations


def test_cache_stats_entry_loaded_from_the_host_level(tmp_path):
    """An executable loaded from the host-shared level (not compiled here) has a zero compilation_duration."""
    from torch_tpu import cache

    x = torch.randn(17, 2).to("tpu")
    expected = torch.sinh(x.cpu()) * 3
    with cache.configured(enabled=True, dir=str(tmp_path)):
        torch.tpu._clear_cache()
        first = (torch.sinh(x) * 3).cpu()
        compiled = torch.tpu._get_cache_stats()
        assert compiled.per_entry_stats and all(e.compilation_duration.total_seconds() > 0
                                                for e in compiled.per_entry_stats)
        torch.tpu._clear_cache()  # this process forgets them; the directory keeps them
        second = (torch.sinh(x) * 3).cpu()
        loaded = torch.tpu._get_cache_stats()
    torch.testing.assert_close(first, expected)
    assert torch.equal(first, second)
    assert loaded.num_compilations == compiled.num_compilations  # nothing compiled the second time
    assert len(loaded.per_entry_stats) == len(compiled.per_entry_stats)
    assert all(e.compilation_duration.total_seconds() == 0 and e.read_count == 1 for e in loaded.per_entry_stats)


def test_cache_only_and_dump_on_miss(tmp_path):
    """_set_cache_only(True) turns a miss into an error; _set_dump_on_cache_miss writes the missed StableHLO."""
    x = torch.randn(13, 3).to("tpu")
    known = (x * 2).cpu()
    assert torch.equal((x * 2).cpu(), known)  # warm (DeferAndFuse: a plan settles on its second run)
    torch.tpu._set_cache_only(True)
    try:
        assert torch.equal((x * 2).cpu(), known)  # cached: runs
        with pytest.raises(RuntimeError, match="cache-only"):
            (x.reshape(3, 13).exp() + 7.5).cpu()
    finally:
        torch.tpu._set_cache_only(False)
    torch.testing.assert_close((x.reshape(3, 13).exp() + 7.5).cpu(), x.cpu().reshape(3, 13).exp() + 7.5)
    torch.tpu._set_dump_on_cache_miss(True, str(tmp_path))
    try:
        assert torch.tpu._get_dump_on_cache_miss()
        torch.testing.assert_close(torch.cos(x.reshape(1, 39) - 0.25).cpu(), torch.cos(x.cpu().reshape(1, 39) - 0.25))
    finally:
        torch.tpu._set_dump_on_cache_miss(False)
    assert not torch.tpu._get_dump_on_cache_miss()
    dumps = list(tmp_path.glob("*.mlir"))
    assert dumps and any("cosine" in p.read_text() for p in dumps)


def test_device_of_and_set_stream():
    """device_of(tensor) makes its device current inside the block; set_stream makes a stream (and device) current."""
    t = torch.ones(2, device="tpu:1")
    assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(t):
        assert torch.tpu.current_device() == 1
        assert (t + 1).device == torch.device("tpu:1")
    assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(torch.ones(2)):  # a CPU tensor: no change
        assert torch.tpu.current_device() == 0
    s = torch.tpu.Stream(device=2)
    try:
        torch.tpu.set_stream(s)
        assert torch.tpu.current_device() == 2 and torch.tpu.current_stream() == s
        torch.tpu.set_stream(None)
        assert torch.tpu.current_stream() == s
    finally:
        torch.tpu.set_device(0)


def test_topology_aware_mesh_and_launch_env(monkeypatch):
    """topology_aware_mesh gives the ranks in device order; the deprecated alias warns; launch env is idempotent."""
    import torch_tpu._internal.distributed as internal_distributed

    assert torch.tpu.distributed is torch_tpu.distributed
    assert torch.tpu.distributed.spmd_safe is internal_distributed.spmd_safe is torch_tpu.distributed.spmd_safe
    mesh = torch.tpu.distributed.topology_aware_mesh((1, 1))
    assert mesh.dtype == torch.int64 and mesh.tolist() == [[0]]
    with pytest.warns(FutureWarning, match="deprecated"):
        assert torch.equal(torch.tpu.topology_aware_mesh((1,), dcn_mesh_shape=(1,)), torch.tensor([0]))
    with pytest.raises(ValueError, match="world size"):
        torch.tpu.distributed.topology_aware_mesh((2, 2))
    from torch_tpu.topology import _ranks_in_topology_order, topology_aware_mesh

    # The layout of a 2x2 (ICI) by 2x1 (DCN) mesh of 8 ranks, as JAX lays out hybrid meshes.
    monkeypatch.setattr("torch_tpu.topology._ranks_in_topology_order", lambda world: list(range(world)))
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 8)
    assert topology_aware_mesh((2, 2), dcn_mesh_shape=(2, 1)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology_aware_mesh((2, 2), dcn_mesh_shape=(1, 2)).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _ranks_in_topology_order(1) == [0]
    # Ranks sort by (slice, physical coordinates z, y, x, core): here rank 2's device comes first.
    positions = [(0, (0, 0, 1), 0, 5), (1, (0, 0, 0), 0, 1), (0, (0, 0, 0), 0, 4), (0, (0, 1, 0), 0, 6)]

    def gather(out, obj, group=None):
        out[:] = positions

    monkeypatch.setattr("torch.distributed.all_gather_object", gather)
    assert _ranks_in_topology_order(4) == [2, 0, 3, 1]
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    changed = torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=4)
    assert changed == {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "host-a", "WORLD_SIZE": "8"}
    assert os.environ["MASTER_PORT"] == "1234"  # never overwritten
    assert torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=4) == {}


def test_internal_modules():
    """torch_tpu._internal: sync.synchronize, utils.hardware, tpu_distributed, profiler config, execution_mode."""
    from torch_tpu._internal.distributed.tpu_distributed import global_device_id
    from torch_tpu._internal.profiler import TpuProfilerConfig
    from torch_tpu._internal.sync import synchronize
    from torch_tpu._internal.utils.hardware import get_tpu_device_count, get_tpu_device_name

    x = torch.randn(6, device="tpu")
    with torch_tpu.execution_mode("defer_and_fuse"):
        y = x * 2 + 1
        flushes = metrics.flush_reasons["synchronize"]
        synchronize([y], wait=True)
        assert metrics.flush_reasons["synchronize"] == flushes + 1
        synchronize()
    torch.testing.assert_close(y.cpu(), x.cpu() * 2 + 1)
    assert get_tpu_device_name() == torch.tpu.get_device_name()
    assert get_tpu_device_count() == torch.accelerator.device_count() == torch.tpu.device_count()
    assert global_device_id() == torch_tpu.runtime.platform.get().devices[0].id
    assert torch.tpu.profiler.TpuProfilerConfig is TpuProfilerConfig
    config = TpuProfilerConfig(host_tracer_level=1, run_dir="/tmp/unused")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        (x + 1).cpu()
    assert any("aten::add" in e.name for e in prof.events())
    with pytest.raises(ValueError):
        TpuProfilerConfig(device_tracer_level=5)


ALIASES = r"""
import json, os, torch, torch_tpu
from torch_tpu import config as config_module
from torch_tpu.cache import levels, store
out = {"value_checks": torch_tpu.config.config.value_checks}
cases = {
    "tier2_disabled": {"TORCH_TPU_TIER2_COMPILATION_CACHE": "disabled"},
    "tier2_name": {"TORCH_TPU_TIER2_COMPILATION_CACHE": "run7"},
    "tier2_name_same_dir": {"TORCH_TPU_TIER2_COMPILATION_CACHE": "run7",
                            "TORCH_TPU_CACHE_DIR": os.path.join(store.default_dir(), "run7")},
    "tier2_vs_dir": {"TORCH_TPU_TIER2_COMPILATION_CACHE": "run7", "TORCH_TPU_CACHE_DIR": "/tmp/elsewhere"},
    "tier2_vs_cache_off": {"TORCH_TPU_TIER2_COMPILATION_CACHE": "run7", "TORCH_TPU_CACHE": "0"},
    "tier3": {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/tmp/tier3"},
    "tier3_vs_url": {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/tmp/tier3", "TORCH_TPU_CACHE_URL": "/tmp/other"},
    "repeats_safe": {"TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS": "safe"},
    "repeats_aggressive": {"TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS": "aggressive"},
    "repeats_off": {"TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS": "nope"},
    "repeats_vs_ours": {"TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS": "off", "TORCH_TPU_DEFER_REPEATS": "1"},
    "debug_checks_off": {"TORCH_TPU_ENABLE_DEBUG_CHECKS": "0"},
    "debug_vs_ours": {"TORCH_TPU_ENABLE_DEBUG_CHECKS": "1", "TORCH_TPU_VALUE_CHECKS": "0"},
}
base = dict(os.environ)
for name, env in cases.items():
    os.environ.clear(); os.environ.update(base); os.environ.pop("TORCH_TPU_ENABLE_DEBUG_CHECKS")
    os.environ.update(env)
    try:
        c = config_module.reload()
        s = levels._from_config()
        out[name] = {"cache": c.cache, "dir": s.dir, "url": s.url, "repeats": c.defer_repeats,
                     "value_checks": c.value_checks}
    except ValueError as err:
        out[name] = {"error": str(err)}
print("RESULT " + json.dumps(out))
"""


def test_env_var_aliases_subprocess():
    """TorchTPU's variables act as ours; both names set and disagreeing is an error naming both."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_") or k == "TORCH_TPU_NUM_CPU_DEVICES"}
    env.update(TORCH_TPU_ENABLE_DEBUG_CHECKS="1", PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", ALIASES], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert out["value_checks"] is True  # TORCH_TPU_ENABLE_DEBUG_CHECKS=1: our value checks (issue 13)
    assert out["debug_checks_off"]["value_checks"] is False
    assert out["tier2_disabled"]["cache"] is False
    from torch_tpu.cache import store

    named = os.path.join(store.default_dir(), "run7")
    assert out["tier2_name"]["cache"] is True and out["tier2_name"]["dir"] == named
    assert out["tier2_name_same_dir"]["dir"] == named
    for case, names in {"tier2_vs_dir": ("TORCH_TPU_CACHE_DIR", "TORCH_TPU_TIER2_COMPILATION_CACHE"),
                        "tier2_vs_cache_off": ("TORCH_TPU_CACHE", "TORCH_TPU_TIER2_COMPILATION_CACHE"),
                        "tier3_vs_url": ("TORCH_TPU_CACHE_URL", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"),
                        "repeats_vs_ours": ("TORCH_TPU_DEFER_REPEATS", "TORCH_TPU_INTERNAL_DETECT_REPEATED_OPS"),
                        "debug_vs_ours": ("TORCH_TPU_VALUE_CHECKS", "TORCH_TPU_ENABLE_DEBUG_CHECKS")}.items():
        error = out[case].get("error", "")
        assert all(n in error for n in names), (case, out[case])
    assert out["tier3"]["url"] == "/tmp/tier3"
    assert out["repeats_safe"]["repeats"] is True and out["repeats_aggressive"]["repeats"] is True
    assert out["repeats_off"]["repeats"] is False



def test_tpu_backend_compiles_like_cpu():
    """torch.compile(backend=TpuBackend()) runs a model as TorchTPU's backend class does; matches CPU."""
    from torch_tpu._internal.compile._backend import TpuBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    expected = model(x)
    tpu_model = model.to("tpu")
    torch._dynamo.reset()
    try:
        got = torch.compile(tpu_model, backend=TpuBackend())(x.to("tpu"))
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ torch.tpu.ops
def _ragged_reference(x, w, sizes):
    """Row group i of x times w[i], one matmul per group (rows past the last group: zeros)."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for i, size in enumerate(sizes.tolist()):
        out[start:start + size] = x[start:start + size] @ w[i]
        start += size
    return out


def test_ops_ragged_dot_matches_a_per_group_loop():
    """torch.tpu.ops.ragged_dot (and its gradients, and under torch.compile) == a per-group matmul loop on CPU."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(14, 6, generator=g), torch.randn(4, 6, 5, generator=g)
    sizes = torch.tensor([3, 0, 6, 2], dtype=torch.int32)  # 11 of 14 rows: the last 3 are zeros
    expected = _ragged_reference(x, w, sizes)
    got = torch.tpu.ops.ragged_dot(x.to("tpu"), w.to("tpu"), sizes.to("tpu"))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.cpu()[11:], torch.zeros(3, 5))
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(x, w, sizes.long()), expected)  # the CPU kernel
    # bfloat16: float32 accumulation, rounded once; at "medium" float32 operands are rounded to bfloat16.
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(torch.tpu.ops.ragged_dot(xb.to("tpu"), wb.to("tpu"), sizes.to("tpu")).cpu(),
                               _ragged_reference(xb.float(), wb.float(), sizes).bfloat16())
    with torch_tpu.precision.use("medium"):
        medium = torch.tpu.ops.ragged_dot(x.to("tpu"), w.to("tpu"), sizes.to("tpu")).cpu()
    torch.testing.assert_close(medium, _ragged_reference(xb.float(), wb.float(), sizes), atol=1e-5, rtol=1e-5)
    # Gradients (lhs: ragged_dot with rhs transposed; rhs: ragged_dot_weight_grad) vs CPU autograd of the loop.
    xt, wt = x.to("tpu").requires_grad_(), w.to("tpu").requires_grad_()
    out = torch.tpu.ops.ragged_dot(xt, wt, sizes.to("tpu"))
    (out * out.detach().cos()).sum().backward()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _ragged_reference(xc, wc, sizes)
    (ref * ref.detach().cos()).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, atol=1e-5, rtol=1e-5)
    grad = torch.randn(14, 5, generator=g)
    torch.testing.assert_close(torch.tpu.ops.ragged_dot_weight_grad(x.to("tpu"), grad.to("tpu"), sizes.to("tpu")).cpu(),
                               torch.stack([x[a:b].T @ grad[a:b] for a, b in ((0, 3), (3, 3), (3, 9), (9, 11))]),
                               atol=1e-5, rtol=1e-5)
    # torch.compile(backend="tpu"): one graph program (no eager fallback).
    torch_tpu.compile.register()
    torch._dynamo.reset()
    eager_graphs = torch_tpu.compile.stats.eager_graphs
    try:
        compiled = torch.compile(lambda a, b, s: torch.tpu.ops.ragged_dot(a, b, s) * 2, backend="tpu", fullgraph=True)
        torch.testing.assert_close(compiled(x.to("tpu"), w.to("tpu"), sizes.to("tpu")).cpu(), expected * 2,
                                   atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    assert torch_tpu.compile.stats.eager_graphs == eager_graphs
    with pytest.raises(RuntimeError, match="group_sizes of shape \\[4\\]"):
        torch.tpu.ops.ragged_dot(x.to("tpu"), w.to("tpu"), sizes[:3].to("tpu"))
    with pytest.raises(RuntimeError, match="columns"):
        torch.tpu.ops.ragged_dot(x.to("tpu"), w.to("tpu").transpose(1, 2), sizes.to("tpu"))


def test_ops_optimization_barrier(tmp_path):
    """optimization_barrier: values and structure unchanged, gradient passes, the program holds XLA's barrier."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 7, generator=g), torch.randn(5, generator=g)
    ta = a.to("tpu").requires_grad_()
    torch.tpu._set_dump_on_cache_miss(True, str(tmp_path))
    try:
        out = torch.tpu.ops.optimization_barrier((ta * 3, b.to("tpu")))
        assert isinstance(out, tuple) and len(out) == 2
        single = torch.tpu.ops.optimization_barrier(b.to("tpu") + 2)
        got = (out[0].cpu(), out[1].cpu(), single.cpu())
    finally:
        torch.tpu._set_dump_on_cache_miss(False)
    assert torch.equal(got[0], a * 3) and torch.equal(got[1], b) and torch.equal(got[2], b + 2)
    assert any("optimization_barrier" in p.read_text() for p in tmp_path.glob("*.mlir"))
    (out[0] * 2).sum().backward()
    assert torch.equal(ta.grad.cpu(), torch.full((3, 7), 6.0))
    assert isinstance(torch.tpu.ops.optimization_barrier([b.to("tpu")]), list)
    with pytest.raises(TypeError, match="sequence of tensors"):
        torch.tpu.ops.optimization_barrier([1, 2])
    torch_tpu.compile.register()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: torch.tpu.ops.optimization_barrier([x.sin(), x + 1]), backend="tpu",
                                 fullgraph=True)
        s, p = compiled(a.to("tpu"))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(s.cpu(), a.sin())
    assert torch.equal(p.cpu(), a + 1)


def test_ops_collectives_need_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch.tpu.ops.all_gather_dim(torch.ones(2, device="tpu"), 0)


@pytest.mark.one_mode  # the program runs Strict and DeferAndFuse itself
def test_ops_collectives_dim_two_processes():
    """all_gather_dim / reduce_scatter_dim (their gradients, compiled) on 2 processes == gloo on CPU; ragged_all_to_all
    (uneven rows, spare rows, gradients) == the rows every rank's CPU inputs route."""
    from dist_launch import launch

    results = launch("collectives_dim", 2, timeout=300, script="compat_dist_programs.py")
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-6000:]}"
    passed = {c for _, out in results for line in out.splitlines() if line.startswith("CHECKS ")
              for c in line[len("CHECKS "):].split(",")}
    for mode in ("strict", "defer_and_fuse"):
        for name in ("all_gather_dim 0", "all_gather_dim -1", "reduce_scatter_dim -1", "reduce_scatter_dim max",
                     "all_gather_dim grad", "reduce_scatter_dim grad"):
            assert f"{name} {mode}" in passed, f"{name} {mode}"
        for name in ("ragged_all_to_all", "ragged_all_to_all operand grad", "ragged_all_to_all output grad"):
            assert f"{name} {mode}" in passed, f"{name} {mode}"
    assert "compiled all_gather_dim + reduce_scatter_dim" in passed
    assert "indivisible dimension is a ValueError" in passed


# ------------------------------------------------------------------ torch.tpu.optimizers
def _mlp(bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=bias), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=bias))


_BATCHES = [(torch.randn(5, 6, generator=torch.Generator().manual_seed(i)),
             torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + i))) for i in range(3)]


def _torch_optim(model, cls, **kw):
    import copy

    model = copy.deepcopy(model)
    opt = cls(model.parameters(), **kw)
    losses = []
    for x, y in _BATCHES:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses


def _functional_steps(model, opt):
    import copy

    model = copy.deepcopy(model).to("tpu")
    group = opt.init_param_group(model)
    for x, y in _BATCHES:
        params = {k: v.detach().requires_grad_() for k, v in group.params.items()}
        loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x.to("tpu"),)), y.to("tpu"))
        group = opt(group, dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
    return group


def test_optimizers_match_torch_optim():
    """AdamW, Sgd and Muon of torch.tpu.optimizers, stepped on tpu, == torch.optim's classes on CPU."""
    O = torch.tpu.optimizers
    cases = [
        (_mlp(), O.AdamW(lr=1e-2, weight_decay=0.05, use_bfloat16_moments=False), torch.optim.AdamW,
         dict(lr=1e-2, weight_decay=0.05), 1e-6),
        (_mlp(), O.AdamW(lr=1e-2), torch.optim.AdamW, dict(lr=1e-2), 1e-3),  # bfloat16 moments
        (_mlp(), O.Sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), torch.optim.SGD,
         dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), 1e-6),
        (_mlp(), O.Sgd(lr=0.1, momentum=0.8, nesterov=True), torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True),
         1e-6),
        (_mlp(bias=False), O.Muon(lr=0.02), torch.optim.Muon, dict(lr=0.02), 1e-5),
    ]
    for model, ours, cls, kw, tol in cases:
        expected, _ = _torch_optim(model, cls, **kw)
        group = _functional_steps(model, ours)
        for name, value in expected.items():
            torch.testing.assert_close(group.params[name].cpu(), value.detach(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{type(ours).__name__} {name}: {m}")
        assert all(float(s.cpu()) == len(_BATCHES) for s in group.opt_steps.values())
    group = O.AdamW().init_param_group(_mlp())
    assert group.opt_state_m["0.weight"].dtype == torch.bfloat16 and isinstance(O.AdamW(), O.Optimizer)
    with pytest.raises(ValueError, match="beta1"):
        O.AdamW(beta1=1.5)
    with pytest.raises(ValueError, match="2D"):
        O.Muon().init_param_group(_mlp())


def test_single_trace_trainer_is_one_program():
    """SingleTraceTrainer: forward, loss, backward and AdamW as one compiled program per step; == torch.optim."""
    O = torch.tpu.optimizers
    model = _mlp()
    expected, losses = _torch_optim(model, torch.optim.AdamW, lr=1e-2)
    import copy

    tpu_model = copy.deepcopy(model).to("tpu")
    trainer = O.SingleTraceTrainer(tpu_model, O.AdamW(lr=1e-2, use_bfloat16_moments=False))
    stats = torch_tpu.compile.stats
    graphs, plans, calls = stats.graphs, stats.plans, stats.calls
    step = trainer.make_compiled_train_step(_BATCHES[0][0].to("tpu"), _BATCHES[0][1].to("tpu"))
    got = [step(x.to("tpu"), y.to("tpu")).item() for x, y in _BATCHES]
    assert (stats.graphs - graphs, stats.plans - plans, stats.calls - calls) == (1, 1, len(_BATCHES))
    assert stats.eager_graphs == 0 or stats.graphs > graphs
    torch.testing.assert_close(got, losses, atol=1e-5, rtol=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(trainer.params[name].cpu(), value.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dict(tpu_model.named_parameters())[name].cpu(), value.detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="targets"):
        step(_BATCHES[0][0].to("tpu"))
    # Buffers the model updates (BatchNorm's running stats) are kept current too; Sgd with momentum.
    torch.manual_seed(1)
    bn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    tpu_bn = copy.deepcopy(bn).to("tpu")
    reference = copy.deepcopy(bn)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = O.SingleTraceTrainer(tpu_bn, O.Sgd(lr=0.1, momentum=0.9)).make_compiled_train_step(
        _BATCHES[0][0].to("tpu"), _BATCHES[0][1].to("tpu"))
    for x, y in _BATCHES:
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        step(x.to("tpu"), y.to("tpu"))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(tpu_bn.state_dict()[name].cpu(), value, atol=1e-5, rtol=1e-5, msg=lambda m: name)


def test_profiler_config_writes_the_device_trace(tmp_path):
    """A profile with TpuProfilerConfig(run_dir=...) writes XLA's XPlane file there; device_tracer_level=0 does not."""
    from torch_tpu._internal.profiler import TpuProfilerConfig, written

    x = torch.randn(9, device="tpu")
    with torch.profiler.profile(experimental_config=TpuProfilerConfig(run_dir=str(tmp_path / "a"), worker_rank=1)):
        (x.exp() + 1).cpu()
    files = written(str(tmp_path / "a"))
    assert len(files) == 1 and files[0].endswith("_1.xplane.pb") and os.path.getsize(files[0]) > 0
    with torch.profiler.profile(experimental_config=TpuProfilerConfig(run_dir=str(tmp_path / "b"),
                                                                       device_tracer_level=0)):
        (x + 1).cpu()
    assert written(str(tmp_path / "b")) == []


def test_autocast_helpers():
    """torch.tpu._is_autocast_enabled / _get_autocast_dtype / _set_autocast_dtype drive torch.autocast("tpu")."""
    a = torch.randn(4, 4, device="tpu")
    assert torch.tpu._get_autocast_dtype() is torch.bfloat16 and not torch.tpu._is_autocast_enabled()
    with torch.autocast("tpu"):
        assert torch.tpu._is_autocast_enabled()
        assert (a @ a).dtype is torch.bfloat16
    torch.tpu._set_autocast_dtype(torch.float16)
    try:
        with torch.autocast("tpu"):
            out = a @ a
        assert out.dtype is torch.float16
        torch.testing.assert_close(out.cpu(), (a.cpu().half().float() @ a.cpu().half().float()).half())
    finally:
        torch.tpu._set_autocast_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported autocast dtype"):
        torch.tpu._set_autocast_dtype(torch.int8)
    torch.tpu._lazy_init()  # the runtime is up: a no-op
