"""How ``llama-guard status`` shows the daemon's snapshot (``status.json``, written by
:mod:`llama_guard.status.status`): a layout for people, and a versioned JSON document for scripts.

JSON schema 1 (docs/status.md): every key of the snapshot as the daemon wrote it (``daemon_pid``,
``phase``, ``server_pid``, ``base_url``, ``status``, ``restarts``, ``recent_failures``, ``last_failure``,
``updated``, ``events``, ``liveness`` (``answering``: the server answered the last liveness
round; ``silent_s``: seconds since it last answered any request; null before the first round),
and one object per watcher: ``gpu``, ``limits``, ``planned_restarts``,
``metrics``, ``front``, ``build``), plus ``schema`` (1), ``ready`` (bool), ``snapshot_age_s``, ``daemon_uptime_s`` and
``server_uptime_s`` (seconds, null when unknown). Keys are only ever added within a schema version.

Exit codes (so that ``llama-guard status`` can be a health check): :data:`EXIT_READY` 0 when the
server is ready, :data:`EXIT_NOT_READY` 1 when the daemon runs but the server is not ready (starting,
backoff, draining, resetting ...), :data:`EXIT_NOT_RUNNING` 3 when no daemon runs (LSB's "not running").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil

from llama_guard.vocab.units import MIB

SCHEMA = 1
EXIT_READY = 0
EXIT_NOT_READY = 1
EXIT_NOT_RUNNING = 3
EXIT_STATUS_UNKNOWN = 4  # LSB: "program or service status is unknown" (the runtime files may not be read)


def _uptime(pid: Any, now: float) -> float | None:
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        return max(0.0, now - psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def document(snap: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """The ``--json`` document (schema 1) for ``snap``."""
    now = time.time() if now is None else now
    updated = snap.get("updated")
    return {"schema": SCHEMA, **snap, "ready": is_ready(snap),
            "snapshot_age_s": round(now - float(updated), 3) if isinstance(updated, (int, float)) else None,
            "daemon_uptime_s": _round(_uptime(snap.get("daemon_pid"), now)),
            "server_uptime_s": _round(_uptime(snap.get("server_pid"), now))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def is_ready(snap: dict[str, Any]) -> bool:
    """Ready: the phase is ``ready`` and the server answered the last liveness round (the
    snapshot's ``liveness.answering``; a server whose every probe times out is not ready, even
    while its progress signals keep it from being called hung)."""
    liveness = snap.get("liveness")
    answering = liveness.get("answering", True) if isinstance(liveness, dict) else True
    return snap.get("phase") == "ready" and answering is not False


def exit_code(snap: dict[str, Any] | None) -> int:
    """0 ready, 1 running but not ready, 3 not running."""
    if snap is None:
        return EXIT_NOT_RUNNING
    return EXIT_READY if is_ready(snap) else EXIT_NOT_READY


def duration(seconds: float | None) -> str:
    """``3 d 4 h``, ``2 h 5 min``, ``4 min 10 s``, ``12 s``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400} d {s % 86400 // 3600} h"
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    if s >= 60:
        return f"{s // 60} min {s % 60} s"
    return f"{s} s"


def render(doc: dict[str, Any], *, clock: Callable[[], float] = time.time) -> list[str]:
    """The human layout of a :func:`document`: no raw JSON."""
    now = clock()
    lines = [f"llama-guard pid {doc.get('daemon_pid')}: {doc.get('phase', '?')}"
             f"{'' if doc.get('ready') else ' (server NOT ready' + _silence(doc) + ')'}"
             f", up {duration(doc.get('daemon_uptime_s'))}"
             f"  (snapshot {duration(doc.get('snapshot_age_s'))} old)"]
    rows: list[tuple[str, str]] = []
    server_pid = doc.get("server_pid")
    server = f"pid {server_pid}, up {duration(doc.get('server_uptime_s'))}" if server_pid else "no process now"
    metrics = doc.get("metrics") or {}
    ready_since = metrics.get("ready_since")
    if doc.get("ready") and isinstance(ready_since, (int, float)):
        server += f", ready for {duration(now - ready_since)}"
    rows.append(("server", f"{server} at {doc.get('base_url')}"))
    rows.append(("status", str(doc.get("status", "-"))))
    restarts = f"{doc.get('restarts', 0)}"
    causes = metrics.get("restarts_by_cause") or {}
    if causes:
        restarts += " (" + ", ".join(f"{cause} {n}" for cause, n in sorted(causes.items())) + ")"
    if doc.get("last_failure"):
        restarts += f"; last failure: {doc['last_failure']}"
    rows.append(("restarts", restarts))
    last = metrics.get("last_restart") or {}
    ready_s, token_s = last.get("restart_to_ready_s"), last.get("restart_to_first_token_s")
    if isinstance(ready_s, (int, float)):
        text = f"ready {ready_s:.2f} s after it began"
        if isinstance(token_s, (int, float)):
            text += f", first token to a held request {token_s:.2f} s"
        rows.append(("last restart", text))
    resets = metrics.get("resets") or []
    if resets:
        rows.append(("GPU resets", ", ".join(f"{r['outcome']} {r['count']}" for r in resets)))
    planned = doc.get("planned_restarts") or {}
    if planned:
        nxt = planned.get("next_fire")
        text = f"{nxt} (cron \"{planned.get('cron')}\" {planned.get('timezone') or ''})".replace(" )", ")") \
            if nxt else "none (no [schedule].restart_cron)"
        decay = planned.get("decay") or {}
        if decay.get("enabled"):
            text += "; decay triggers on"
        rows.append(("next planned restart", text))
        history = planned.get("history") or []
        if history:
            last = history[-1]
            drained = {True: "drained", False: "drain timed out", None: "pending"}.get(last.get("drained"), "")
            down = last.get("unavailable_s")
            text = f"{last.get('kind')} ({last.get('reason') or 'no reason given'}), {drained}"
            if isinstance(down, (int, float)):
                text += f", unavailable {down:.1f} s"
            rows.append(("last planned restart", text))
    rows += _build_rows(doc.get("build"))
    rows.append(("GPU", _gpu_line(doc.get("gpu"))))
    front = doc.get("front") or {}
    if front.get("listen"):
        rows.append(("front door", f"http://{front['listen']} (clients): {front.get('waiting', 0)} held, "
                                   f"{front.get('in_flight', 0)} in flight, {front.get('connections', 0)} connections"))
    if metrics.get("listen"):
        rows.append(("metrics", f"http://{metrics['listen']}/metrics"))
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    limits = doc.get("limits")
    if isinstance(limits, dict) and limits.get("rows"):
        lines += limits_table(limits)
    events = doc.get("events") or []
    if events:
        lines.append("  recent events:")
        for ev in events:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ev.get("time", 0))))
            lines.append(f"    {stamp} {one_line(ev.get('event'))}: {one_line(ev.get('message'))}")
    return lines


