"""What a llama-server build is: the file's content hash, what ``--version`` prints and the release
read from it (SemVer, or llama.cpp's build number and commit), each bounded in time and output. The
one reader of a build's output (:func:`run_bounded`): what it prints is cleaned there
(:func:`clean_text`), so every consumer — events, ``status``, ``/metrics`` — gets the clean text.

Blocking (reads and runs the binary): call it off the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import selectors
import signal
import subprocess
import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

VERSION_TIMEOUT_S = 10.0  # ``--version``: a build that does not answer by then is refused (seconds)
HELP_TIMEOUT_S = 20.0  # ``--help`` (seconds)
OUTPUT_MAX = 1 << 20  # bytes read of one run's output (llama-server's --help: ~40 KB); the rest is cut
VERSION_SHOWN_MAX = 200  # characters of the --version text kept
HASH_CHUNK = 1 << 20
EXITED_POLL_S = 0.05  # while its output is quiet, how often a run is checked for having exited (seconds)


@dataclass(frozen=True)
class Ran:
    """One bounded run of the binary: its exit status (negative: the signal's number; None: killed
    at the deadline) and its stdout and stderr, interleaved, decoded (undecodable bytes replaced)."""

    returncode: int | None
    text: str

    def failure(self, what: str, timeout_s: float) -> str:
        """Why this run shows the build cannot start ("" when it exited 0): ``what`` names the run
        (``/opt/llama-server --version``)."""
        if self.returncode is None:
            return f"{what} did not finish within {timeout_s:g} s"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"{what} died by {name}"
        if self.returncode:
            last = next((line.strip() for line in reversed(self.text.splitlines()) if line.strip()), "")
            return f"{what} exited with status {self.returncode}" + (f": {last[:200]}" if last else "")
        return ""


def run_bounded(argv: list[str], timeout_s: float, max_bytes: int = OUTPUT_MAX,
                env: Mapping[str, str] | None = None) -> Ran:
    """Run ``argv`` (stdin from /dev/null, in a session of its own, with ``env``, else this process's
    environment) for at most ``timeout_s`` seconds, keeping at most ``max_bytes`` of its output, read
    until the end of the pipe or until it exited with the pipe empty (a process it started in the
    background, outside its session, may hold the pipe open for long).
    Killed with its whole process group at the deadline (``returncode`` None). Raises OSError when
    it cannot be executed."""
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=None if env is None else dict(env))
    assert proc.stdout is not None
    chunks: list[bytes] = []
    kept = 0
    timed_out = False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not sel.select(min(left, EXITED_POLL_S)):
                if proc.poll() is not None:
                    break  # it exited and the pipe is empty: a process it left behind may hold the pipe
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            if kept < max_bytes:
                chunks.append(data[:max_bytes - kept])
                kept += len(chunks[-1])
    returncode: int | None
    if not timed_out:
        try:
            returncode = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        returncode = None
    proc.stdout.close()
    return Ran(returncode, clean_text(b"".join(chunks).decode("utf-8", errors="replace")))


# ANSI escape sequences: CSI (colours, cursor moves), OSC (titles, hyperlinks), the others (ECMA-48: ESC,
# intermediate bytes, a final byte; a lone ESC).
# ECMA-48 escapes: the string sequences (DCS, SOS, OSC, PM, APC, 7-bit or C1) with their payload up to ST or
# BEL, CSI sequences, then any other escape.
_ANSI = re.compile(r"(?:\x1b[P\]X^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                   r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
                   r"|\x1b[ -/]*[0-~]?")


def clean_text(text: str) -> str:
    """A binary's output as text safe to put in events, status and metrics: ANSI escape sequences
    removed, a string sequence's payload with it (a DCS or OSC carries terminal commands); a carriage
    return (which redraws a terminal line: ``1.0\\r9.9`` shows as ``9.9``) made a line break, tabs
    spaces; every other control character (C0, DEL, C1: NUL, BEL, backspace …) and invisible format
    character (bidirectional overrides) removed."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    return "".join(ch for ch in text if ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf"))


_SEMVER = re.compile(r"\bversion:?\s*v?(\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.+-]+)?)")
_BUILD_NUMBER = re.compile(r"\bversion:?\s*(\d+)\b")
_COMMIT = re.compile(r"\(([0-9a-f]{7,40})\)|\bcommit ([0-9a-f]{7,40})\b")


