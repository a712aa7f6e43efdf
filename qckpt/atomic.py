"""Writing a directory or a file atomically: a temp name beside the target, renamed at the end.

Every output qckpt writes goes through here (export and convert dirs, the calibration file,
``--json`` reports, plots), so a crash, a full disk or Ctrl-C never leaves a half output under
the target's name, and never touches anything but the target.

* The temp is ``.{name}.qckpt-tmp-{host}-{pid}-{token}`` in the target's directory (the same
  filesystem, so the last step is one rename). ``host`` is a short hash of the host name: on a
  shared filesystem a run on another host never mistakes a live temp for a stale one.
* Stale temps (this host, their process gone: a SIGKILL) are removed when the next write to the
  same target starts.
* Commit: every file is fsynced and given the mode the umask asks for (some writers, safetensors
  among them, create 0600 files), the dirs are fsynced, then the temp is renamed:
  - without ``replace``: ``renameat2(RENAME_NOREPLACE)``, so a target that appeared while we
    wrote is refused atomically: of two runs racing for one target exactly one wins. Where the
    kernel or filesystem lacks it, a file falls back to ``link`` (which refuses an existing name
    atomically too) and a dir to ``rename`` (which refuses a non-empty target);
  - with ``replace``: the old target is renamed aside (``.{name}.qckpt-old-*``), the temp renamed
    in, the old one deleted. A crash between the two renames leaves the old output under its
    hidden name and no target, never a half one.
* Failure, SIGINT or SIGTERM (turned into :class:`Interrupted` while a write runs) remove the
  temp. Disk-full, file-too-large, read-only and permission errors become one
  :class:`~qckpt.errors.OutputError` line naming the output.

The target is written where its path resolves (a symlink is followed, the link itself stays).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from qckpt.errors import OutputError, QckptError

TEMP_TAG = ".qckpt-tmp-"
OLD_TAG = ".qckpt-old-"
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# errors that are about the write itself, whatever file they name
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class Interrupted(KeyboardInterrupt):
    """SIGTERM while qckpt writes: unwinds as Ctrl-C does, so the temp is removed."""


def resolve(path: str | os.PathLike) -> Path:
    """Where a path really points: ``~`` expanded, made absolute, every symlink followed."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


# --------------------------------------------------------------------------------------------
# small pieces


