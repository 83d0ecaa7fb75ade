"""llama-server's argv, built from the typed ``[server]`` section."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llama_guard.config.sections import RuntimeConfig, SlotsConfig
from llama_guard.config.server import ServerConfig
from llama_guard.host.build import clean_text
from llama_guard.vocab.server_flags import ENDPOINT_FLAGS, METRICS_ENV, SLOTS_ENV

SLOT_SAVE_FLAG = "--slot-save-path"


def resolve_binary(binary: str) -> Path | None:
    """The llama-server executable: a path as given, or looked up on ``$PATH``; None if absent (or a
    directory: :func:`binary_problem` says which)."""
    if "/" in binary:
        path = Path(binary)
        return path if path.is_file() else None
    found = shutil.which(binary)
    return Path(found) if found else None


def binary_problem(binary: str) -> str:
    """Why ``[server].binary`` ``binary`` cannot be started ("" when it can be tried): not found, a
    directory or another file that is not a regular one (a FIFO, a socket, a device: exec refuses them,
    and reading one for its hash may never return), not executable by llama-guard. Blocking (a stat)."""
    if "/" not in binary:
        return "" if shutil.which(binary) else f"{binary!r} not found on $PATH"
    path = Path(binary)
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{binary!r} not found"
    except OSError as exc:
        return f"{binary}: {exc.strerror or exc}"
    if stat.S_ISDIR(st.st_mode):
        return f"{binary} is a directory, not the llama-server executable"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
        return f"{binary} is {kind}, not a regular file: not the llama-server executable"
    if not os.access(path, os.X_OK):
        return f"{binary} is not executable (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def own_slot_save_path(server: ServerConfig) -> Path | None:
    """The directory of ``--slot-save-path DIR`` (or ``=DIR``) in ``extra_args`` (the last one), or None."""
    value: str | None = None
    args = server.extra_args
    for i, arg in enumerate(args):
        if arg == SLOT_SAVE_FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(SLOT_SAVE_FLAG + "="):
            value = arg.split("=", 1)[1]
    return Path(value) if value else None


def own_slot_save_problem(server: ServerConfig) -> str:
    """Why llama-server would refuse the user's own ``--slot-save-path`` ("" when there is none or it is
    a directory): llama-server stops at once on a path that is not a directory ("not a directory"), and
    llama-guard, which never creates the user's own directory, refuses the start as a configuration
    error too. Blocking (a stat): call it with a deadline."""
    own = own_slot_save_path(server)
    if own is None or own.is_dir():
        return ""
    return (f"extra_args {SLOT_SAVE_FLAG} {own}: not a directory (llama-server refuses to start on it); create it, "
            "writable by [server].user, or drop the flag: llama-guard then keeps slot files in [slots].dir")


def _truthy(value: str) -> bool | None:
    """A llama.cpp boolean environment value (common/arg.cpp ``is_truthy``/``is_falsey``); None: neither."""
    return True if value in ("on", "enabled", "true", "1") else False if value in ("off", "disabled", "false", "0") \
        else None


@dataclass(frozen=True)
class Endpoints:
    """What llama-server would serve under the user's own flags (``extra_args`` and the environment):
    ``metrics`` (``GET /metrics``: ``--metrics``), ``slots`` (``GET /slots``: on unless ``--no-slots``)
    and ``slot_actions`` (``POST /slots/{id}``: ``--slot-save-path``). llama-guard starts llama-server with
    all three for itself (its probes, drains and KV carry-over); the front door answers the ones the user
    did not ask for as llama-server would (:mod:`llama_guard.front.exposed`)."""

    metrics: bool
    slots: bool
    slot_actions: bool


def user_endpoints(server: ServerConfig, environ: Mapping[str, str] = os.environ) -> Endpoints:
    """The :class:`Endpoints` of ``server``'s own flags: ``extra_args`` (the last ``--slots``/``--no-slots``
    wins) over ``[server].env`` over ``environ`` (llama-server's environment: ``LLAMA_ARG_ENDPOINT_METRICS``,
    ``LLAMA_ARG_ENDPOINT_SLOTS``), as llama.cpp reads them: the command line wins over the environment."""
    env = {**environ, **server.env}
    metrics = _truthy(env.get(METRICS_ENV, "")) is True
    slots = _truthy(env.get(SLOTS_ENV, "")) is not False
    for arg in server.extra_args:
        if arg == "--metrics":
            metrics = True
        elif arg in ("--slots", "--no-slots"):
            slots = arg == "--slots"
    return Endpoints(metrics, slots, own_slot_save_path(server) is not None)


def slot_save_dir(server: ServerConfig, slots: SlotsConfig, runtime: RuntimeConfig,
                  environ: Mapping[str, str] = os.environ) -> Path:
    """Where slot files live: the user's own ``--slot-save-path`` when ``extra_args`` has one, else
    ``[slots].dir``, else ``$STATE_DIRECTORY/slots`` (the first directory systemd gives a unit with
    ``StateDirectory=``: kept across restarts and reboots), else ``<[runtime].dir>/slots`` (often RAM)."""
    own = own_slot_save_path(server)
    if own is not None:
        return own
    if slots.dir:
        return Path(slots.dir)
    state = environ.get("STATE_DIRECTORY", "").split(":", 1)[0]
    return Path(state) / "slots" if state.startswith("/") else runtime.dir / "slots"


def build_argv(server: ServerConfig, binary: Path | None = None, slots: SlotsConfig | None = None,
               runtime: RuntimeConfig | None = None, run_as: Sequence[str] = ()) -> list[str]:
    """The full argv of llama-server for ``server``; ``run_as``: the exec wrapper the ``--help`` probe
    runs ``binary`` after (the drop to ``[server].user``: never run a build as root).

    ``--slot-save-path`` (:func:`slot_save_dir`) when ``slots`` is given and enabled and that directory
    exists (the slots watcher makes it at the daemon's start and before each spawn; llama-server refuses
    to start on a path that is not a directory), unless ``extra_args`` has the user's own. Blocking
    (a stat), like the ``--help`` probe beside it.

    ``--metrics`` and ``--slots`` are always on: the liveness probe reads the decode counters from
    ``/metrics``, the probes, drains and carry-over read ``/slots``. The user's own ``--metrics``,
    ``--slots`` and ``--no-slots`` in ``extra_args`` are not passed on: they say what clients may see
    (:func:`user_endpoints`), which the front door answers.
    ``--api-key-file`` comes from ``[server].api_key_file``.
    ``extra_args`` come last, verbatim but for those endpoint switches (validated not to repeat a typed flag).
    """
    exe = str(binary) if binary is not None else server.binary
    argv = [
        exe,
        "--model", str(server.model),
        "--host", server.host,
        "--port", str(server.port),
        "--n-gpu-layers", str(server.n_gpu_layers),
        "--ctx-size", str(server.ctx_size),
        "--parallel", str(server.parallel),
        "--batch-size", str(server.batch_size),
        "--ubatch-size", str(server.ubatch_size),
        "--cache-type-k", server.cache_type_k,
        "--cache-type-v", server.cache_type_v,
        "--flash-attn", server.flash_attn,
        "--metrics",
        "--slots",
    ]
    if server.threads is not None:
        argv += ["--threads", str(server.threads)]
    if server.threads_batch is not None:
        argv += ["--threads-batch", str(server.threads_batch)]
    if server.mlock:
        argv += mlock_args(binary, run_as)
    if server.api_key_file:  # the file's path, never the key (argv shows in events and ps)
        argv += ["--api-key-file", server.api_key_file]
    if slots is not None and runtime is not None and slots.enabled and own_slot_save_path(server) is None:
        save_dir = slot_save_dir(server, slots, runtime)
        if save_dir.is_dir():
            argv += [SLOT_SAVE_FLAG, str(save_dir)]
    argv += [arg for arg in server.extra_args if arg not in ENDPOINT_FLAGS]
    return argv


# llama-server's host-RAM prompt cache: ``--cache-ram N`` MiB (default 8192 in current builds,
# 0 off, -1 no limit; llama.cpp PR 16391). Its filling up is growth by design, not a leak.
HOST_CACHE_DEFAULT_MIB = 8192.0


def host_cache_cap_mib(server: ServerConfig) -> float:
    """How far llama-server's host prompt cache may grow (MiB) with ``server``'s flags: the last
    ``--cache-ram``/``-cram`` of ``extra_args`` (``N``, ``=N``), else the build default; ``math.inf``
    for -1 (no limit). A value that does not parse counts as the default (llama-server refuses it)."""
    value: str | None = None
    args = server.extra_args
    for i, arg in enumerate(args):
        if arg in ("--cache-ram", "-cram") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--cache-ram="):
            value = arg.split("=", 1)[1]
    if value is None:
        return HOST_CACHE_DEFAULT_MIB
    try:
        mib = float(value)
    except ValueError:
        return HOST_CACHE_DEFAULT_MIB
    return float("inf") if mib < 0 else mib


HELP_TIMEOUT_S = 20.0


def help_text(binary: Path, timeout_s: float = HELP_TIMEOUT_S, run_as: Sequence[str] = ()) -> str:
    """What ``binary --help`` prints (stdout then stderr; run after the exec wrapper ``run_as``),
    decoded as UTF-8 with undecodable bytes replaced (a build may print anything). Blocks up to
    ``timeout_s`` seconds: call it off the event loop. Raises OSError when it cannot run or does not
    finish in time."""
    try:
        out = subprocess.run([*run_as, str(binary), "--help"], capture_output=True, timeout=timeout_s, check=False,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{binary} --help did not finish within {timeout_s:g} s") from exc
    return (out.stdout + out.stderr).decode("utf-8", errors="replace")


def list_devices(binary: Path, env: dict[str, str], timeout_s: float = HELP_TIMEOUT_S,
                 run_as: Sequence[str] = ()) -> list[str] | None:
    """The devices ``binary --list-devices`` reports under ``env`` after the exec wrapper ``run_as``
    (lines such as ``CUDA0: NVIDIA H200 (143166 MiB, 142616 MiB free)``, cleaned:
    :func:`~llama_guard.host.build.clean_text`; empty when it prints ``(none)``), or None when this
    build has no such flag. Blocks up to ``timeout_s``; raises OSError when it cannot run or does not
    finish."""
    try:
        out = subprocess.run([*run_as, str(binary), "--list-devices"], capture_output=True, timeout=timeout_s,
                             check=False, stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{binary} --list-devices did not finish within {timeout_s:g} s") from exc
    lines = clean_text((out.stdout + out.stderr).decode("utf-8", errors="replace")).splitlines()  # check prints them
    heads = [i for i, line in enumerate(lines) if line.strip() == "Available devices:"]
    if not heads:
        return None
    return [line.strip() for line in lines[heads[-1] + 1:] if line.startswith((" ", "\t"))
            and line.strip() and line.strip() != "(none)"]


def mlock_args(binary: Path | None, run_as: Sequence[str] = ()) -> list[str]:
    """The flag that locks the model in RAM, as this llama-server build spells it.

    ``--mlock`` until llama.cpp replaced it with ``--load-mode MODE``, where ``mmap+mlock`` is
    the old ``--mlock`` with the default mmap; a build without ``--mlock`` rejects it with
    ``error: invalid argument: --mlock``. Decided from the binary's ``--help`` (cached per
    binary and mtime); ``--mlock`` when there is no binary or its help cannot be read. Runs the
    binary (up to :data:`HELP_TIMEOUT_S`, after the exec wrapper ``run_as``): the daemon calls it off
    its loop.
    """
    if binary is None:
        return ["--mlock"]
    try:
        stamp = binary.stat().st_mtime_ns
    except OSError:
        return ["--mlock"]
    return list(_mlock_args(str(binary), stamp, tuple(run_as)))


@functools.lru_cache(maxsize=8)
def _mlock_args(binary: str, _mtime_ns: int, run_as: tuple[str, ...]) -> tuple[str, ...]:
    try:
        text = help_text(Path(binary), run_as=run_as)
    except OSError:
        return ("--mlock",)
    if "--mlock" not in text and "--load-mode" in text and "mmap+mlock" in text:
        return ("--load-mode", "mmap+mlock")
    return ("--mlock",)


def flags_in(argv: list[str]) -> list[str]:
    """The flags (words starting with ``-``, before any ``=``) of ``argv`` without the binary."""
    return [word.split("=", 1)[0] for word in argv[1:] if word.startswith("-") and not _is_number(word)]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
