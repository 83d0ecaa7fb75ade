#!/usr/bin/env python3
"""Generate deploy/journald/llama-guard.catalog from llama_guard.vocab.events.CATALOG.

journald message catalogs (``journalctl -x``, ``--list-catalog``) explain an entry by its
``MESSAGE_ID``. Each event in the catalogue gets one entry: a subject, what happened and what
to do about it. ``@FIELD@`` in a body is replaced by journalctl with the entry's field.

Usage: ``python scripts/gen_catalog.py`` (writes the file), ``--check`` (exit 1 when the shipped
file differs from what the catalogue generates), ``--stdout``.
An event without hand-written text below gets a generic entry; write one for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "supervisor"))

from llama_guard.vocab.events import CATALOG, EventName, Severity  # noqa: E402

OUTPUT = ROOT / "deploy" / "journald" / "llama-guard.catalog"

# name -> (subject, body). Bodies: what happened, then what to do.
TEXT: dict[EventName, tuple[str, str]] = {
    "daemon_started": (
        "llama-guard started",
        "llama-guard @VERSION@ started with configuration @CONFIG_PATH@. It will start llama-server\n"
        "and report readiness to systemd once the server answers /health."),
    "daemon_stopping": (
        "llama-guard is stopping",
        "llama-guard is shutting down (@REASON@). It stops llama-server with SIGTERM, waits\n"
        "[recovery].stop_grace_s, then sends SIGKILL."),
    "daemon_exit": (
        "llama-guard exited",
        "llama-guard exits with status @EXIT_CODE@: @REASON@.\n\n"
        "0: stopped on request. 78: configuration error; systemd does not restart it - fix the\n"
        "configuration (`llama-guard check`) and restart the unit. 75: llama-server failed too\n"
        "often (crash loop). 69: the GPU is lost and a reset cannot help; reboot the host."),
    "server_starting": (
        "llama-server is starting",
        "llama-guard started llama-server as pid @SERVER_PID@. It is not ready until /health\n"
        "answers 200; loading a large model can take minutes."),
    "server_ready": (
        "llama-server is ready",
        "llama-server pid @SERVER_PID@ answers /health after @LOAD_S@ s and serves requests. After a\n"
        "restart, @RESTART_TO_READY_S@ s have passed since the restart began (the old server's stop or\n"
        "exit): llama_guard_restart_to_ready_seconds."),
    "server_exited": (
        "llama-server exited unexpectedly",
        "llama-server pid @SERVER_PID@ exited: @EXIT_TEXT@. llama-guard restarts it with backoff.\n"
        "Its last error line (if any): @LAST_ERROR@\n\n"
        "A SIGKILL nobody sent is usually the kernel's OOM killer (host RAM): check\n"
        "`journalctl -k | grep -i oom`. A SIGSEGV or SIGABRT: the server's last lines are in\n"
        "`journalctl -u llama-guard LLAMA_SERVER_LINE=1`."),
    "server_stopped": (
        "llama-server stopped",
        "llama-server pid @SERVER_PID@ stopped as requested (@EXIT_TEXT@)."),
    "server_oom": (
        "llama-server ran out of GPU memory",
        "llama-server pid @SERVER_PID@ reported a CUDA out-of-memory error:\n@LINE@\n\n"
        "llama-guard stops the server and restarts it (resetting the GPU when [recovery].reset_on\n"
        "includes \"oom\"). If it repeats: lower [server].ctx_size or parallel, use a quantized KV\n"
        "cache (cache_type_k/v = \"q8_0\"), lower n_gpu_layers or batch_size/ubatch_size, and check\n"
        "for other processes on the GPU (nvidia-smi)."),
    "server_cuda_error": (
        "llama-server hit a fatal GPU error",
        "llama-server pid @SERVER_PID@ reported a fatal CUDA error:\n@LINE@\n\n"
        "llama-guard stops and restarts the server. Look for Xid events of the same time\n"
        "(`journalctl -u llama-guard LLAMA_GUARD_EVENT=gpu_xid`) and in `journalctl -k`."),
    "server_gpu_unavailable": (
        "llama-server found no usable GPU",
        "llama-server pid @SERVER_PID@ would run on the CPU: @LINE@\n\n"
        "Check the driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES in the unit, the device nodes\n"
        "(/dev/nvidia*) and that the llama-guard user is in the video/render groups."),
    "server_hang": (
        "llama-server is not responding",
        "llama-server pid @SERVER_PID@ failed @FAILURES@ probes with no sign of progress: no CPU\n"
        "time of its processes, no output line, no token counter moving (@REASON@). A probe that\n"
        "times out while the server makes progress does not count. llama-guard stops it\n"
        "(SIGTERM, then SIGKILL) and starts it again.\n\n"
        "Repeated hangs: check GPU health events and the server's last lines.\n"
        "A server that answers no HTTP request at all (not /health, not /metrics, not the canary)\n"
        "for [health].silent_limit_s is hung even while its CPU time moves: CPU time is a hint."),
    "server_completion_error": (
        "llama-server answers /health but its completions fail",
        "llama-server pid @SERVER_PID@ answered the 1-token canary completion with HTTP\n"
        "@STATUS_CODE@ in @FAILURES@ rounds in a row ([health].hang_strikes): @ERROR@.\n"
        "The server is up (/health says 200) but cannot serve. llama-guard stops it and starts\n"
        "it again, like a crash (backoff, crash-loop limit).\n\n"
        "Read the error message: a GPU fault, a memory pool exhausted, a broken build. If it\n"
        "repeats after restarts, the journal's server_line events before it name the cause."),
    "server_load_stalled": (
        "llama-server froze while loading",
        "llama-server pid @SERVER_PID@ showed no sign of progress for @STALLED_S@ s while loading: no\n"
        "output line, no CPU time of its processes and no answer on /health (not even 503).\n"
        "llama-guard stops it and starts it again ([health].load_stall_s; a load that progresses\n"
        "gets its full load_timeout_s).\n\n"
        "Repeated stalls: a stuck CUDA initialisation (check `nvidia-smi` and `journalctl -k` for\n"
        "Xid events) or a hung network filesystem holding the model file."),
    "server_alloc_recovered": (
        "llama-server recovered from a failed GPU allocation",
        "llama-server pid @SERVER_PID@ reported a failed allocation:\n@LINE@\n"
        "and recovered (@RECOVERY@). Nothing was stopped or reset. It runs with less headroom:\n"
        "if it repeats, lower [server].ctx_size, batch_size/ubatch_size or n_gpu_layers, or\n"
        "check for other processes on the GPU (nvidia-smi)."),
    "server_gpu_incompatible": (
        "llama-server cannot run on this GPU or driver",
        "llama-server pid @SERVER_PID@ reported:\n@LINE@\n\n"
        "This is a fixed property of the binary, the driver or the card (@CAUSE@): no restart or\n"
        "GPU reset can fix it, so llama-guard exits with status 78 and systemd does not restart it.\n"
        "Fix: @FIX@. Then restart the unit."),
    "server_load_timeout": (
        "llama-server did not become ready in time",
        "llama-server pid @SERVER_PID@ was not ready within @LOAD_TIMEOUT_S@ s. llama-guard stops\n"
        "it and counts a failed start. A slow disk or a model larger than expected: raise\n"
        "[health].load_timeout_s."),
    "server_restart": (
        "llama-server is being restarted",
        "llama-guard restarts llama-server pid @SERVER_PID@: @REASON@."),
    "server_backoff": (
        "waiting before the next start of llama-server",
        "llama-guard waits @BACKOFF_S@ s before starting llama-server again (restart\n"
        "@RESTART_COUNT@ of @MAX_RESTARTS@ within @WINDOW_S@ s). After that many it gives up\n"
        "(crash_loop)."),
    "server_boot_failure": (
        "llama-server cannot start: configuration",
        "llama-server refused to start for a configuration reason: @CAUSE@\n\n"
        "This includes a server that fails the same way before it is ready on consecutive starts\n"
        "(the same last error line, e.g. an abort in warm-up with a context too small): @LINE@\n\n"
        "Restarting cannot help: llama-guard exits with status 78 and systemd does not restart\n"
        "it. Fix /etc/llama-guard/llama-guard.toml (flags, model path, port), run\n"
        "`llama-guard check`, then `systemctl restart llama-guard`."),
    "server_stop_timeout": (
        "llama-server ignored SIGTERM",
        "llama-server pid @SERVER_PID@ did not exit within @GRACE_S@ s of SIGTERM and was killed\n"
        "with SIGKILL. Raise [recovery].stop_grace_s if requests need longer to finish (and keep\n"
        "the unit's TimeoutStopSec above it)."),
    "crash_loop": (
        "llama-server crash loop: llama-guard gives up",
        "llama-server failed @RESTART_COUNT@ times within @WINDOW_S@ s. llama-guard stops trying\n"
        "and exits non-zero; systemd's Restart=on-failure and StartLimitBurst decide what\n"
        "happens next.\n\n"
        "Read the failures before it: `journalctl -u llama-guard -p warning -b`."),
    "gpu_watch_off": (
        "GPU watch is off",
        "llama-guard does not watch the GPU: @REASON@. Temperature, power, Xid and GPU-lost\n"
        "events will not be reported. Check the NVIDIA driver and [gpu].enabled."),
    "gpu_temperature_high": (
        "GPU temperature high",
        "GPU @GPU_INDEX@ is at @GPU_TEMP_C@ °C (warning at @THRESHOLD_C@ °C). Check cooling and\n"
        "airflow; a hot GPU throttles and slows generation."),
    "gpu_temperature_ok": (
        "GPU temperature back to normal",
        "GPU @GPU_INDEX@ is back to @GPU_TEMP_C@ °C."),
    "gpu_power_high": (
        "GPU power draw near its limit",
        "GPU @GPU_INDEX@ draws @GPU_POWER_W@ W of its @GPU_POWER_LIMIT_W@ W limit. Sustained, it\n"
        "power-throttles; check `nvidia-smi -q -d POWER`."),
    "gpu_throttled": (
        "GPU is throttled",
        "GPU @GPU_INDEX@ is throttled: @REASONS@. Generation is slower until it clears.\n"
        "Thermal or power reasons: check cooling and power limits."),
    "gpu_persistence_off": (
        "GPU persistence mode is off",
        "GPU @GPU_INDEX@ has persistence mode off: every start re-initialises the driver and a\n"
        "reset takes longer. Enable nvidia-persistenced (`systemctl enable --now\n"
        "nvidia-persistenced`)."),
    "gpu_foreign_process": (
        "another process uses the GPU",
        "On GPU @GPU_INDEX@, pid @FOREIGN_PID@ (@FOREIGN_NAME@) holds @FOREIGN_MIB@ MiB of VRAM that\n"
        "llama-server may need. Stop it, or set [gpu].foreign_processes."),
    "gpu_driver_version": (
        "unexpected GPU driver version",
        "The NVIDIA driver is @DRIVER_VERSION@, outside the configured series @EXPECTED@. A driver\n"
        "update without a reboot leaves a mismatched kernel module; reboot, or update\n"
        "[gpu].driver_version."),
    "gpu_lost": (
        "GPU is lost",
        "GPU @GPU_INDEX@ no longer answers: @REASON@. llama-guard stops llama-server and, per\n"
        "[recovery].reset_on, tries a GPU reset. If the GPU fell off the bus, only a reboot (or\n"
        "a power cycle) brings it back; see `journalctl -k | grep -i xid`."),
    "gpu_recovery_action": (
        "the GPU driver asks for a recovery action",
        "NVML (or Xid 154) says GPU @GPU_INDEX@ needs: @RECOVERY_ACTION@ (read from @SOURCE@).\n"
        "A GPU reset is run when that is what it asks for and [recovery] allows one; otherwise no\n"
        "server is started and llama-guard exits with status 69.\n\n"
        "@ADVICE@"),
    "gpu_watchdog_repeated": (
        "the GPU launch watchdog keeps ending llama-server's work",
        "The driver's launch watchdog ended a kernel of llama-server @COUNT@ times within @WINDOW_S@ s\n"
        "(\"the launch timed out and was terminated\", Xid 8). Each time the server was restarted; the\n"
        "GPU was not reset (one channel timed out, not the GPU).\n\n"
        "@ADVICE@"),
    "server_crash_repeated": (
        "llama-server crashes the same way again",
        "llama-server crashed @COUNT@ times within @WINDOW_S@ s with the same last line: @LINE@\n"
        "The request kind its exception points at: @REQUEST_KIND@. Each crash was restarted.\n\n"
        "Find the client sending such requests, or update llama.cpp; the server's log holds the request."),
    "gpu_xid": (
        "GPU reported an Xid error",
        "GPU @GPU_INDEX@ reported Xid @XID@: @MEANING@.\n\n"
        "Xid 48/63/64/95 concern ECC memory; 79 means the GPU fell off the bus; 13/31/43/45/68/69/94/109\n"
        "are faults of one application: llama-guard acts on those only when the faulting pid (the\n"
        "kernel log's pid=) is its server, and says so in the ACTION, OURS and SOURCE fields\n"
        "(nvml, kmsg, or nvml+kmsg when NVML's event was matched with the kernel line).\n"
        "See NVIDIA's Xid documentation."),
    "gpu_vram_wait": (
        "waiting for another process to free VRAM",
        "Before starting llama-server, llama-guard found that another process holds the VRAM the\n"
        "server needs on GPU @GPU_INDEX@: @HOLDERS@; @MISSING@.\n\n"
        "It waits (at most [gpu].vram_wait_timeout_s = @TIMEOUT_S@ s) and starts the server once\n"
        "the memory is free. The wait is not counted as a failed start and no GPU reset is done.\n"
        "The need is the server's own VRAM at its last good start, or [gpu].expected_vram_mib."),
    "gpu_vram_check_failed": (
        "a VRAM check before a start failed",
        "Before starting llama-server, llama-guard reads GPU @GPU_INDEX@'s free VRAM, who holds it\n"
        "and what the server needs (NVML, and the model's GGUF for the estimate). That check failed\n"
        "or gave no answer within its deadline: @REASON@.\n\n"
        "While waiting for VRAM, the wait goes on and the next check follows a second later;\n"
        "before a wait, the start goes on unchecked. Repeated, look at NVML (nvidia-smi) and at\n"
        "the model file."),
    "gpu_xid_unparsed": (
        "Xid line llama-guard could not read",
        "The kernel logged an Xid line that llama-guard's parser does not understand:\n"
        "@LINE@\n\n"
        "It is reported rather than dropped; nothing was done about it. Please report the line\n"
        "so that the parser can learn its format."),
    "server_port_taken": (
        "llama-server's port is held by another process",
        "llama-server could not bind port @PORT@: it is held by @HOLDER@. After a crash a client or\n"
        "another service can hold it for a while, so llama-guard retries every 2 s, without counting\n"
        "a crash, for [recovery].port_wait_s (@PORT_WAIT_S@ s); then it exits 78 naming the holder.\n"
        "Find it with `ss -ltnp 'sport = :@PORT@'`."),
    "slot_saved": (
        "a slot's KV cache was saved",
        "llama-guard saved slot @SLOT_ID@ of llama-server pid @SERVER_PID@ (@N_TOKENS@ tokens, @BYTES@ bytes)\n"
        "to @FILE@ (@REASON@). After the next restart it is restored into the same slot, so the\n"
        "conversation's next turn evaluates only its new tokens. See docs/slots.md."),
    "slot_save_failed": (
        "a slot's KV cache could not be saved",
        "Saving slot @SLOT_ID@ failed: @ERROR@. The slot's previous file (if any) stays; after a restart\n"
        "its conversation pays its whole prompt again. Check the slot directory's space and owner."),
    "slot_dropped": (
        "a slot file was dropped for the disk budget",
        "@FILE@ (@BYTES@ bytes) was removed: the slot files exceeded [slots].budget_mib (@BUDGET_MIB@ MiB).\n"
        "The oldest go first. Raise the budget to keep more slots across restarts."),
    "slot_restored": (
        "a slot's KV cache was restored and verified",
        "Slot @SLOT_ID@ of llama-server pid @SERVER_PID@ was restored (@N_TOKENS@ tokens in @RESTORE_MS@ ms)\n"
        "and verified: evaluating its tokens reused @CACHE_N@ of them from the restored cache."),
    "slot_restore_failed": (
        "a slot could not be restored",
        "Restoring slot @SLOT_ID@ failed or took too long: @ERROR@. The server is ready without it; its\n"
        "conversation pays its whole prompt again on its next turn."),
    "slot_restore_refused": (
        "a slot file was refused before it reached llama-server",
        "@FILE@ was refused (@REFUSAL@): @DETAIL@. llama-server was never asked to load it, and it was\n"
        "removed. Foreign files come from a server with another model file, build, context size, slot\n"
        "count, KV cache type or KV-layout flag; truncated or corrupt ones from a crash or a disk fault."),
    "slot_restore_unused": (
        "a restored slot was not reused: restores stop for this model and build",
        "A slot was restored but evaluating its own tokens reused @CACHE_N@ of @N_TOKENS@ from it, with\n"
        "model @MODEL@ and build @BUILD@. Models with recurrent or hybrid layers or sliding-window\n"
        "attention can do this. llama-guard no longer saves or restores slots for this model and build\n"
        "(remembered in unrestorable.json in the slot directory; delete that file to try again)."),
    "server_on_cpu": (
        "llama-server runs on the CPU though asked to offload",
        "llama-server pid @SERVER_PID@ was started with @N_GPU_LAYERS@ layers to offload but found no\n"
        "usable GPU (@LINE@): it serves, slowly, on the CPU. Reported whatever [gpu].enabled says.\n\n"
        "@FIX@"),
    "server_failure_repeated": (
        "llama-server fails the same way right after every start",
        "llama-server failed the same way soon after each of several consecutive starts, before it\n"
        "had run [recovery].stable_after_s: @CAUSE@\n\n"
        "Restarting cannot help, so llama-guard exits 78 and systemd does not restart it. The line\n"
        "and the build (@BUILD@) are named: try another llama.cpp build, or change the setting that\n"
        "reaches the failing code, then `systemctl restart llama-guard`."),
    "gpu_reset_started": (
        "GPU reset begins",
        "llama-guard begins resetting GPU @GPU_INDEX@ after @TRIGGER@. It waits for @WAITS_FOR@,\n"
        "at most @DEADLINE_S@ s in all. A stop (systemctl stop) during the reset command waits for it:\n"
        "the command is never interrupted (a reset killed half way can leave the GPU unusable until a\n"
        "reboot); llama-guard tells systemd how long is left (EXTEND_TIMEOUT_USEC)."),
    "gpu_reset": (
        "GPU reset",
        "GPU @GPU_INDEX@ reset @OUTCOME@: @REASON@. A failed reset needs root privileges (or\n"
        "CAP_SYS_ADMIN), no other process on the GPU, and persistence mode; if it keeps failing,\n"
        "reboot."),
    "gpu_vram_not_released": (
        "GPU memory not released after stop",
        "GPU @GPU_INDEX@ still holds the previous server's VRAM after @WAITED_S@ s. Check\n"
        "`nvidia-smi` for leftover processes."),
    "limit_low": (
        "resource use near its limit",
        "@LIMIT@ use is @USED@ of @LIMIT_VALUE@. Raise the limit ([limits] in the config, and the\n"
        "unit's LimitNOFILE=/LimitMEMLOCK=/TasksMax=) before it runs out."),
    "resource_exhausted": (
        "resource exhausted",
        "@LIMIT@ is exhausted: @REASON@. Raise the limit in the unit (LimitNOFILE=,\n"
        "LimitMEMLOCK=, TasksMax=) and in [limits]."),
    "scheduled_restart": (
        "planned restart of llama-server",
        "llama-guard restarts llama-server as planned: @REASON@ ([schedule]). Requests in flight\n"
        "finish first (drain)."),
    "decay_restart": (
        "restart of a degraded llama-server",
        "llama-guard restarts llama-server because a decay trigger fired: @REASON@ (see the\n"
        "decay_detected event before it; [schedule] vram_growth_mib, rss_growth_mib, speed_drop_fraction).\n"
        "Requests in flight finish first (drain)."),
    "restart_requested": (
        "restart of llama-server requested",
        "A restart of llama-server was requested: @REASON@ (SIGUSR1 or `llama-guard restart`)."),
    "drain_timeout": (
        "llama-server still busy when draining ended",
        "llama-server was still busy after @DRAIN_TIMEOUT_S@ s of draining and was restarted\n"
        "anyway. Raise [schedule].drain_timeout_s to let long requests finish."),
    "stop_drain_timeout": (
        "requests still in flight when the stop's drain ended",
        "llama-guard was asked to stop (SIGTERM/SIGINT) and gave the requests in flight to llama-server\n"
        "pid @SERVER_PID@ @STOP_DRAIN_S@ s to finish; some had not, and were cut when the server was\n"
        "stopped. Raise [front].stop_drain_s to let long requests finish (llama-guard extends\n"
        "systemd's TimeoutStopSec with EXTEND_TIMEOUT_USEC while it drains)."),
    "front_listening": (
        "front door listening",
        "The front door accepts client requests on @LISTEN@ and forwards them to llama-server at\n"
        "@UPSTREAM@, holding them while the server is not ready. Clients use @LISTEN@."),
    "front_port_taken": (
        "the front door's port is held by another process",
        "The front door cannot listen on @LISTEN@: @HOLDER@ holds that port. llama-guard retries\n"
        "every 2 s for [recovery].port_wait_s (@PORT_WAIT_S@ s), then exits 78 naming the holder.\n"
        "Stop that process (an old llama-guard, or llama-server started by hand on the clients'\n"
        "port) or choose another [front].listen."),
    "front_held": (
        "requests held while llama-server was not ready",
        "While llama-server was @PHASE@ the front door held @HELD@ requests (the longest @LONGEST_S@ s,\n"
        "from the request's arrival). Each hold ended one way: @FORWARDED@ forwarded, @REPLAYED@ sent\n"
        "once more, @FAILED@ failed (held past [front].hold_timeout_s, or the daemon ended), @GONE@\n"
        "gone (the client left); @REFUSED@ more were refused, never held, past [front].max_held. A\n"
        "failed or refused count above zero means clients saw the restart: raise hold_timeout_s to\n"
        "cover the server's load time, or max_held."),
    "front_request_refused": (
        "a request that crashed llama-server twice is refused",
        "A request (@METHOD@ @PATH@, body SHA-256 @BODY_SHA256@) was in flight when llama-server crashed,\n"
        "was replayed alone to the next server, and was in flight at its crash too (pids @SERVER_PIDS@).\n"
        "The front door answers it, and every retry of it (same method, target and body), with 422\n"
        "until @UNTIL@ ([front].crash_refuse_s); every other request is served. Find the client that\n"
        "sends it (the path and the body's hash name it) and the server's last lines in the journal\n"
        "(grammar, JSON schema, chat template, image input are the usual causes); report the crash to\n"
        "llama.cpp with them, or upgrade llama-server."),
    "server_stream_stalled": (
        "a streaming response stalled",
        "A response of llama-server @SERVER_PID@ had begun and then got no byte for @STALLED_S@ s.\n"
        "[health].hang_strikes stalls with no completed request and no token progress between them\n"
        "are a hang: the server is restarted (server_hang)."),
    "server_http_errors": (
        "llama-server answers with HTTP 5xx",
        "llama-server @SERVER_PID@ answered @ERRORS@ client requests in a row with a 5xx status (the\n"
        "last @STATUS@). llama-guard does not restart for this (a client can cause 500s); read the\n"
        "server's lines around it (server_log_file, journalctl) for the cause."),
    "restart_first_token": (
        "first answer after a restart",
        "A client request the front door held while llama-server restarted got the first byte of its\n"
        "answer from the new server @SERVER_PID@ @RESTART_TO_FIRST_TOKEN_S@ s after the restart began (the\n"
        "old server's stop or exit). Its histogram is llama_guard_restart_to_first_token_seconds."),
    "model_page_cache_short": (
        "the model file does not fit in the page cache",
        "Before a planned restart llama-guard asks the kernel to keep the model file @MODEL@\n"
        "(@MODEL_MIB@ MiB) in the page cache, so the new server reads it from RAM. The host has only\n"
        "@AVAILABLE_MIB@ MiB available: the new server reads (part of) the file from disk, and the\n"
        "restart takes longer. Free RAM on the host, or accept the slower restart."),
    "upgrade_preflight_passed": (
        "a new llama-server build passed preflight",
        "The reload names llama-server build @BUILD@ (@BINARY@), other than the serving @SERVING_BUILD@.\n"
        "It answered --version and its --help lists every flag llama-guard passes, checked while the\n"
        "old server kept serving. The server is restarted on it (drained, clients held) and the build\n"
        "serves on probation ([upgrade].probation_s): a crash in it rolls back (upgrade_rolled_back)."),
    "upgrade_refused": (
        "a llama-server build was refused",
        "llama-server build @BUILD@ at @BINARY@ failed preflight: @CAUSE@.\n"
        "@OUTCOME@. Serving build: @SERVING_BUILD@. Fix the build (or [server].extra_args) and reload\n"
        "again; `llama-guard check` names every flag the configured build does not know and its version."),
    "upgrade_rolled_back": (
        "llama-server rolled back to the last good build",
        "The build @FROM_BUILD@ (@FROM_BINARY@) failed: @CAUSE@.\n"
        "llama-server is started from the last good build @TO_BUILD@ (@TO_BINARY@) instead - the one\n"
        "that served before, or the copy kept under the state directory. The configuration still names\n"
        "the failing build: fix or replace it and reload; `llama-guard status` shows both builds."),
    "upgrade_kept": (
        "a new llama-server build passed its probation",
        "llama-server build @BUILD@ (@BINARY@) served @PROBATION_S@ s without an exit llama-guard did\n"
        "not ask for; it is now the last good build in place of @PREVIOUS_BUILD@, and a copy of it is kept."),
    "upgrade_copy_kept": (
        "a copy of a good llama-server build is kept",
        "The executable and the shared libraries beside it of build @BUILD@ were copied to @DIR@\n"
        "(read-only, with their SHA-256 in manifest.json); @KEPT@ builds are kept (at most two). A\n"
        "build overwritten in place that fails is rolled back to this copy."),
    "upgrade_copy_failed": (
        "a kept llama-server build cannot be used or made",
        "The kept copy of build @BUILD@ in @DIR@: @REASON@. It is not used for a roll-back. Check the\n"
        "disk and the state directory (StateDirectory=, else [runtime].dir)."),
    "config_reloaded": (
        "configuration reloaded",
        "llama-guard reloaded @CONFIG_PATH@ (SIGHUP, `systemctl reload llama-guard`)."),
    "config_error": (
        "configuration error",
        "The configuration cannot be used: @REASON@\n\n"
        "At start llama-guard exits with status 78 and systemd does not restart it. On reload the\n"
        "old configuration stays in force. Run `llama-guard check --config FILE`."),
    "reload_ignored": (
        "reload ignored",
        "A SIGHUP arrived while llama-guard was stopping (or another reload was running): @REASON@\n\n"
        "Nothing was changed. Reload again once the service runs."),
    "watcher_failed": (
        "a llama-guard watcher failed",
        "The watcher @WATCHER@ raised @ERROR@. @ACTION@\n\n"
        "It is restarted with backoff; one that keeps failing ends llama-guard with status 70 so that\n"
        "systemd restarts it. Report the error with the journal excerpt."),
    "blocking_call_timeout": (
        "a blocking call did not return in time",
        "@CALL@ did not return within @TIMEOUT_S@ s: @EFFECT@\n\n"
        "Look for a hung filesystem (the model on a network mount), a FIFO, or a wedged binary."),
    "gpu_nvml_timeout": (
        "an NVML call hangs",
        "The NVML call @CALL@ did not return within @TIMEOUT_S@ s. The GPU watch is degraded: @EFFECT@\n\n"
        "If it persists llama-guard treats the GPU as lost. Check `nvidia-smi` and the kernel log."),
    "server_escaped_process": (
        "a process escaped llama-server's process group",
        "Process @ESCAPED_PID@ (@ESCAPED_NAME@) called setsid or similar and still held llama-server\n"
        "@SERVER_PID@'s output after the server exited. llama-guard killed it.\n\n"
        "Check what the server (or a wrapper script) starts."),
    "server_unkillable": (
        "llama-server outlived SIGKILL",
        "llama-server pid @SERVER_PID@ did not go away after SIGKILL (@HOLDS@). It is stuck in the\n"
        "kernel (state D, typically inside the GPU driver). A second server would fail on the same port\n"
        "or GPU and a GPU reset refuses a GPU in use, so llama-guard starts neither and exits with\n"
        "status 69.\n\n"
        "Reboot the host; check the kernel log for the driver's messages first."),
    "status_write_failed": (
        "status file cannot be written",
        "llama-guard cannot write its status or pid file under @RUNTIME_DIR@: @REASON@\n\n"
        "`llama-guard status` and `llama-guard restart` will not find this daemon. Fix [runtime].dir."),
    "server_unauthenticated": (
        "llama-server reachable without an API key",
        "llama-server listens on @HOST@:@PORT@, an address other hosts can reach, and no API key\n"
        "is configured: anyone who reaches the port can use the model. Set [server].api_key_file\n"
        "(a file readable by [server].user, one key per line) or listen on 127.0.0.1."),
    "gpu_power_ok": (
        "GPU power draw back to normal",
        "GPU @GPU_INDEX@ draws @GPU_POWER_W@ W again, below its warning level."),
    "gpu_throttle_ok": (
        "GPU no longer throttled",
        "GPU @GPU_INDEX@ runs at full clocks again."),
    "gpu_foreign_process_gone": (
        "foreign GPU process gone",
        "On GPU @GPU_INDEX@, pid @FOREIGN_PID@ (@FOREIGN_NAME@) no longer holds VRAM."),
    "gpu_recovered": (
        "GPU answers again",
        "GPU @GPU_INDEX@ answers again: @REASON@."),
    "gpu_kmsg_off": (
        "kernel log watch is off",
        "llama-guard does not read the kernel log: @REASON@. Xid lines from the driver are then\n"
        "seen only through NVML. Under systemd the unit grants CAP_SYSLOG and allows /dev/kmsg;\n"
        "check the unit, or kernel.dmesg_restrict when running by hand."),
    "limit_ok": (
        "resource use back below its warning level",
        "@LIMIT@ use is back to @USED@ of @LIMIT_VALUE@."),
    "limit_not_raised": (
        "a resource limit could not be raised",
        "@LIMIT@: @REASON@. llama-server runs with the lower limit. Raise it in the unit\n"
        "(LimitNOFILE=, LimitMEMLOCK=, TasksMax=) or the sysctl named in the message."),
    "limits_applied": (
        "llama-server resource limits",
        "llama-server pid @SERVER_PID@ runs with @SUMMARY@."),
    "threads_warning": (
        "llama-server thread settings",
        "llama-server threads: @REASON@. Match [server].threads to the physical cores\n"
        "(and OMP_NUM_THREADS in the unit)."),
    "scheduled_restart_skipped": (
        "planned restart skipped",
        "The planned restart was skipped: @REASON@."),
    "scheduled_restart_missed": (
        "planned restart missed",
        "The planned restart did not happen: @REASON@. Check [schedule] and the daemon's state\n"
        "at that time."),
    "decay_detected": (
        "llama-server is degrading",
        "llama-server pid @SERVER_PID@ shows measured degradation: @REASON@. A planned restart\n"
        "follows when [schedule] allows it."),
    "planned_restart_done": (
        "planned restart done",
        "Planned restart (@KIND@) done, @OUTCOME@: the server was up @UPTIME_S@ s before and\n"
        "unavailable @UNAVAILABLE_S@ s. @SUMMARY@"),
    "server_probe": (
        "llama-server liveness round",
        "One liveness round against llama-server pid @SERVER_PID@ (debug level): /health, the 1-token\n"
        "canary completion, whether a slot is busy and whether the decode counters moved. A canary that\n"
        "times out while a busy slot advances is a long request, not a hang; failed rounds in a row\n"
        "(hang_strikes) lead to server_hang."),
    "server_line": (
        "llama-server output line",
        "A line llama-server wrote (pid @SERVER_PID@). Its whole output:\n"
        "`journalctl -u llama-guard LLAMA_SERVER_LINE=1`."),
}

_SEVERITY_WORD = {
    Severity.CRITICAL: "critical", Severity.ERROR: "error", Severity.WARNING: "warning",
    Severity.NOTICE: "notice", Severity.INFO: "info", Severity.DEBUG: "debug",
}


def render_catalog() -> str:
    """The catalog text for every event in ``CATALOG``, in catalogue order."""
    parts = [
        "#  Message catalog of llama-guard health events.",
        "#  GENERATED by scripts/gen_catalog.py from llama_guard.vocab.events.CATALOG - do not edit.",
        "#  Install into /usr/lib/systemd/catalog/ and run `journalctl --update-catalog`.",
        "",
    ]
    for name, spec in CATALOG.items():
        subject, body = TEXT.get(name, (
            name.replace("_", " "),
            f"llama-guard event {name}: {spec.template}"))
        parts += [
            f"-- {spec.message_id}",
            f"Subject: {subject}",
            "Defined-By: llama-guard",
            "Documentation: file:///opt/llama-guard/share/doc/llama-guard/systemd.md",
            "",
            body,
            "",
            f"Event: {name} (LLAMA_GUARD_EVENT={name}, {_SEVERITY_WORD[spec.severity]}, "
            f"PRIORITY={int(spec.severity)}).",
            f"All of them: journalctl -u llama-guard LLAMA_GUARD_EVENT={name}",
            "",
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when the shipped catalog is stale")
    mode.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = parser.parse_args(argv)
    text = render_catalog()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python scripts/gen_catalog.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT} ({len(CATALOG)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