def host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _hidden(target: Path, tag: str) -> Path:
    # the target's suffix is kept last, so a writer that picks a format from it (a plot) still can
    token = f"{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
    return target.with_name(f".{target.name}{tag}{token}{target.suffix}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove temps of earlier writes to ``target`` by dead processes of this host."""
    prefix = f".{target.name}{TEMP_TAG}"
    removed = []
    with contextlib.suppress(OSError):
        for p in target.parent.iterdir():
            if not p.name.startswith(prefix):
                continue
            host, _, rest = p.name[len(prefix) :].partition("-")
            pid = rest.partition("-")[0]
            if host == host_tag() and pid.isdigit() and not _pid_alive(int(pid)):
                _remove(p)
                removed.append(p)
    return removed


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def umask() -> int:
    """The process umask, read without changing it (Linux), else by setting it back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(path: Path) -> None:
    """Modes as the umask asks, then every file and dir fsynced, deepest first."""
    mask = umask()
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)
        _fsync(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                os.chmod(p, 0o666 & ~mask)
                _fsync(p)
        for d in dirs:
            p = Path(root) / d
            if not p.is_symlink():
                os.chmod(p, 0o777 & ~mask)
        _fsync(Path(root))
    os.chmod(path, 0o777 & ~mask)


def _make_parent(target: Path, key: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # a file where a directory of the path should be
        raise OutputError(f"{key}: cannot write {target}: a file is in the way") from None


def renameat2() -> Callable | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; FileExistsError (and nothing moved) when ``dst`` exists."""
    fn = renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(dst))
    # no RENAME_NOREPLACE here: link() refuses an existing name atomically; for a dir, rename()
    # refuses a non-empty target, which leaves only an empty dir appearing meanwhile to replace
    if src.is_dir() and not src.is_symlink():
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
            raise
    else:
        os.link(src, dst)
        os.unlink(src)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the target is swapped or the temp removed, so an
    interrupt cannot tear those steps; a pending one is delivered right after."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While it runs, SIGTERM raises :class:`Interrupted` (main thread only; Python allows no
    handler elsewhere), so ``finally`` blocks and temp cleanup run as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _on_term(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause/context, or a DCP rank failure."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                stack.append(v[0] if isinstance(v, tuple) else v)
        stack += [e.__cause__, e.__context__]
    return None


def write_error(exc: BaseException, target: Path, key: str, tmp: Path | None) -> OutputError | None:
    """An OutputError naming the output for an error of the write itself, else None."""
    if isinstance(exc, QckptError | KeyboardInterrupt):  # already said, or not an error
        return None
    os_exc = _os_error(exc)
    if os_exc is None:
        return None
    name = os_exc.filename
    ours = name is None or any(
        str(name).startswith(str(p)) for p in (target, target.parent, tmp) if p is not None
    )
    if os_exc.errno not in _WRITE_ERRNOS and not (
        ours and os_exc.errno in (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR)
    ):
        return None
    reason = os.strerror(os_exc.errno).lower()
    return OutputError(f"{key}: cannot write {target}: {reason}")


# --------------------------------------------------------------------------------------------
# directories


class AtomicDir:
    """A directory built under a temp name beside ``target``, then renamed into place.

    ``begin()`` -> the temp dir to write into; ``commit()`` renames it to the target;
    ``abort()`` removes it. :func:`atomic_dir` wraps the three for one process; a multi-rank
    writer calls them itself (``begin``/``commit`` on one rank, the temp path broadcast).

    ``replace``: an existing target may be replaced, and ``may_replace(target)`` (raise to
    refuse) is asked right before the swap, since the target may have changed meanwhile.
    """

    def __init__(
        self,
        target: str | os.PathLike,
        *,
        key: str = "output",
        replace: bool = False,
        may_replace: Callable[[Path], None] | None = None,
    ) -> None:
        self.target = resolve(target)
        self.key = key
        self.replace = replace
        self.may_replace = may_replace
        self.tmp: Path | None = None

    def _error(self, exc: BaseException) -> OutputError | None:
        return write_error(exc, self.target, self.key, self.tmp)

    def begin(self) -> Path:
        try:
            _make_parent(self.target, self.key)
            remove_stale_temps(self.target)
            tmp = _hidden(self.target, TEMP_TAG)
            tmp.mkdir()
        except OSError as exc:
            raise (self._error(exc) or exc) from exc
        self.tmp = tmp
        return tmp

    def commit(self) -> Path:
        assert self.tmp is not None, "commit() before begin()"
        try:
            _finish(self.tmp)
            with _signals_blocked():
                if self.replace and os.path.lexists(self.target):
                    if self.may_replace is not None:
                        self.may_replace(self.target)
                    _swap(self.tmp, self.target)
                else:
                    rename_noreplace(self.tmp, self.target)
                self.tmp = None
            _fsync(self.target.parent)
        except FileExistsError:
            raise OutputError(
                f"{self.key}: {self.target} appeared while this command wrote it "
                "(another run?); refusing to replace it"
            ) from None
        except OSError as exc:
            raise (self._error(exc) or exc) from exc
        return self.target

    def abort(self) -> None:
        if self.tmp is not None:
            with _signals_blocked():
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def discard_temp(tmp: Path) -> None:
    """Remove a temp dir that another process (a multi-rank writer's main rank) made and may
    still be committing: it is first renamed to a temp name of this process, so that either
    the owner's rename or this one wins, atomically, and a commit never renames a dir that is
    half removed. Gone already (committed or removed): nothing to do."""
    target = tmp.with_name(tmp.name.split(TEMP_TAG, 1)[0][1:] or tmp.name)
    mine = _hidden(target, TEMP_TAG)
    try:
        os.rename(tmp, mine)
    except OSError:
        return
    with _signals_blocked():
        shutil.rmtree(mine, ignore_errors=True)


def _swap(tmp: Path, target: Path) -> None:
    """Replace ``target`` by ``tmp``: rename the old one aside, rename the new one in, delete."""
    old: Path | None = _hidden(target, OLD_TAG)
    try:
        os.rename(target, old)
    except FileNotFoundError:  # gone meanwhile: nothing to set aside
        old = None
    try:
        rename_noreplace(tmp, target)
    except BaseException:
        if old is not None:
            try:
                rename_noreplace(old, target)
            except OSError:  # another run put its own output there; the old one was to go
                _remove(old)
        raise
    if old is not None:
        _remove(old)


@contextlib.contextmanager
def atomic_dir(
    target: str | os.PathLike,
    *,
    key: str = "output",
    replace: bool = False,
    may_replace: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """``with atomic_dir(target) as tmp:`` write into ``tmp``; it becomes ``target`` on success
    and disappears on any failure, SIGINT or SIGTERM."""
    d = AtomicDir(target, key=key, replace=replace, may_replace=may_replace)
    with terminate_as_interrupt():
        tmp = d.begin()
        try:
            yield tmp
            d.commit()
        except BaseException as exc:
            d.abort()
            err = d._error(exc)
            if err is not None:
                raise err from exc
            raise


# --------------------------------------------------------------------------------------------
# files


@contextlib.contextmanager
def atomic_file(
    target: str | os.PathLike, *, key: str = "output", replace: bool = True
) -> Iterator[Path]:
    """``with atomic_file(target) as tmp:`` write the file ``tmp`` (the writer creates it); it
    becomes ``target`` on success and disappears on any failure. ``replace=False`` refuses a
    target that exists at the end (atomically)."""
    final = resolve(target)
    if final.is_dir():
        raise OutputError(f"{key}: {final} is a directory; name a file")
    tmp: Path | None = None
    with terminate_as_interrupt():
        try:
            _make_parent(final, key)
            remove_stale_temps(final)
            tmp = _hidden(final, TEMP_TAG)
            yield tmp
            if not tmp.is_file():
                raise AssertionError(f"{key}: the writer left no file at {tmp}")
            _finish(tmp)
            with _signals_blocked():
                _rename_file(tmp, final, key, replace)
            _fsync(final.parent)
        except BaseException as exc:
            if tmp is not None:
                with _signals_blocked():
                    _remove(tmp)
            err = write_error(exc, final, key, tmp)
            if err is not None:
                raise err from exc
            raise


def _rename_file(tmp: Path, final: Path, key: str, replace: bool) -> None:
    try:
        if replace:
            os.replace(tmp, final)
        else:
            rename_noreplace(tmp, final)
    except FileExistsError:
        raise OutputError(f"{key}: {final} already exists; refusing to replace it") from None
    except IsADirectoryError:  # a dir appeared there meanwhile
        raise OutputError(f"{key}: {final} is a directory; name a file") from None


def write_text(target: str | os.PathLike, text: str, *, key: str = "output") -> Path:
    """A small text file (a JSON report), atomically."""
    with atomic_file(target, key=key) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
    return resolve(target)


def write_bytes(target: str | os.PathLike, data: bytes, *, key: str = "output") -> Path:
    with atomic_file(target, key=key) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return resolve(target)
