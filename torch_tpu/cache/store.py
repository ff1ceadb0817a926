"""Where persistent entries live: the host-shared directory and the remote URL.

Owns: level 2 (a private directory shared by one user's processes on a host:
owner-only permissions, atomic writes, single-flight locks, size limit with
least-recently-used eviction) and level 3 (any fsspec URL, written by a
background thread, disabled for the process after its first failure). Stores
move opaque, already-enveloped bytes; they never look inside them. No JAX here:
the CLI uses this module without starting a runtime.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import stat
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUFFIXES = (".exe", ".idx")  # executables, program-index records
_LOCKS = "locks"
_TMP = "tmp"
_POLL_SECONDS = 0.02
_STALE_TMP_SECONDS = 3600
_RESCAN_SECONDS = 60.0


def default_dir() -> str:
    """A private directory on a RAM-backed filesystem when there is one, else under ~/.cache."""
    uid = os.geteuid()
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return os.path.join(shm, f"torch_tpu-cache-{uid}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_tpu", "compile-cache")


def check_private(path: str) -> str | None:
    """Why `path` is unsafe as a cache directory (another user could write it), or None if it is private."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"cannot stat it ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
    parent = os.path.dirname(os.path.abspath(path))
    try:
        pst = os.stat(parent)
    except OSError as err:
        return f"cannot stat its parent ({err.strerror})"
    if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
        # Others could rename it away and put their own directory in its place.
        return f"its parent {parent} is writable by other users and not sticky (mode {stat.S_IMODE(pst.st_mode):04o})"
    return None


@dataclass
class Flight:
    """The outcome of waiting for a program's single-flight lock."""

    acquired: bool  # this process holds the lock (and so compiles)
    waited: bool  # another process held it when we asked
    seconds: float  # time spent waiting


