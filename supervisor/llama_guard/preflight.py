"""``llama-guard check``: what can be known before starting the server.

One module: one small function per check row (config, binary and flags, model, port, GPU,
limits, VRAM budget, reset); the verdict and the node-health action are in :mod:`.check_report`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_guard.api_key import read_api_key
from llama_guard.argv import HELP_TIMEOUT_S, build_argv, flags_in, help_text, list_devices, resolve_binary
from llama_guard.config import Config, ConfigError
from llama_guard.config.gpu import ForeignProcesses, GpuWatchMode
from llama_guard.core.child import child_environ
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S, model_problem
from llama_guard.core.offload import CallTimeout, run_with_deadline
from llama_guard.core.policy.verdicts import RECOVERY_ADVICE
from llama_guard.core.privileges import (
    Credentials,
    drop_argv,
    identity_problem,
    read_credentials,
    reset_precondition,
    resolve_identity,
)
from llama_guard.core.types import RecoveryAction
from llama_guard.gpu.nvml import WatchOff
from llama_guard.gpu.nvml_errors import (
    DeviceNotFound,
    DriverMismatch,
    DriverNotLoaded,
    GpuLost,
    LibraryNotFound,
    NvmlError,
    NvmlHung,
    ResetRequired,
    UnknownError,
)
from llama_guard.vocab.verdicts import CheckResult, NodeAction, Verdict

# What an NVML error at check time asks of the operator. A GPU off the bus (NVIDIA's Xid 79 family,
# NVML_ERROR_GPU_IS_LOST), a driver not loaded or not matching its library (an upgrade without a
# reboot), an NVML call that never returns: the host needs a reboot. NVML_ERROR_RESET_REQUIRED: a GPU
# reset. No driver library or a selector that names no GPU: the configuration ([gpu]) is wrong for
# this host. (NVML API reference, nvmlReturn_t; NVIDIA's Xid catalog for the recovery actions.)
GPU_ERROR_ACTIONS: tuple[tuple[type[NvmlError], NodeAction], ...] = (
    (ResetRequired, NodeAction.RESET_GPU),
    (GpuLost, NodeAction.REBOOT), (UnknownError, NodeAction.REBOOT), (DriverNotLoaded, NodeAction.REBOOT),
    (DriverMismatch, NodeAction.REBOOT), (NvmlHung, NodeAction.REBOOT),
    (LibraryNotFound, NodeAction.FIX_CONFIG), (DeviceNotFound, NodeAction.FIX_CONFIG),
)


# What to do when the config offloads layers ([gpu].enabled = "auto") and NVML cannot be opened, by
# the action of the NVML error (:data:`GPU_ERROR_ACTIONS`).
OFFLOAD_FIX: dict[NodeAction, str] = {
    NodeAction.FIX_CONFIG: ("install the NVIDIA driver (or correct [gpu].index/uuid/pci_bus_id), or set "
                            "n_gpu_layers = 0 to run on the CPU"),
    NodeAction.RESET_GPU: "reset the GPU (nvidia-smi --gpu-reset) once no process uses it",
    NodeAction.REBOOT: "reboot the host",
}


def gpu_error_action(error: NvmlError | None) -> NodeAction:
    """The :data:`GPU_ERROR_ACTIONS` row of ``error``'s type; ``fix_config`` for any other (or None)."""
    for kind, action in GPU_ERROR_ACTIONS:
        if isinstance(error, kind):
            return action
    return NodeAction.FIX_CONFIG


def check_binary(config: Config) -> list[CheckResult]:
    """The binary exists and runs, and its ``--help`` lists every flag we would pass."""
    binary = resolve_binary(config.server.binary)
    if binary is None:
        return [CheckResult("binary", Verdict.FAIL, f"{config.server.binary!r} not found (set [server].binary)")]
    if not os.access(binary, os.X_OK):
        return [CheckResult("binary", Verdict.FAIL, f"{binary} is not executable")]
    try:
        listed = help_text(binary, HELP_TIMEOUT_S)
    except OSError as exc:
        return [CheckResult("binary", Verdict.FAIL, f"{binary} --help failed: {exc}")]
    results = [CheckResult("binary", Verdict.OK, str(binary))]
    unknown = [f for f in flags_in(build_argv(config.server, binary, config.slots, config.runtime)) if f not in listed]
    if unknown:
        results.append(CheckResult("flags", Verdict.FAIL,
                                   f"{binary} does not know: {' '.join(sorted(set(unknown)))}"))
    else:
        results.append(CheckResult("flags", Verdict.OK, "every flag is listed by --help"))
    return results


