"""The health-event catalogue: one stable snake_case name per event.

Every event llama-guard reports has a name operators filter on (the journald field
``LLAMA_GUARD_EVENT``), a severity (mapped to syslog ``PRIORITY``), a stable ``MESSAGE_ID``
(a 128-bit id written as 32 hex digits, as journald catalogs expect) and a message template
formatted from the event's fields. The names are part of the interface contract
(operators filter on them): add new ones freely, rename none.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol


class Severity(enum.IntEnum):
    """Syslog priorities (RFC 5424), the values journald stores in ``PRIORITY``."""

    CRITICAL = 2
    ERROR = 3
    WARNING = 4
    NOTICE = 5
    INFO = 6
    DEBUG = 7


# A fixed namespace so that MESSAGE_IDs are stable across releases and machines.
_MESSAGE_ID_NAMESPACE = uuid.UUID("6c1a7f0e-2b1d-4d8e-9a57-3e0c1b5f9d42")


@dataclass(frozen=True)
class EventSpec:
    """What is fixed about one event name.

    ``template`` is a ``str.format`` template over the event's fields; a missing field
    renders as ``?`` rather than raising.
    """

    name: EventName
    severity: Severity
    template: str

    @property
    def message_id(self) -> str:
        """The journald ``MESSAGE_ID``: 32 lower-case hex digits derived from the name."""
        return uuid.uuid5(_MESSAGE_ID_NAMESPACE, self.name).hex


# Every event name, as a type: mypy rejects an unknown name at every emit (``Emitter.emit``,
# ``Context.emit``, the policy's ``Emit``). :data:`CATALOG` holds exactly these names (a test
# checks it); add a name here and its spec there.
EventName = Literal[
    "daemon_started",
    "daemon_stopping",
    "daemon_exit",
    "server_starting",
    "server_ready",
    "server_exited",
    "server_stopped",
    "server_oom",
    "server_cuda_error",
    "server_gpu_unavailable",
    "server_hang",
    "server_completion_error",
    "server_load_timeout",
    "server_load_stalled",
    "server_alloc_recovered",
    "server_gpu_incompatible",
    "server_restart",
    "server_backoff",
    "server_boot_failure",
    "server_stop_timeout",
    "crash_loop",
    "gpu_watch_off",
    "gpu_temperature_high",
    "gpu_temperature_ok",
    "gpu_power_high",
    "gpu_throttled",
    "gpu_persistence_off",
    "gpu_foreign_process",
    "gpu_driver_version",
    "gpu_lost",
    "gpu_xid",
    "gpu_xid_unparsed",
    "gpu_reset",
    "gpu_power_ok",
    "gpu_throttle_ok",
    "gpu_foreign_process_gone",
    "gpu_recovered",
    "gpu_kmsg_off",
    "gpu_vram_wait",
    "gpu_vram_check_failed",
    "gpu_vram_not_released",
    "limit_low",
    "resource_exhausted",
    "limit_ok",
    "limit_not_raised",
    "limits_applied",
    "threads_warning",
    "scheduled_restart",
    "decay_restart",
    "restart_requested",
    "scheduled_restart_skipped",
    "scheduled_restart_missed",
    "decay_detected",
    "planned_restart_done",
    "drain_timeout",
    "stop_drain_timeout",
    "config_reloaded",
    "config_error",
    "reload_ignored",
    "watcher_failed",
    "blocking_call_timeout",
    "gpu_nvml_timeout",
    "server_escaped_process",
    "server_unkillable",
    "status_write_failed",
    "server_unauthenticated",
    "server_line",
    "server_probe",
    "server_crash_repeated",
    "gpu_recovery_action",
    "gpu_watchdog_repeated",
    "front_listening",
    "front_port_taken",
    "front_held",
    "front_request_refused",
    "server_stream_stalled",
    "server_http_errors",
    "gpu_reset_started",
    "server_failure_repeated",
    "server_on_cpu",
    "server_port_taken",
    "slot_saved",
    "slot_save_failed",
    "slot_restored",
    "slot_restore_failed",
    "slot_restore_refused",
    "slot_restore_unused",
    "slot_dropped",
    "restart_first_token",
    "model_page_cache_short",
    "upgrade_preflight_passed",
    "upgrade_refused",
    "upgrade_rolled_back",
    "upgrade_kept",
    "upgrade_copy_kept",
    "upgrade_copy_failed",
]


_S = Severity

CATALOG: dict[EventName, EventSpec] = {
    spec.name: spec
    for spec in (
        # Lifecycle of the llama-server child.
        EventSpec("daemon_started", _S.INFO, "llama-guard {version} started (config {config_path})"),
        EventSpec("daemon_stopping", _S.NOTICE, "llama-guard stopping: {reason}"),
        EventSpec("daemon_exit", _S.NOTICE, "llama-guard exiting with status {exit_code}: {reason}"),
        EventSpec("server_starting", _S.INFO, "starting llama-server pid {server_pid}: {argv}"),
        EventSpec("server_ready", _S.NOTICE, "llama-server pid {server_pid} ready after {load_s:.2f} s"),
        EventSpec("server_exited", _S.ERROR, "llama-server pid {server_pid} exited: {exit_text}"),
        EventSpec("server_stopped", _S.INFO, "llama-server pid {server_pid} stopped ({exit_text})"),
        EventSpec("server_oom", _S.ERROR, "llama-server pid {server_pid} ran out of GPU memory: {line}"),
        EventSpec("server_cuda_error", _S.ERROR, "llama-server pid {server_pid} hit a fatal GPU error: {line}"),
        EventSpec("server_crash_repeated", _S.ERROR,
                  "llama-server crashed the same way {count} times in {window_s:.0f} s ({request_kind}): {line}"),
        EventSpec("server_gpu_unavailable", _S.ERROR,
                  "llama-server pid {server_pid} found no usable GPU and would run on the CPU: {line}"),
        EventSpec("server_hang", _S.ERROR,
                  "llama-server pid {server_pid} is not responding ({failures} failed probes): {reason}"),
        EventSpec("server_completion_error", _S.ERROR,
                  "llama-server pid {server_pid} answers /health but its completions fail: HTTP {status_code}: "
                  "{error} ({failures} rounds in a row)"),
        EventSpec("server_load_timeout", _S.ERROR,
                  "llama-server pid {server_pid} did not become ready within {load_timeout_s:.0f} s"),
        EventSpec("server_load_stalled", _S.ERROR,
                  "llama-server pid {server_pid} stalled while loading: no output line, CPU time or HTTP "
                  "answer for {stalled_s:.0f} s (load_stall_s {load_stall_s:.0f} s)"),
        EventSpec("server_alloc_recovered", _S.WARNING,
                  "llama-server pid {server_pid} recovered from a failed allocation ({recovery}): {line}"),
        EventSpec("server_gpu_incompatible", _S.CRITICAL,
                  "llama-server pid {server_pid} cannot run on this GPU/driver: {cause}; fix: {fix}"),
        EventSpec("server_restart", _S.NOTICE, "restarting llama-server ({restart_cause}): {reason}"),
        EventSpec("server_backoff", _S.WARNING,
                  "waiting {backoff_s:.1f} s before starting llama-server again "
                  "(restart {restart_count} of {max_restarts} in {window_s:.0f} s)"),
        EventSpec("server_boot_failure", _S.CRITICAL,
                  "llama-server cannot start for a configuration reason: {cause}"),
        EventSpec("server_stop_timeout", _S.WARNING,
                  "llama-server pid {server_pid} ignored SIGTERM for {grace_s:.1f} s; sent SIGKILL"),
        EventSpec("crash_loop", _S.CRITICAL,
                  "llama-server failed {restart_count} times within {window_s:.0f} s; giving up"),
        # GPU (NVML, Xid, reset).
        EventSpec("gpu_watch_off", _S.NOTICE, "GPU watch is off: {reason}"),
        EventSpec("gpu_temperature_high", _S.WARNING,
                  "GPU {gpu_index} temperature {gpu_temp_c} °C (warning at {threshold_c} °C)"),
        EventSpec("gpu_temperature_ok", _S.INFO, "GPU {gpu_index} temperature back to {gpu_temp_c} °C"),
        EventSpec("gpu_power_high", _S.WARNING,
                  "GPU {gpu_index} power {gpu_power_w:.0f} W near its {gpu_power_limit_w:.0f} W limit"),
        EventSpec("gpu_throttled", _S.WARNING, "GPU {gpu_index} is throttled: {reasons}"),
        EventSpec("gpu_persistence_off", _S.WARNING,
                  "GPU {gpu_index} persistence mode is off; enable the nvidia-persistenced service"),
        EventSpec("gpu_foreign_process", _S.WARNING,
                  "GPU {gpu_index}: pid {foreign_pid} ({foreign_name}) holds {foreign_mib} MiB of VRAM"),
        EventSpec("gpu_driver_version", _S.WARNING,
                  "GPU driver {driver_version} is outside the configured series {expected}"),
        EventSpec("gpu_lost", _S.CRITICAL, "GPU {gpu_index} is lost: {reason}"),
        EventSpec("gpu_xid", _S.ERROR, "GPU {gpu_index} reported Xid {xid}: {meaning}"),
        EventSpec("gpu_recovery_action", _S.CRITICAL,
                  "GPU {gpu_index}: the driver's recovery action is {recovery_action} ({source}); {advice}"),
        EventSpec("gpu_watchdog_repeated", _S.WARNING,
                  "the launch watchdog ended llama-server's GPU work {count} times in {window_s:.0f} s: {advice}"),
        EventSpec("gpu_xid_unparsed", _S.WARNING, "GPU {gpu_index}: an Xid line could not be parsed: {line}"),
        EventSpec("server_port_taken", _S.WARNING,
                  "llama-server's port {port} is held by {holder}; retrying, at most {port_wait_s:.0f} s "
                  "(taken for {waited_s:.0f} s so far)"),
        EventSpec("server_on_cpu", _S.WARNING,
                  "llama-server pid {server_pid} was asked to offload {n_gpu_layers} layers but runs on the CPU: "
                  "{cause}; {fix}"),
        EventSpec("server_failure_repeated", _S.ERROR,
                  "llama-server fails the same way right after each start; not restarting again: {cause}"),
        EventSpec("gpu_reset_started", _S.NOTICE,
                  "GPU {gpu_index} reset begins after {trigger}; it waits for {waits_for} "
                  "(at most {deadline_s:.0f} s)"),
        EventSpec("gpu_reset", _S.NOTICE, "GPU {gpu_index} reset {outcome}: {reason}"),
        EventSpec("gpu_power_ok", _S.INFO, "GPU {gpu_index} power back to {gpu_power_w:.0f} W"),
        EventSpec("gpu_throttle_ok", _S.INFO, "GPU {gpu_index} is no longer throttled"),
        EventSpec("gpu_foreign_process_gone", _S.INFO,
                  "GPU {gpu_index}: pid {foreign_pid} ({foreign_name}) no longer holds VRAM"),
        EventSpec("gpu_recovered", _S.NOTICE, "GPU {gpu_index} answers again: {reason}"),
        EventSpec("gpu_kmsg_off", _S.NOTICE, "{reason}"),
        EventSpec("gpu_vram_wait", _S.WARNING,
                  "GPU {gpu_index}: waiting for VRAM before starting llama-server: {holders} hold it; {missing}"),
        EventSpec("gpu_vram_check_failed", _S.WARNING,
                  "GPU {gpu_index}: the VRAM check before a start failed: {reason}"),
        EventSpec("gpu_vram_not_released", _S.WARNING,
                  "GPU {gpu_index}: VRAM of the previous server not released after {waited_s:.1f} s"),
        # Limits and resources.
        EventSpec("limit_low", _S.WARNING, "{limit} use {used} of {limit_value} ({fraction:.0%})"),
        EventSpec("resource_exhausted", _S.ERROR, "{limit} exhausted: {reason}"),
        EventSpec("limit_ok", _S.INFO, "{limit} use back to {used} of {limit_value} ({fraction:.0%})"),
        EventSpec("limit_not_raised", _S.WARNING, "{reason}"),
        EventSpec("limits_applied", _S.INFO, "llama-server pid {server_pid} runs with {summary}"),
        EventSpec("threads_warning", _S.WARNING, "llama-server threads: {reason}"),
        # Planned restarts and configuration.
        EventSpec("scheduled_restart", _S.NOTICE, "planned restart of llama-server: {reason}"),
        EventSpec("decay_restart", _S.NOTICE, "restart of degraded llama-server pid {server_pid}: {reason}"),
        EventSpec("restart_requested", _S.NOTICE, "restart of llama-server requested: {reason}"),
        EventSpec("scheduled_restart_skipped", _S.INFO, "planned restart skipped: {reason}"),
        EventSpec("scheduled_restart_missed", _S.WARNING, "planned restart missed: {reason}"),
        EventSpec("decay_detected", _S.WARNING, "llama-server pid {server_pid} degraded: {reason}"),
        EventSpec("planned_restart_done", _S.NOTICE,
                  "planned restart ({kind}) done, {outcome}: up {uptime_s:.0f} s before, "
                  "unavailable {unavailable_s:.1f} s; {summary}"),
        EventSpec("drain_timeout", _S.WARNING,
                  "llama-server still busy after {drain_timeout_s:.0f} s of draining; restarting anyway"),
        EventSpec("stop_drain_timeout", _S.WARNING,
                  "requests still in flight to llama-server pid {server_pid} after {stop_drain_s:.0f} s "
                  "([front].stop_drain_s); stopping it anyway"),
        EventSpec("config_reloaded", _S.NOTICE, "configuration reloaded from {config_path}{changed_text}"),
        EventSpec("config_error", _S.ERROR, "configuration error: {reason}"),
        EventSpec("reload_ignored", _S.NOTICE, "reload (SIGHUP) ignored: {reason}"),
        # The daemon's own health: supervision of its tasks and blocking calls.
        EventSpec("watcher_failed", _S.ERROR,
                  "watcher {watcher} failed ({failures} in {window_s:.0f} s): {error}; {action}"),
        EventSpec("blocking_call_timeout", _S.WARNING, "{call} did not return within {timeout_s:g} s: {effect}"),
        EventSpec("gpu_nvml_timeout", _S.ERROR,
                  "NVML call {call} did not return within {timeout_s:g} s; GPU watch degraded ({effect})"),
        EventSpec("server_escaped_process", _S.WARNING,
                  "pid {escaped_pid} ({escaped_name}) left llama-server pid {server_pid}'s process group and "
                  "still holds its output; killed"),
        EventSpec("server_unkillable", _S.CRITICAL,
                  "llama-server pid {server_pid} outlived SIGKILL for {waited_s:.0f} s ({holds}); not starting "
                  "a second server, no GPU reset; reboot the host"),
        EventSpec("status_write_failed", _S.WARNING,
                  "cannot write status under {runtime_dir}: {reason}; `llama-guard status` and "
                  "`llama-guard restart` will not find this daemon"),
        EventSpec("server_unauthenticated", _S.WARNING,
                  "llama-server listens on {host}:{port}, beyond loopback, without an API key "
                  "([server].api_key_file)"),
        # The front door (client traffic; docs/front.md).
        EventSpec("front_listening", _S.INFO,
                  "front door listening on {listen} for llama-server at {upstream} "
                  "(at most {max_connections} connections)"),
        EventSpec("front_port_taken", _S.WARNING,
                  "the front door's address {listen} is held by {holder}; retrying, at most {port_wait_s:.0f} s "
                  "(taken for {waited_s:.0f} s so far)"),
        EventSpec("front_held", _S.NOTICE,
                  "front door held {held} requests while llama-server was {phase} (longest {longest_s:.1f} s "
                  "from arrival): {forwarded} forwarded, {replayed} replayed, {failed} failed, {gone} gone "
                  "(the client left); {refused} refused (max_held)"),
        EventSpec("front_request_refused", _S.WARNING,
                  "a request ({method} {path}, body sha256 {body_sha256}) was in flight at two llama-server "
                  "crashes (pids {server_pids}): refused with 422 until {until} ({refuse_s} s)"),
        EventSpec("server_stream_stalled", _S.WARNING,
                  "a response of llama-server pid {server_pid} got no byte for {stalled_s:.0f} s "
                  "(stall {stalls} of {hang_strikes})"),
        EventSpec("server_http_errors", _S.WARNING,
                  "llama-server pid {server_pid} answered {errors} requests in a row with HTTP 5xx "
                  "(last {status})"),
        # Each slot's KV cache carried across restarts (llama_guard.slots).
        EventSpec("slot_saved", _S.INFO,
                  "saved slot {slot_id} ({n_tokens} tokens, {bytes} bytes) in {save_ms:.0f} ms ({reason})"),
        EventSpec("slot_save_failed", _S.WARNING, "could not save slot {slot_id}: {error}"),
        EventSpec("slot_restored", _S.INFO,
                  "restored slot {slot_id} ({n_tokens} tokens) in {restore_ms:.0f} ms; verified: {cache_n} "
                  "tokens reused"),
        EventSpec("slot_restore_failed", _S.WARNING, "could not restore slot {slot_id}: {error}"),
        EventSpec("slot_restore_refused", _S.WARNING,
                  "refused slot file {file} ({refusal}): {detail}; it was removed and never reached llama-server"),
        EventSpec("slot_restore_unused", _S.ERROR,
                  "a restored slot was not reused ({cache_n} of {n_tokens} tokens) with model {model} and build "
                  "{build}: restores stop for this model and build"),
        EventSpec("slot_dropped", _S.INFO,
                  "dropped slot file {file} ({bytes} bytes): the slot files exceed [slots].budget_mib "
                  "{budget_mib:.0f} MiB"),
        EventSpec("restart_first_token", _S.INFO,
                  "first token of llama-server pid {server_pid} to a held request "
                  "{restart_to_first_token_s:.2f} s after the restart began"),
        EventSpec("model_page_cache_short", _S.WARNING,
                  "the host's RAM cannot keep the model file {model} ({model_mib:.0f} MiB) in the page cache "
                  "({available_mib:.0f} MiB available): the next start reads it from disk"),
        # New llama-server builds (llama_guard.upgrade; README "Upgrading llama-server").
        EventSpec("upgrade_preflight_passed", _S.NOTICE,
                  "llama-server build {build} at {binary} passed preflight (it starts, every flag is known); "
                  "it replaces {serving_build}"),
        EventSpec("upgrade_refused", _S.ERROR,
                  "llama-server build {build} at {binary} refused: {cause}; {outcome}"),
        EventSpec("upgrade_rolled_back", _S.ERROR,
                  "rolled back from llama-server build {from_build} ({from_binary}) to {to_build} ({to_binary}): "
                  "{cause}"),
        EventSpec("upgrade_kept", _S.NOTICE,
                  "llama-server build {build} at {binary} kept after {probation_s:.0f} s of probation "
                  "(it replaced {previous_build})"),
        EventSpec("upgrade_copy_kept", _S.INFO,
                  "kept a copy of llama-server build {build} in {dir} ({files} files; {kept} builds kept)"),
        EventSpec("upgrade_copy_failed", _S.WARNING, "kept copy of llama-server build {build} in {dir}: {reason}"),
        # The server's own output, one event per line (debug level).
        EventSpec("server_line", _S.DEBUG, "{line}"),
        EventSpec("server_probe", _S.DEBUG,
                  "liveness of llama-server pid {server_pid}: health {health_ok}, canary {canary_ok}, "
                  "busy {busy}, progressed {progressed}"),
    )
}


class _Missing(dict[str, object]):
    def __missing__(self, key: str) -> object:
        return "?"


def render_message(name: EventName, fields: Mapping[str, object]) -> str:
    """The human ``MESSAGE`` of event ``name`` with ``fields``; never raises on a missing field."""
    spec = CATALOG[name]
    try:
        return spec.template.format_map(_Missing(fields))
    except (ValueError, TypeError):
        # A field of an unexpected type for its format spec: fall back to plain rendering.
        return f"{name}: " + ", ".join(f"{k}={v}" for k, v in fields.items())


class EmitFn(Protocol):
    """The signature of :meth:`llama_guard.output.eventlog.Emitter.emit`, for code handed only the
    function (``Context.emit``): event ``name`` with its template's ``fields``."""

    def __call__(self, name: EventName, /, **fields: Any) -> None: ...
