"""Compile cache pieces that need no device: entry envelopes, the host directory, the remote store, settings."""
import os
import stat
import threading
import time

import pytest

from torch_tpu import config as config_module
from torch_tpu.cache import entry, store

# The store is files and locks: no execution mode changes it.
pytestmark = pytest.mark.one_mode

KEY = "ab" * 32


# ---------------------------------------------------------------- entries


def test_entry_round_trip():
    """An entry gives back its payload and metadata under its own key."""
    payload = bytes(range(256)) * 10
    blob = entry.encode(KEY, payload, compile_seconds=1.5, kind="executable")
    metadata, out = entry.decode(KEY, blob)
    assert out == payload
    assert metadata["compile_seconds"] == 1.5 and metadata["kind"] == "executable" and metadata["size"] == len(payload)


def test_truncated_entries_are_refused():
    """Every prefix of an entry is refused."""
    blob = entry.encode(KEY, b"x" * 200)
    for cut in range(len(blob)):
        with pytest.raises(entry.CorruptEntry):
            entry.decode(KEY, blob[:cut])


@pytest.mark.parametrize("position", [0, 5, 10, 20, 60, -40, -1])
def test_flipped_bytes_are_refused(position):
    """One flipped byte anywhere (magic, header, payload, digest) is refused."""
    blob = bytearray(entry.encode(KEY, b"payload" * 20))
    blob[position] ^= 0x01
    with pytest.raises(entry.CorruptEntry):
        entry.decode(KEY, bytes(blob))


def test_entry_under_another_key_is_refused():
    """A valid entry copied under another name is refused: the digest covers the key."""
    blob = entry.encode(KEY, b"payload")
    with pytest.raises(entry.CorruptEntry, match="another key"):
        entry.decode("cd" * 32, blob)


def test_entry_is_not_a_pickle():
    """Entries are magic + JSON + raw bytes, never pickle streams."""
    blob = entry.encode(KEY, b"\x80\x04payload")
    assert blob.startswith(entry.MAGIC) and not blob.startswith(b"\x80")


# ---------------------------------------------------------------- host directory


def test_host_dir_is_created_private(tmp_path):
    """A new level-2 directory is owner-only (0700), whatever the umask."""
    old = os.umask(0)
    try:
        host = store.HostStore(str(tmp_path / "cache"), 1 << 20, 5)
    finally:
        os.umask(old)
    assert host.usable
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722, 0o702])
def test_dir_writable_by_others_is_refused(tmp_path, mode):
    """A directory that group or others can write is refused with the reason."""
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    host = store.HostStore(str(path), 1 << 20, 5)
    assert not host.usable
    assert "other users can write" in host.refused


def test_symlinked_dir_is_refused(tmp_path):
    """A symbolic link in place of the directory (planted by someone else) is refused."""
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    host = store.HostStore(str(tmp_path / "link"), 1 << 20, 5)
    assert not host.usable and "symbolic link" in host.refused


def test_dir_in_world_writable_non_sticky_parent_is_refused(tmp_path):
    """Others could swap the directory out of a world-writable parent without the sticky bit."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    host = store.HostStore(str(parent / "cache"), 1 << 20, 5)
    assert not host.usable and "parent" in host.refused
    parent.chmod(0o1777)
    assert store.HostStore(str(parent / "cache2"), 1 << 20, 5).usable


def test_put_get_drop_and_file_modes(tmp_path):
    """Entries are written whole, readable back, private (0600) and removable."""
    host = store.HostStore(str(tmp_path / "c"), 1 << 20, 5)
    assert host.get("k.exe") is None
    host.put("k.exe", b"data")
    assert host.get("k.exe") == b"data"
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "k.exe").st_mode) == 0o600
    assert [name for name, _, _ in host.entries()] == ["k.exe"]
    host.drop("k.exe")
    assert host.get("k.exe") is None


def test_symlinked_entry_is_not_followed(tmp_path):
    """An entry replaced by a symbolic link reads as missing."""
    host = store.HostStore(str(tmp_path / "c"), 1 << 20, 5)
    (tmp_path / "elsewhere").write_bytes(b"planted")
    os.symlink(tmp_path / "elsewhere", tmp_path / "c" / "k.exe")
    assert host.get("k.exe") is None


def test_lru_eviction_keeps_recently_used(tmp_path):
    """Beyond the size limit the least recently used entries go first; a read counts as a use."""
    host = store.HostStore(str(tmp_path / "c"), 1000, 5)
    now = time.time()
    for i in range(3):
        host.put(f"e{i}.exe", b"x" * 300)
        os.utime(tmp_path / "c" / f"e{i}.exe", (now - 100 + i, now - 100 + i))
    assert host.get("e0.exe") is not None  # e0 is now the most recently used
    host.put("e3.exe", b"x" * 300)  # 1200 bytes > 1000: evict down to 900
    names = sorted(name for name, _, _ in host.entries())
    assert names == ["e0.exe", "e2.exe", "e3.exe"]
    assert host.evictions == 1


def test_writes_do_not_rescan_the_directory_each_time(tmp_path, monkeypatch):
    """A scan stats every entry (~0.5 s for 80,000): writes count their bytes and rescan at most every
    _RESCAN_SECONDS, and the limit still evicts."""
    host = store.HostStore(str(tmp_path / "c"), 10_000, 5)
    scans = []
    entries = host.entries
    monkeypatch.setattr(host, "entries", lambda: scans.append(1) or entries())
    for i in range(30):
        host.put(f"e{i}.exe", b"x" * 100)
    assert len(scans) == 1 and host.evictions == 0
    for i in range(30, 80):  # 8000 bytes written past the 3000 held: over the limit once
        host.put(f"e{i}.exe", b"x" * 160)
    assert host.evictions > 0 and len(scans) <= 3
    assert sum(size for _, size, _ in entries()) <= 10_000
    monkeypatch.setattr(store, "_RESCAN_SECONDS", 0.0)  # another process's writes show at the next scan
    (tmp_path / "c" / "other.exe").write_bytes(b"y" * 9000)
    host.put("last.exe", b"z")
    assert sum(size for _, size, _ in entries()) <= 10_000


def test_single_flight_waits_then_times_out(tmp_path):
    """A second holder of the same key waits while the first holds it, and gives up after the timeout."""
    host = store.HostStore(str(tmp_path / "c"), 1 << 20, 0.3)
    with host.single_flight("k") as first:
        assert first.acquired and not first.waited
        with host.single_flight("k") as second:  # another open file: flock conflicts as across processes
            assert not second.acquired and second.waited and second.seconds >= 0.3
        with host.single_flight("other") as third:
            assert third.acquired and not third.waited


def test_single_flight_is_released_for_a_waiter(tmp_path):
    """A waiter gets the lock as soon as the holder releases it."""
    host = store.HostStore(str(tmp_path / "c"), 1 << 20, 10)
    held = threading.Event()
    release = threading.Event()

    def holder():
        with host.single_flight("k"):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    threading.Timer(0.2, release.set).start()
    with host.single_flight("k") as flight:
        assert flight.acquired and flight.waited
    thread.join()


def test_clear_removes_entries(tmp_path):
    """clear() empties the directory's entries and says how many."""
    host = store.HostStore(str(tmp_path / "c"), 1 << 20, 5)
    host.put("a.exe", b"1")
    host.put("b.idx", b"2")
    assert host.clear() == 2 and host.entries() == []


