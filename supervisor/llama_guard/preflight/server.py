"""``check`` rows about llama-server itself: the binary runs and knows every flag we pass, it sees a GPU
when layers are offloaded, the model file is a GGUF file, the sizes can run, the port is free."""

from __future__ import annotations

import os
from pathlib import Path

from llama_guard.config import Config
from llama_guard.config.argv import (
    binary_problem,
    list_devices,
    own_slot_save_path,
    own_slot_save_problem,
    resolve_binary,
)
from llama_guard.core.child import child_environ
from llama_guard.core.model_file import MODEL_CHECK_TIMEOUT_S, model_problem
from llama_guard.core.offload import CallTimeout, run_with_deadline
from llama_guard.core.privileges import server_user_argv
from llama_guard.status.instance import port_daemon
from llama_guard.upgrade.preflight import preflight
from llama_guard.vocab.verdicts import CheckResult, Verdict


def check_binary(config: Config) -> list[CheckResult]:
    """The binary exists and starts (``--version``: its release shown), and its ``--help`` lists
    every flag we would pass (each one it does not know is named): the upgrade preflight's own test
    (:func:`~llama_guard.upgrade.preflight.preflight`, run with ``[server].env`` as ``[server].user`` when
    llama-guard can switch to it), one verdict for both."""
    problem = binary_problem(config.server.binary)
    binary = resolve_binary(config.server.binary)
    if problem or binary is None:
        return [CheckResult("binary", Verdict.FAIL, f"{problem or config.server.binary} (set [server].binary)")]
    server = config.server
    try:
        prefix = server_user_argv(server.user, server.group, server.supplementary_groups)
    except (ValueError, FileNotFoundError):  # the "server user" row says why; read as llama-guard's own user
        prefix = []
    result = preflight(config, binary, prefix=prefix)
    if result.build is None:
        return [CheckResult("binary", Verdict.FAIL, result.cause)]
    build = result.build
    if result.cause and not result.unknown_flags:  # its --help did not run
        return [CheckResult("binary", Verdict.FAIL, result.cause)]
    results = [CheckResult("binary", Verdict.OK, f"{binary}: build {build.release} ({build.version})")]
    if result.unknown_flags:
        results.append(CheckResult("flags", Verdict.FAIL,
                                   f"{binary} (build {build.release}) does not know: {' '.join(result.unknown_flags)}"))
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
    server = config.server
    try:  # as llama-server runs: never run a build as root
        run_as = server_user_argv(server.user, server.group, server.supplementary_groups)
        devices = list_devices(binary, child_environ(os.environ, server.env), run_as=run_as)
    except (OSError, ValueError) as exc:
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


def check_slot_save_path(config: Config, *, timeout_s: float = MODEL_CHECK_TIMEOUT_S) -> list[CheckResult]:
    """The user's own ``--slot-save-path`` (none: no row) is a directory: FAIL when it is not, since
    llama-server refuses to start on it and llama-guard never creates it (:func:`own_slot_save_problem`)."""
    own = own_slot_save_path(config.server)
    if own is None:
        return []
    try:
        problem = run_with_deadline(lambda: own_slot_save_problem(config.server), timeout_s, f"checking {own}")
    except CallTimeout as exc:
        return [CheckResult("slot save path", Verdict.FAIL, f"{own}: {exc} (a hung filesystem?)")]
    if problem:
        return [CheckResult("slot save path", Verdict.FAIL, problem)]
    return [CheckResult("slot save path", Verdict.OK, f"{own} (the user's own; clients may save and restore slots)")]


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


def check_port(config: Config) -> CheckResult:
    """Whether ``[server].host:port`` can be bound now (llama-server would fail to start if not): OK
    when free, or when this user's running llama-guard holds it (its own llama-server listens there:
    :func:`~llama_guard.status.instance.port_daemon`); WARN when anyone else holds it."""
    import socket

    host = config.server.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, config.server.port))
        except OSError as exc:
            daemon = port_daemon(config.server.port)
            if daemon is not None:
                return CheckResult("port", Verdict.OK, f"{host}:{config.server.port} is held by the running "
                                   f"llama-guard (pid {daemon}) and its llama-server")
            return CheckResult("port", Verdict.WARN,
                               f"{host}:{config.server.port} cannot be bound now ({exc.strerror}): held by "
                               "something other than llama-guard; llama-server would fail to start")
    return CheckResult("port", Verdict.OK, f"{host}:{config.server.port} is free")