def check_offload(config: Config) -> list[CheckResult]:
    """With ``n_gpu_layers`` > 0: WARN when the binary sees no GPU device (``--list-devices``, run
    with ``[server].env``): llama-server would silently run on the CPU, whatever ``[gpu].enabled``
    says. Nothing when no layer is to be offloaded, or the binary is missing (reported above)."""
    layers = config.server.n_gpu_layers
    binary = resolve_binary(config.server.binary)
    if layers <= 0 or binary is None:
        return []
    try:
        devices = list_devices(binary, child_environ(os.environ, config.server.env))
    except OSError as exc:
        return [CheckResult("offload", Verdict.WARN, f"n_gpu_layers = {layers}, devices not checked: {exc}")]
    if devices is None:
        return [CheckResult("offload", Verdict.OK, f"n_gpu_layers = {layers} (this build has no --list-devices)")]
    if not devices:
        return [CheckResult("offload", Verdict.WARN,
                            f"n_gpu_layers = {layers} but {binary} --list-devices finds no GPU: llama-server "
                            "would run on the CPU (a build without GPU support, or no GPU visible; under "
                            "systemd the unit's CUDA_VISIBLE_DEVICES applies); set n_gpu_layers = 0 to mean it")]
    return [CheckResult("offload", Verdict.OK, f"n_gpu_layers = {layers} on {'; '.join(devices)}")]


def check_model(config: Config, *, timeout_s: float = MODEL_CHECK_TIMEOUT_S) -> CheckResult:
    """The model file is a regular file, readable, and starts with the GGUF magic
    (:func:`model_problem`); FAIL when the filesystem does not answer within ``timeout_s``."""
    path = Path(config.server.model)
    try:
        problem = run_with_deadline(lambda: model_problem(path), timeout_s, f"checking {path}")
    except CallTimeout as exc:
        return CheckResult("model", Verdict.FAIL, f"{path}: {exc} (a hung filesystem?)")
    if problem:
        return CheckResult("model", Verdict.FAIL, problem)
    return CheckResult("model", Verdict.OK, f"{path} ({path.stat().st_size / 2**20:.0f} MiB)")


# llama-server's warm-up decodes a 2-token batch (BOS, EOS) per slot before it listens: a slot with a
# smaller context aborts there ("get_sub_batch: failed to add token ..."; measured with ctx_size = 1).
MIN_SLOT_TOKENS = 2


def check_settings(config: Config) -> list[CheckResult]:
    """The [server] sizes llama-server cannot run, or runs other than configured.

    FAIL: a slot's context (``ctx_size / parallel``) below :data:`MIN_SLOT_TOKENS`, which aborts in
    warm-up on every start (``parallel`` above ``ctx_size`` included). WARN: a slot's context below
    ``batch_size`` or ``ubatch_size`` (llama.cpp lowers the batch to the context, and a prompt longer
    than the slot's context fails). ``ctx_size = 0`` takes the model's training context: OK.
    """
    server = config.server
    if server.ctx_size == 0:
        return [CheckResult("sizes", Verdict.OK, "ctx_size = 0: the model's own context length")]
    per_slot = server.ctx_size // server.parallel
    if per_slot < MIN_SLOT_TOKENS:
        return [CheckResult("sizes", Verdict.FAIL,
                            f"ctx_size = {server.ctx_size} over parallel = {server.parallel} slots leaves "
                            f"{per_slot} token(s) per slot; llama-server's warm-up needs {MIN_SLOT_TOKENS} and "
                            f"aborts on every start (get_sub_batch: failed to add token). Raise ctx_size "
                            f"(e.g. {max(4096, server.parallel * 1024)}) or lower parallel")]
    results = []
    for name, value in (("batch_size", server.batch_size), ("ubatch_size", server.ubatch_size)):
        if per_slot < value:
            results.append(CheckResult("sizes", Verdict.WARN,
                                       f"a slot's context ({per_slot} tokens = ctx_size {server.ctx_size} / "
                                       f"parallel {server.parallel}) is smaller than {name} = {value}: llama.cpp "
                                       f"lowers the batch to the context and longer prompts fail"))
            break
    return results or [CheckResult("sizes", Verdict.OK, f"{per_slot} tokens of context per slot "
                                                  f"({server.parallel} slot(s)), batch {server.batch_size}/"
                                                  f"{server.ubatch_size}")]


