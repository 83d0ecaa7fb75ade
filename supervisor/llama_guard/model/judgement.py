"""Pure judgements the policy makes on a server's signals: is it alive, did it fail the same way
twice, what to say about a fault that no restart can fix.

No I/O; :mod:`llama_guard.model.policy` calls these from its transitions.
"""

from __future__ import annotations

import re

from llama_guard.model.inputs import Probe
from llama_guard.model.server_log import Family, LineClass, classify_line
from llama_guard.model.types import Params

# The "<elapsed> <level> " prefix of llama-server's logger and a "[pid] " prefix.
_PREFIX = re.compile(r"^\s*(?:\[\d+\]\s*)?(?:\d+\.\d+\.\d+\.\d+\s+[A-Z]\s+)?")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")


def progress_signals(event: Probe, params: Params) -> list[str]:
    """The progress signals of one liveness round that do not depend on the server's HTTP loop
    (plus its decode counters when they answered): "counters", "cpu", "lines", "gpu"."""
    out = []
    if event.progressed:
        out.append("counters")
    if event.cpu_s is not None and event.cpu_s >= params.progress_cpu_s:
        out.append("cpu")
    if event.lines > 0:
        out.append("lines")
    if event.gpu_busy:
        out.append("gpu")
    return out


def answered(event: Probe) -> bool:
    """Whether the server answered this round: /health 200, its main loop answered (/metrics),
    the canary (when sent) finished, and no request sat processing while the counters stood still."""
    return (event.health_ok and event.loop_ok and event.canary_ok is not False
            and not (event.busy and not event.progressed))


def completion_failed(event: Probe) -> bool:
    """The server answered the canary with a server error (HTTP 5xx): a failure, whatever the
    progress signals say (the server told us; nothing is unknown)."""
    return event.canary_status is not None and event.canary_status >= 500


def silent_too_long(event: Probe, params: Params) -> bool:
    """The server answered no HTTP request at all for ``params.silent_limit_s``: hung, whatever
    its CPU time, lines or GPU use say (they are hints, not proof)."""
    return event.silent_s >= params.silent_limit_s


def failure_signature(exit_text: str, last_error: str) -> str:
    """How a start ended before its first ready, comparable across starts: the exit text and the
    last error line without its log prefix, with numbers and addresses blanked (they differ
    between runs of the same failure)."""
    line = _NUMBER.sub("#", _PREFIX.sub("", last_error)).strip()
    return f"{exit_text} | {line}"


def incompatibility(verdict: LineClass) -> LineClass | None:
    """The :attr:`Family.GPU_INCOMPATIBLE` verdict in ``verdict`` (itself, or the reason a GPU
    backend failed to initialise, e.g. "CUDA driver version is insufficient ..."), else None."""
    if verdict.family is Family.GPU_INCOMPATIBLE:
        return verdict
    if verdict.family is Family.GPU_UNAVAILABLE and verdict.cause:
        inner = classify_line(verdict.cause)
        if inner.family is Family.GPU_INCOMPATIBLE:
            return inner
    return None


def naming_model(cause: str, model_path: str) -> str:
    """``cause`` with the model file's path added when it is about the model and does not name it
    (llama.cpp's "error loading model: tensor '…' data is not within the file bounds, model is
    corrupted or incomplete" names a tensor, not the file)."""
    if not model_path or model_path in cause or "model" not in cause.lower():
        return cause
    return f"{cause} (model file {model_path})"