class HostStore:
    """Level 2: one file per entry in a private directory; `usable` is False if it was refused."""

    def __init__(self, path: str, max_bytes: int, lock_timeout: float):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.max_bytes = max_bytes
        self.lock_timeout = lock_timeout
        self.evictions = 0
        self._size: int | None = None  # bytes in the directory: the last scan plus this process's writes since
        self._scanned = 0.0
        self.refused: str | None = None
        try:
            created = not os.path.lexists(self.path)
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            if created:
                os.chmod(self.path, 0o700)  # whatever the umask
        except OSError as err:
            self.refused = f"cannot create it ({err.strerror})"
        if self.refused is None:
            self.refused = check_private(self.path)
        if self.refused is None:
            for sub in (_LOCKS, _TMP):
                os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)

    @property
    def usable(self) -> bool:
        return self.refused is None

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def get(self, name: str) -> bytes | None:
        """The entry's bytes (marking it recently used), or None."""
        path = self._file(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # missing, or a symbolic link planted in its place
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least-recently-used order is modification time
        return data

    def put(self, name: str, data: bytes) -> None:
        """Write an entry atomically (readers see the old entry, or none, or the whole new one)."""
        fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=os.path.join(self.path, _TMP))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._file(name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.max_bytes:
            self._grown(len(data))

    def _grown(self, nbytes: int) -> None:
        """Evict when the directory passes its limit. Its size is scanned at most every
        _RESCAN_SECONDS (a scan stats every entry: ~0.5 s for 80,000 of them) and counted up with
        this process's writes in between (other processes' writes show at the next scan)."""
        now = time.monotonic()
        if self._size is None or now - self._scanned > _RESCAN_SECONDS:
            self._size, self._scanned = self.size(), now
        else:
            self._size += nbytes
        if self._size > self.max_bytes:
            self.evict()

    def drop(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(name))

    def entries(self) -> list[tuple[str, int, float]]:
        """(name, bytes, last use) of every entry."""
        out = []
        try:
            scan = os.scandir(self.path)
        except OSError:
            return out
        with scan:
            for item in scan:
                if item.name.endswith(SUFFIXES):
                    with contextlib.suppress(OSError):
                        st = item.stat(follow_symlinks=False)
                        out.append((item.name, st.st_size, st.st_mtime))
        return out

    def size(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self) -> int:
        """Drop least recently used entries until the directory is at 90% of its limit."""
        with self._lock_file(".evict") as fd:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # another process is evicting
            entries = sorted(self.entries(), key=lambda e: e[2])
            total = sum(size for _, size, _ in entries)
            target = int(self.max_bytes * 0.9)
            dropped = 0
            for name, size, _ in entries:
                if total <= target:
                    break
                self.drop(name)
                total -= size
                dropped += 1
            self._sweep_tmp()
            self._size, self._scanned = total, time.monotonic()
        self.evictions += dropped
        return dropped

    def _sweep_tmp(self) -> None:
        now = time.time()
        tmp = os.path.join(self.path, _TMP)
        with contextlib.suppress(OSError), os.scandir(tmp) as scan:
            for item in scan:
                with contextlib.suppress(OSError):
                    if now - item.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(item.path)

    def clear(self) -> int:
        """Remove every entry; the number removed."""
        names = [name for name, _, _ in self.entries()]
        for name in names:
            self.drop(name)
        return len(names)

    @contextlib.contextmanager
    def _lock_file(self, name: str):
        fd = os.open(os.path.join(self.path, _LOCKS, name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            yield fd
        finally:
            os.close(fd)  # closing releases the flock

    @contextlib.contextmanager
    def single_flight(self, key: str):
        """Hold `key`'s lock: one process compiles, the others wait for its entry.

        Yields a Flight. If the lock is not free within `lock_timeout` seconds,
        yields acquired=False (the caller compiles anyway). A holder that dies
        releases the lock with its file descriptor: no stale locks.
        """
        with self._lock_file(key + ".lock") as fd:
            start = time.monotonic()
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    acquired = True
                    break
                except OSError as err:
                    if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    waited = True
                    if time.monotonic() - start >= self.lock_timeout:
                        acquired = False
                        break
                    time.sleep(_POLL_SECONDS)
            yield Flight(acquired, waited, time.monotonic() - start)


class RemoteStore:
    """Level 3: entries at `url` through fsspec; writes go through a background thread.

    The first error (other than a missing entry) is warned about once and
    disables the level for the rest of the process.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.error: str | None = None
        self.writes = 0
        self.pending = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._made_root = False
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except Exception as err:  # an unknown protocol, a missing fsspec implementation
            self.fs = self.root = None
            self.fail(err)

    @property
    def usable(self) -> bool:
        return self.error is None

    def fail(self, err: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"torch_tpu: the remote compile cache {self.url} failed ({self.error}); "
                "it is skipped for the rest of this process",
                RuntimeWarning,
                stacklevel=2,
            )

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def get(self, name: str) -> bytes | None:
        if not self.usable:
            return None
        try:
            return self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as err:
            self.fail(err)
            return None

    def put(self, name: str, data: bytes) -> None:
        """Queue a write; returns at once."""
        if not self.usable:
            return
        with self._idle:
            self.pending += 1
        self._queue.put((name, data))
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="torch_tpu-cache-remote", daemon=True)
            self._thread.start()

    def _writer(self) -> None:
        while True:
            name, data = self._queue.get()
            try:
                if self.usable:
                    if not self._made_root:
                        self.fs.makedirs(self.root, exist_ok=True)
                        self._made_root = True
                    self.fs.pipe_file(self._path(name), data)
                    self.writes += 1
            except Exception as err:
                self.fail(err)
            finally:
                with self._idle:
                    self.pending -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are done; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self.pending == 0, timeout)

    def entries(self) -> list[tuple[str, int]]:
        """(name, bytes) of every entry (for `torch-tpu cache info --remote`)."""
        if not self.usable:
            return []
        try:
            listing = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except Exception as err:
            self.fail(err)
            return []
        return [(item["name"].rsplit("/", 1)[-1], int(item.get("size") or 0)) for item in listing
                if item["name"].endswith(SUFFIXES)]

    def clear(self) -> int:
        names = [name for name, _ in self.entries()]
        for name in names:
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass
            except Exception as err:
                self.fail(err)
                break
        return len(names)