def check_limits(config: Config) -> list[CheckResult]:
    """The rlimits llama-server would get: configured, the daemon's own, what the child gets.

    Plans exactly as the daemon does before a spawn (:func:`llama_guard.limits.rlimits.plan_child_limits`
    on this process's own limits and privileges), so the answer holds for a daemon run by the
    same user under the same limits. A limit the server would get less of than configured is
    WARN with the fix, as is each thread note (``--threads`` vs CPUs, RLIMIT_NPROC, ``pids.max``).
    """
    from llama_guard.limits.own import can_raise_hard_limits, read_own_limits
    from llama_guard.limits.plan import plan_child_limits
    from llama_guard.limits.readback import limits_report

    try:
        plan = plan_child_limits(config, read_own_limits(), can_raise_hard_limits())
    except ValueError as exc:
        return [CheckResult("limits", Verdict.FAIL, str(exc))]
    results = []
    for row, decision in zip(limits_report(plan), plan.decisions, strict=True):
        detail = (f"configured {row['configured']}; llama-guard has {row['daemon']} (soft / hard); "
                  f"llama-server gets {row['planned']}")
        if decision.note:
            detail += f" ({decision.note})"
        if decision.problem:
            results.append(CheckResult(row["limit"], Verdict.WARN, f"{detail}. {decision.problem}"))
        else:
            results.append(CheckResult(row["limit"], Verdict.OK, detail))
    results += [CheckResult("threads", Verdict.WARN, note) for note in plan.thread_notes]
    return results


def check_reset(config: Config, *, creds: Credentials | None = None,
                which: Callable[[str], str | None] = shutil.which, nvml_module: Any = None) -> CheckResult:
    """Whether the daemon could reset the GPU here, and if not, why: the GPU watch must be on (a
    reset has to be verified), llama-guard must have what ``nvidia-smi --gpu-reset`` needs under the
    credentials it actually has (euid 0 and CAP_SYS_ADMIN in ``CapEff`` of ``/proc/self/status``:
    :func:`llama_guard.core.privileges.reset_precondition`), and ``[recovery].reset_command`` must be
    found. Read-only: NVML is opened and closed, nothing reset.

    ``creds``, ``which`` and ``nvml_module`` (a pynvml stand-in; None: the real ``pynvml``) are
    injectable for tests. WARN, not FAIL, when a reset is not
    possible: the daemon then restarts the server only, and a lost GPU ends it with exit 69.
    """
    rec = config.recovery
    if not rec.reset_on or rec.max_resets == 0:
        why = "[recovery].reset_on is empty" if not rec.reset_on else "[recovery].max_resets = 0"
        return CheckResult("gpu reset", Verdict.OK, f"GPU resets are off ({why}): restart only")
    reasons: list[str] = []
    gpu_text = ""
    if config.gpu.enabled is GpuWatchMode.OFF:
        reasons.append('the GPU watch is off ([gpu].enabled = "off"), so a reset could not be verified')
    else:
        from llama_guard.gpu import DeviceSelector, open_gpu

        selector = DeviceSelector(config.gpu.index, config.gpu.uuid, config.gpu.pci_bus_id)
        opened = open_gpu(selector, enabled=config.gpu.enabled, module=nvml_module)
        if isinstance(opened, WatchOff):
            reasons.append(f"the GPU cannot be watched ({opened.reason}), so a reset could not be verified")
        else:
            try:
                identity = opened.open()
                gpu_text = f"GPU {identity.index} ({identity.name}, {identity.pci_bus_id}) watched"
            except NvmlError as exc:
                reasons.append(f"the GPU cannot be watched ({exc}), so a reset could not be verified")
            finally:
                opened.close()
    refusal = reset_precondition(creds)
    if refusal:
        reasons.append(refusal)
    command = rec.reset_command[0]
    found = _find_command(command, which)
    if found is None:
        where = "" if "/" in command else " on PATH"
        reasons.append(f"the reset command {command!r} was not found{where} ([recovery].reset_command)")
    argv_text = " ".join(rec.reset_command)
    if reasons:
        return CheckResult("gpu reset", Verdict.WARN,
                           "a GPU reset would not be possible here: " + "; ".join(reasons)
                           + f". On {', '.join(rec.reset_on)} llama-guard restarts the server only, "
                             "and a lost GPU ends with exit 69")
    return CheckResult("gpu reset", Verdict.OK,
                       f"possible: root with CAP_SYS_ADMIN, {found} found, {gpu_text}; "
                       f"on {', '.join(rec.reset_on)} it runs "
                       f"`{argv_text}` (at most {rec.max_resets} per {rec.reset_window_s:.0f} s)")