def release_of(version_text: str) -> str:
    """The release named by ``--version`` output: ``v1.2.3`` (SemVer, llama.cpp from 1.0.0 on) or
    ``b4242`` (its build number before), followed by `` (commit)`` when printed; else the first line
    (``unknown`` when empty)."""
    commit = commit_of(version_text)
    tail = f" ({commit})" if commit else ""
    semver = _SEMVER.search(version_text)
    if semver:
        return f"v{semver[1]}{tail}"
    number = _BUILD_NUMBER.search(version_text)
    if number:
        return f"b{number[1]}{tail}"
    first = next((line.strip() for line in version_text.splitlines() if line.strip()), "")
    return first[:80] or "unknown"


def commit_of(version_text: str) -> str:
    """The git commit ``--version`` output names (``version: 4242 (abc1234)``, ``commit abc1234``), "" when it
    names none (a build from a source tree without git says ``commit unknown``)."""
    found = _COMMIT.search(version_text)
    return (found[1] or found[2]) if found else ""


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s content (hex). Raises OSError."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stamp_of(path: Path) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime ns)`` of ``path`` (followed): when it is unchanged, so is the
    file's content as far as a cache of its hash cares. Raises OSError."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Build:
    """One llama-server build: the executable's path, its content hash and what it says it is."""

    path: Path
    sha256: str
    version: str
    """What ``--version`` printed, lines joined by "; " (at most :data:`VERSION_SHOWN_MAX` characters)."""
    release: str
    """:func:`release_of` the version text: ``v1.0.0 (abc1234)``, ``b4242 (abc1234)``."""

    @property
    def short(self) -> str:
        """``b4242 (abc1234) sha256:0123abcd`` — the release and the hash's first 8 digits."""
        return f"{self.release} sha256:{self.sha256[:8]}"

    def same_as(self, other: Build | None) -> bool:
        """Whether ``other`` is this build: the same content at the same path (a copy elsewhere is
        an upgrade to try like any other)."""
        return other is not None and other.sha256 == self.sha256 and other.path == self.path

    def same_content(self, other: Build | None) -> bool:
        """Whether ``other`` has this content, wherever it lies (a kept copy of it)."""
        return other is not None and other.sha256 == self.sha256

    def as_dict(self) -> dict[str, str]:
        """The fields as JSON holds them (what a slot file's manifest records of the build that saved it)."""
        return {"path": str(self.path), "sha256": self.sha256, "version": self.version, "release": self.release}


def version_shown(text: str) -> str:
    """``--version`` output as one line: non-empty lines joined by "; ", clipped."""
    joined = "; ".join(line.strip() for line in text.splitlines() if line.strip())
    return joined[:VERSION_SHOWN_MAX] + "…" if len(joined) > VERSION_SHOWN_MAX else joined


def version_line(binary: Path, timeout_s: float = VERSION_TIMEOUT_S, env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> str:
    """What ``binary --version`` prints as one clean line (:func:`version_shown`; llama.cpp: ``version:
    4242 (abc1234); built with GNU 12.2.0 for Linux x86_64``), or ``unknown (why)`` when it could not be
    read; run with ``env`` after the exec wrapper ``prefix`` (as :func:`identify`). Blocking, bounded
    by ``timeout_s``."""
    what = f"{binary} --version"
    try:
        ran = run_bounded([*prefix, str(binary), "--version"], timeout_s, env=env)
    except OSError as exc:
        return f"unknown ({what}: {exc.strerror or exc})"
    if ran.returncode is None:
        return f"unknown ({what} did not finish within {timeout_s:g} s)"
    return version_shown(ran.text) or f"unknown ({what} printed nothing)"


def identify(binary: Path, timeout_s: float = VERSION_TIMEOUT_S,
             env: Mapping[str, str] | None = None, prefix: Sequence[str] = ()) -> tuple[Build | None, str]:
    """``binary``'s :class:`Build` from its hash and a bounded ``--version`` (run with ``env``, after
    the exec wrapper ``prefix``: e.g. the drop to ``[server].user``), and "" — or None and why it
    cannot be a build that starts (a signal, a non-zero exit, no answer in time, not executable)."""
    what = f"{binary} --version"
    try:
        sha = file_sha256(binary)
        ran = run_bounded([*prefix, str(binary), "--version"], timeout_s, env=env)
    except OSError as exc:
        return None, f"{what}: {exc.strerror or exc}"
    failure = ran.failure(what, timeout_s)
    if failure:
        return None, failure
    return Build(binary, sha, version_shown(ran.text), release_of(ran.text)), ""