# ---------------------------------------------------------------- remote store


def test_remote_file_url_round_trip(tmp_path):
    """Writes are queued and land at the URL; reads find them; a missing entry is None."""
    remote = store.RemoteStore(f"file://{tmp_path}/remote")
    remote.put("a.exe", b"hello")
    assert remote.flush(30)
    assert remote.get("a.exe") == b"hello"
    assert remote.get("missing.exe") is None
    assert remote.writes == 1 and remote.usable
    assert [name for name, _ in remote.entries()] == ["a.exe"]


def test_failing_remote_warns_once_and_is_skipped(tmp_path):
    """A remote that errors is warned about once and disabled for the process."""
    (tmp_path / "afile").write_bytes(b"not a directory")
    remote = store.RemoteStore(f"file://{tmp_path}/afile/cache")
    with pytest.warns(RuntimeWarning, match="skipped for the rest of this process") as record:
        remote.put("a.exe", b"x")
        remote.flush(30)
        assert remote.get("a.exe") is None
        remote.put("b.exe", b"y")
    assert len(record) == 1
    assert not remote.usable and remote.writes == 0


def test_unknown_protocol_disables_remote():
    """A URL no fsspec implementation knows disables level 3 with a warning."""
    with pytest.warns(RuntimeWarning, match="remote compile cache"):
        remote = store.RemoteStore("nosuchprotocol://bucket/x")
    assert not remote.usable and remote.get("a.exe") is None


# ---------------------------------------------------------------- settings


@pytest.fixture
def environ(monkeypatch):
    yield monkeypatch
    monkeypatch.undo()
    config_module.reload()


def test_cache_env_vars_are_parsed(environ, tmp_path):
    """TORCH_TPU_CACHE* variables reach the config."""
    environ.setenv("TORCH_TPU_CACHE", "1")
    environ.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))
    environ.setenv("TORCH_TPU_CACHE_URL", "s3://bucket/prefix")
    environ.setenv("TORCH_TPU_CACHE_MAX_MB", "64")
    environ.setenv("TORCH_TPU_CACHE_LOCK_TIMEOUT", "7")
    c = config_module.reload()
    assert (c.cache, c.cache_dir, c.cache_url, c.cache_max_mb, c.cache_lock_timeout) == (
        True, str(tmp_path), "s3://bucket/prefix", 64, 7)
    environ.setenv("TORCH_TPU_CACHE", "off")
    assert config_module.reload().cache is False
    environ.delenv("TORCH_TPU_CACHE")
    assert config_module.reload().cache is True  # on by default


def test_bad_cache_env_vars_raise(environ):
    """Malformed values are errors, not silently ignored."""
    environ.setenv("TORCH_TPU_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="TORCH_TPU_CACHE_MAX_MB"):
        config_module.reload()
    environ.setenv("TORCH_TPU_CACHE_MAX_MB", "64")
    environ.setenv("TORCH_TPU_CACHE", "maybe")
    with pytest.raises(ValueError, match="TORCH_TPU_CACHE"):
        config_module.reload()


def test_default_dir_is_per_user():
    """The default directory names the user (uid) and sits on /dev/shm when there is one."""
    path = store.default_dir()
    assert str(os.geteuid()) in path or "torch_tpu" in path
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert path.startswith("/dev/shm/")