def check_gpu(config: Config, *, nvml_module: Any = None) -> list[CheckResult]:
    """The GPU as NVML sees it (read-only): name, driver (against ``[gpu].driver_version``),
    memory used/total, persistence mode, other processes holding VRAM (the VRAM budget is
    :func:`check_vram`).

    FAIL when ``[gpu].enabled = "on"``, or ``"auto"`` with ``n_gpu_layers`` > 0, and NVML cannot reach
    the GPU (the action by the NVML error: :data:`OFFLOAD_FIX`); WARN for what the daemon would also
    warn about (no driver with ``n_gpu_layers = 0``); nothing is changed on the GPU.
    """
    if config.gpu.enabled is GpuWatchMode.OFF:
        return [CheckResult("gpu", Verdict.OK, 'GPU watch off ([gpu].enabled = "off")')]
    from llama_guard.gpu import DeviceSelector, open_gpu
    from llama_guard.gpu.rules import driver_in_series

    selector = DeviceSelector(config.gpu.index, config.gpu.uuid, config.gpu.pci_bus_id)
    opened = open_gpu(selector, enabled=config.gpu.enabled, module=nvml_module)
    if isinstance(opened, WatchOff):
        if config.gpu.enabled is GpuWatchMode.ON:
            return [CheckResult("gpu", Verdict.FAIL, f"GPU watch off: {opened.reason}",
                                action=gpu_error_action(opened.error))]
        if config.server.n_gpu_layers > 0:  # "auto", but the config offloads: this GPU node is not healthy
            action = gpu_error_action(opened.error)
            return [CheckResult("gpu", Verdict.FAIL, f"n_gpu_layers = {config.server.n_gpu_layers} asks for the "
                                f"GPU, but NVML is unavailable: {opened.reason}; {OFFLOAD_FIX[action]}",
                                action=action)]
        return [CheckResult("gpu", Verdict.WARN, f"GPU watch off: {opened.reason}")]
    recovery: RecoveryAction | None = None
    try:
        sample = opened.sample()
        with contextlib.suppress(NvmlError):  # not reported by this driver/GPU: nothing to say
            recovery = opened.recovery_action()
    except NvmlError as exc:
        return [CheckResult("gpu", Verdict.FAIL, f"the GPU does not answer NVML: {exc}", action=gpu_error_action(exc))]
    finally:
        opened.close()
    mib = 2**20
    ident = sample.identity
    used, total = sample.memory_used_bytes, sample.memory_total_bytes
    memory = f"{used // mib} of {total // mib} MiB used" if used is not None and total is not None else "memory ?"
    results = [CheckResult("gpu", Verdict.OK, f"GPU {ident.index} {ident.name} ({ident.pci_bus_id}, {ident.uuid}), "
                                        f"driver {sample.driver_version}, {memory}")]
    expected = config.gpu.driver_version
    if expected and sample.driver_version and not driver_in_series(sample.driver_version, expected):
        results.append(CheckResult("driver", Verdict.WARN, f"driver {sample.driver_version} is outside the "
                                                     f"configured series {expected!r} ([gpu].driver_version)"))
    rows = sample.remapped_rows
    if rows is not None and rows.pending:
        # A row remap is applied at the next GPU reset (NVIDIA, "GPU Memory Error Management": row remapping).
        results.append(CheckResult("remapped rows", Verdict.WARN, f"a row remap is pending ({rows.uncorrectable} "
                                   f"uncorrectable, {rows.correctable} correctable rows remapped): it takes effect "
                                   "at the next GPU reset", action=NodeAction.RESET_GPU))
    if sample.persistence_mode is False:
        results.append(CheckResult("persistence", Verdict.WARN, "persistence mode is off: enable the "
                                                          "nvidia-persistenced service"))
    if recovery is not None and recovery is not RecoveryAction.NONE:
        results.append(CheckResult("recovery", Verdict.FAIL,
                                   f"the driver asks for a recovery action ({recovery.name.lower()}, NVML's "
                                   f"GPU recovery action field): {RECOVERY_ADVICE[recovery]}",
                                   action=NodeAction.RESET_GPU if recovery is RecoveryAction.GPU_RESET
                                   else NodeAction.REBOOT))
    for proc in sample.processes or ():
        verdict = Verdict.FAIL if config.gpu.foreign_processes is ForeignProcesses.REFUSE else Verdict.WARN
        results.append(CheckResult("gpu process", verdict,
                                   f"pid {proc.pid} holds {(proc.used_bytes or 0) // mib} MiB of VRAM "
                                   f"([gpu].foreign_processes = {config.gpu.foreign_processes.value})"))
    return results


