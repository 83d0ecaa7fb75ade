"""Files in a directory another user can write (llama-server's slot directory, which belongs to
``[server].user``), handled by llama-guard (root) so that nothing that user plants there steers it.

Every name is resolved against a directory descriptor opened without following a link
(:class:`SafeDir`), and:

- a file is opened with ``O_NOFOLLOW`` (a symbolic link is refused, never followed) and
  ``O_NONBLOCK`` (a FIFO cannot block the open), then ``fstat``-checked: a regular file, of one of
  the expected owners, at most a bound of bytes (:meth:`SafeDir.open_regular`);
- a read reads at most the size ``fstat`` gave and checks a deadline (``time.monotonic()``) after
  every chunk, so the read itself ends (:meth:`SafeDir.read_bytes`, :func:`read_through`);
- a file llama-guard writes goes to a temporary name opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a
  stale or planted one is unlinked first — the link itself, never its target), is fsynced and
  renamed over the name, and the directory fsynced (:meth:`SafeDir.write_new`);
- a removal unlinks the name itself (:meth:`SafeDir.remove`).

Every refusal is a :class:`FileRefused` (an OSError) whose text names the file and the reason.
All calls block (file I/O): run them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType

CHUNK = 1 << 22  # bytes per read (4 MiB): the deadline is checked this often
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


class FileRefused(OSError):
    """A file that is not what llama-guard expects, or cannot be read in time; ``str()`` is the reason
    (naming the file), never empty."""

    def __init__(self, path: str, reason: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, reason, path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.filename}: {self.reason}"


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO", "a regular file", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "special")


def read_through(fd: int, size: int, deadline: float, sink: Callable[[bytes], object], path: str) -> None:
    """Feed the first ``size`` bytes of ``fd`` to ``sink``, chunk by chunk; raises FileRefused when the
    file ends first or ``deadline`` (``time.monotonic()``) passes between chunks."""
    left = size
    offset = 0
    while left > 0:
        chunk = os.pread(fd, min(CHUNK, left), offset)
        if not chunk:
            raise FileRefused(path, f"ends after {offset} bytes, {size} expected")
        sink(chunk)
        offset += len(chunk)
        left -= len(chunk)
        if left > 0 and time.monotonic() > deadline:
            raise FileRefused(path, f"reading it did not end in time ({offset} of {size} bytes read)", errno.ETIMEDOUT)


class SafeDir:
    """One directory, opened without following a link (``with SafeDir(path) as d: ...``). Raises
    FileRefused when ``path`` is a link or not a directory, OSError when it cannot be opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> SafeDir:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FileRefused(str(self.path), f"is {kind_of(os.lstat(self.path).st_mode)}, not a directory "
                                  "(a link is never followed)") from None
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def fd(self) -> int:
        """The directory's descriptor (only inside ``with``)."""
        if self._fd is None:
            raise RuntimeError("SafeDir used outside its with block")
        return self._fd

    def names(self) -> list[str]:
        """The directory's entries (names only, sorted)."""
        return sorted(os.listdir(self.fd))

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status (a link is not followed); None when it does not exist."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_regular(self, name: str, *, owners: Collection[int], max_bytes: int) -> tuple[int, int]:
        """``name`` opened for reading, and its size: only a regular file (never through a link) with one
        name (no hard link), owned by one of ``owners``, of at most ``max_bytes``. The caller closes the
        descriptor. Raises FileRefused, or FileNotFoundError when there is none."""
        where = str(self.path / name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileRefused(where, "is a symbolic link (never followed)") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileRefused(where, f"is {kind_of(st.st_mode)}, not a regular file")
            if st.st_nlink != 1:
                raise FileRefused(where, f"has {st.st_nlink} hard links (another name of another file)", errno.EPERM)
            if st.st_uid not in owners:
                expected = " or ".join(str(uid) for uid in sorted(owners))
                raise FileRefused(where, f"belongs to uid {st.st_uid}, not to uid {expected}", errno.EPERM)
            if st.st_size > max_bytes:
                raise FileRefused(where, f"is {st.st_size} bytes, more than the bound of {max_bytes}", errno.EFBIG)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def read_bytes(self, name: str, *, owners: Collection[int], max_bytes: int, deadline: float) -> bytes:
        """The whole of regular file ``name`` (see :meth:`open_regular`), read before ``deadline``."""
        fd, size = self.open_regular(name, owners=owners, max_bytes=max_bytes)
        parts: list[bytes] = []
        try:
            read_through(fd, size, deadline, parts.append, str(self.path / name))
        finally:
            os.close(fd)
        return b"".join(parts)

    def remove(self, name: str) -> bool:
        """Unlink ``name`` itself (a link, never its target); a directory in the way is removed when
        empty, else renamed aside (``.NAME.<random>.set-aside``), so the name is free either way.
        Whether there was one. Raises FileRefused when the name cannot be freed."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            try:
                os.rmdir(name, dir_fd=self.fd)
            except OSError:
                try:
                    os.rename(name, f".{name}.{secrets.token_hex(6)}.set-aside", src_dir_fd=self.fd, dst_dir_fd=self.fd)
                except OSError as exc:
                    raise FileRefused(str(self.path / name), f"a directory is in the way and cannot be moved aside: "
                                      f"{exc.strerror}", exc.errno or errno.EISDIR) from None
        except OSError as exc:
            raise FileRefused(str(self.path / name), f"cannot be removed: {exc.strerror}",
                              exc.errno or errno.EPERM) from None
        return True

    def write_new(self, name: str, data: bytes, mode: int = 0o600) -> None:
        """Replace ``name`` with ``data`` whole: written to a new temporary name (``name.<random>.tmp``,
        created exclusively; whatever stands there unlinked first), fsynced, renamed over ``name`` (a link there is
        replaced, not followed), the directory fsynced. Raises OSError (FileRefused for what is in
        the way); the temporary file is removed on failure."""
        tmp = f"{name}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, mode, dir_fd=self.fd)
        except FileExistsError:  # a crash's leftover or a plant: the name itself goes, then once more
            self.remove(tmp)
            try:
                fd = os.open(tmp, flags, mode, dir_fd=self.fd)
            except FileExistsError:
                raise FileRefused(str(self.path / tmp), "was created again by someone else while llama-guard "
                                  "wrote it", errno.EEXIST) from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                self.remove(tmp)
            raise
        os.close(fd)
        try:
            try:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except (IsADirectoryError, FileExistsError) as exc:
                if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                self.remove(name)  # a directory in the way: removed or moved aside, then once more
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                self.remove(tmp)
            raise
        os.fsync(self.fd)