def one_line(text: object) -> str:
    """``text`` on one terminal line: a character that is not printable (a newline an ``extra_args``
    value or a server's line carried, an escape, U+2028) shown as its escape (``\\n``, ``\\x1b``),
    never acted on by the terminal nor read as a line of its own."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in str(text))


def _build_rows(build: Any) -> list[tuple[str, str]]:
    """The serving llama-server build (on probation or not), the last one refused with its cause, and
    the last trial (both builds, both figures in decode tokens/s, kept or why not)."""
    if not isinstance(build, dict):
        return []
    rows = []
    serving = build.get("serving")
    if isinstance(serving, dict):
        rows.append(("build", f"{serving.get('build')} at {serving.get('binary')}"
                              f"{' (on probation)' if build.get('on_probation') else ''}"))
    refused = build.get("refused")
    if isinstance(refused, dict):  # refused at its preflight, or rolled back later (loading, probation)
        rows.append(("not served", f"{refused.get('build')} at {refused.get('binary')}: {refused.get('cause')}"))
    trial = build.get("trial")
    if isinstance(trial, dict):  # the trial's verdict only: a build that passed may still fail its probation
        verdict = "passed" if trial.get("kept") else f"rolled back: {trial.get('cause')}"
        rows.append(("last trial", f"{trial.get('build')} {trial.get('tokens_per_s')} tok/s vs "
                                   f"{trial.get('previous_build')} {trial.get('previous_tokens_per_s')} tok/s: "
                                   f"{verdict}"))
    return rows


def _silence(doc: dict[str, Any]) -> str:
    """``: no HTTP answer for 12 s`` when the ready server stopped answering its probes."""
    liveness = doc.get("liveness")
    if doc.get("phase") == "ready" and isinstance(liveness, dict) and liveness.get("answering") is False:
        return f": no HTTP answer for {duration(liveness.get('silent_s'))}"
    return ""


def _gpu_line(gpu: Any) -> str:
    if not isinstance(gpu, dict) or not gpu:
        return "not watched"
    if gpu.get("watch") == "off":
        return f"not watched: {gpu.get('reason')}"
    sample = gpu.get("sample") or {}
    ident = sample.get("identity") or gpu.get("identity") or {}
    parts = [f"{ident.get('index', '?')} {ident.get('name', '')}".strip()]
    if sample.get("temperature_c") is not None:
        parts.append(f"{sample['temperature_c']} °C")
    if sample.get("power_mw") is not None:
        limit = sample.get("power_limit_mw")
        parts.append(f"{sample['power_mw'] / 1000:.0f} W" + (f" of {limit / 1000:.0f} W" if limit else ""))
    if sample.get("memory_used_bytes") is not None and sample.get("memory_total_bytes"):
        parts.append(f"{sample['memory_used_bytes'] // MIB:,} of {sample['memory_total_bytes'] // MIB:,} MiB used")
    reasons = sample.get("clock_event_reasons")
    if isinstance(reasons, int) and reasons & ~0x1:
        parts.append(f"clock events 0x{reasons:x}")
    if not sample:
        parts.append("no sample yet")
    return ", ".join(parts)


_LIMIT_USE = {"RLIMIT_NOFILE": ("fds", "nofile_limit", "open fds"),
              "RLIMIT_NPROC": ("threads", "nproc_limit", "threads")}


def _use_text(limit: str, usage: dict[str, Any]) -> str:
    """``12 open fds (0.3% of 4096)`` for a limit with a sampled use, else ``-``."""
    if limit not in _LIMIT_USE or usage.get(_LIMIT_USE[limit][0]) is None:
        return "-"
    key, limit_key, what = _LIMIT_USE[limit]
    used, value = usage[key], usage.get(limit_key)
    text = f"{used} {what}"
    if isinstance(value, int) and value > 0:  # RLIM_INFINITY is -1
        text += f" ({100.0 * used / value:.1f}% of {value})"
    if limit == "RLIMIT_NOFILE" and usage.get("connections") is not None:
        text += f", {usage['connections']} connections"
    return text


def limits_table(limits: dict[str, Any]) -> list[str]:
    """The ``limits`` snapshot as a table: configured, llama-guard's own, applied, effective, use."""
    usage: dict[str, Any] = limits.get("usage") or {}
    header = ("limit", "configured", "llama-guard (soft / hard)", "applied (soft / hard)",
              "effective (soft / hard)", "in use")
    table = [header] + [(r.get("limit", "?"), r.get("configured", "-"), r.get("daemon", "-"),
                         r.get("planned", "-"), r.get("effective", "-"), _use_text(r.get("limit", ""), usage))
                        for r in limits["rows"]]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    out = ["  limits:"]
    for row in table:
        out.append("    " + "  ".join(f"{cell!s:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip())
    source = next((r.get("source") for r in limits["rows"] if r.get("source") not in (None, "-")), None)
    notes = []
    if source:
        notes.append(f"effective = read back from the server ({source})")
    if usage.get("pids_max") is not None:
        notes.append(f"cgroup tasks {usage.get('pids_current')} of pids.max {usage['pids_max']}")
    if not usage:
        notes.append("no use sampled yet ([limits].sample_interval_s)")
    if notes:
        out.append("    " + "; ".join(notes))
    return out