def _find_command(command: str, which: Callable[[str], str | None]) -> str | None:
    if "/" in command:
        return command if os.path.isfile(command) and os.access(command, os.X_OK) else None
    return which(command)


def check_port(config: Config) -> CheckResult:
    """Whether ``[server].host:port`` can be bound now (llama-server would fail to start if not).

    WARN, not FAIL: the holder may be this very llama-guard's own server."""
    import socket

    host = config.server.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, config.server.port))
        except OSError as exc:
            return CheckResult("port", Verdict.WARN,
                               f"{host}:{config.server.port} cannot be bound now ({exc.strerror}); "
                               "llama-server would fail to start unless that is our own server")
    return CheckResult("port", Verdict.OK, f"{host}:{config.server.port} is free")


def check_credentials(config: Config, *, creds: Credentials | None = None) -> list[CheckResult]:
    """Who llama-server would run as, and whether llama-guard can start it so: ``[server].user``
    resolves, llama-guard has CAP_SETUID/CAP_SETGID for the switch, and the binary and model are
    reachable by that user (the mode bits of each path component); ``setpriv`` is there to start it.
    WARN when llama-server would run as root, FAIL when it could not be started as configured."""
    server = config.server
    creds = creds if creds is not None else read_credentials()
    try:
        identity = resolve_identity(server.user, server.group, server.supplementary_groups)
    except ValueError as exc:
        return [CheckResult("server user", Verdict.FAIL, str(exc))]
    problem = identity_problem(identity, creds)
    if problem:
        return [CheckResult("server user", Verdict.FAIL, problem)]
    try:  # the wrapper every llama-server child is started through
        drop_argv(identity, creds)
    except FileNotFoundError as exc:
        return [CheckResult("server user", Verdict.FAIL, str(exc))]
    if identity.uid is None:
        if creds.uid == 0:
            return [CheckResult("server user", Verdict.WARN, "llama-server would run as root (without capabilities): "
                                                       "set [server].user to an unprivileged account")]
        return [CheckResult("server user", Verdict.OK, f"llama-server runs as llama-guard's own uid {creds.uid}, "
                                                 "without capabilities")]
    results = [CheckResult("server user", Verdict.OK, f"llama-server runs as {identity.description}, "
                                                "without capabilities, no_new_privs")]
    assert identity.gid is not None
    gids = {identity.gid, *(identity.groups or ())}
    binary = resolve_binary(server.binary)
    for what, path, bit in (("binary", binary, 1), ("model", Path(server.model), 4),
                            ("api key file", Path(server.api_key_file) if server.api_key_file else None, 4)):
        if path is None:
            continue
        blocked = _unreachable(path, identity.uid, gids, bit)
        if blocked:
            results.append(CheckResult("server user", Verdict.FAIL, f"{what} {path}: {blocked} for uid {identity.uid}"))
    return results


def _unreachable(path: Path, uid: int, gids: set[int], bit: int) -> str:
    """Why ``uid`` (with ``gids``) cannot reach ``path`` and read (bit 4) or execute (bit 1) it; ""
    when it can. Reads only mode bits and owners (no ACLs)."""
    def allowed(st: os.stat_result, want: int) -> bool:
        if st.st_uid == uid:
            return bool(st.st_mode >> 6 & want)
        if st.st_gid in gids:
            return bool(st.st_mode >> 3 & want)
        return bool(st.st_mode & want)

    path = path.absolute()
    try:
        for parent in reversed(path.parents):
            if not allowed(parent.stat(), 1):
                return f"{parent} is not searchable"
        if not allowed(path.stat(), bit):
            return "not readable" if bit == 4 else "not executable"
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def check_api_key(config: Config) -> CheckResult:
    """``[server].api_key_file`` can be read (the key is not shown), and a non-loopback ``host``
    has one (WARN otherwise: anyone reaching the port can use the model)."""
    server = config.server
    try:
        key = read_api_key(server)
    except ConfigError as exc:
        return CheckResult("api key", Verdict.FAIL, exc.lines[0])
    if not key:
        if server.loopback:
            return CheckResult("api key", Verdict.OK, f"none; {server.host} is loopback only")
        return CheckResult("api key", Verdict.WARN,
                           f"llama-server listens on {server.host}, beyond loopback, without an "
                           "API key: set [server].api_key_file")
    try:
        others = os.stat(server.api_key_file).st_mode & 0o007
    except OSError:
        others = 0
    if others:
        return CheckResult("api key", Verdict.WARN, f"{server.api_key_file} is readable by every local user: "
                                                    f"chmod o-rwx {server.api_key_file}")
    return CheckResult("api key", Verdict.OK, f"{server.api_key_file} (sent by llama-guard's probes as a Bearer token)")


def check_vram(config: Config, *, nvml_module: Any = None) -> list[CheckResult]:
    """The VRAM budget from the model's GGUF metadata against the GPU's free memory (or
    ``[gpu].vram_total_mib``), with the operators' ladder when it does not fit
    (:mod:`llama_guard.insight.vram_check`). The first row carries the budget as ``data``."""
    from llama_guard.gpu.info import gpu_memory_facts
    from llama_guard.insight.vram_check import report_lines, vram_report

    report = vram_report(config, gpu_memory_facts(config, nvml_module=nvml_module))
    rows = report_lines(report)
    return [CheckResult(name, verdict, detail, report.as_dict() if i == 0 else None)
            for i, (verdict, name, detail) in enumerate(rows)]


def run_checks(config: Config, config_path: Path, *, nvml_module: Any = None) -> list[CheckResult]:
    """Every preflight check, in report order; ``nvml_module`` as for :func:`check_gpu`."""
    results = [CheckResult("config", Verdict.OK, str(config_path))]
    results += check_binary(config)
    results += check_offload(config)
    model = check_model(config)
    results.append(model)
    results += check_settings(config)
    results.append(check_port(config))
    from llama_guard.front.check import check_front, check_metrics  # they report in this module's terms

    results += [check_front(config), check_metrics(config)]
    results += check_credentials(config)
    results.append(check_api_key(config))
    results += check_limits(config)
    results += check_gpu(config, nvml_module=nvml_module)
    if model.verdict is Verdict.FAIL:  # never read a FIFO, a directory or a hung file for its metadata
        results.append(CheckResult("vram budget", Verdict.WARN, "not estimated: the model file failed its check"))
    else:
        results += check_vram(config, nvml_module=nvml_module)
    results.append(check_reset(config, nvml_module=nvml_module))
    return results
