"""Exit statuses of ``llama-guard run`` (and of the other verbs), from sysexits.h where one fits.

systemd's unit uses ``RestartPreventExitStatus=78``: a configuration error must not loop.
"""

from __future__ import annotations

EXIT_OK = 0                 # stopped on request
EXIT_FAILURE = 1            # a verb failed (e.g. `check` found a problem, `restart` found no daemon)
EXIT_GPU_UNRECOVERABLE = 69  # EX_UNAVAILABLE: the GPU is lost and a reset cannot help; reboot
EXIT_SOFTWARE = 70          # EX_SOFTWARE: an internal error in llama-guard
EXIT_CRASH_LOOP = 75        # EX_TEMPFAIL: the server failed too often within the window
EXIT_CONFIG = 78            # EX_CONFIG: our configuration, or llama-server refused its flags/model

# `llama-guard check --json`: the exit codes of node-health gates (node-problem-detector's custom
# plugin protocol: 0 OK, 1 NonOK, 2 Unknown), so it can run as such a plugin or a pre-flight job.
# Plain `check` keeps 0 / 78, like `run`'s configuration error.
EXIT_GATE_PASS = 0      # verdict pass or warn: the server can run here
EXIT_GATE_FAIL = 1      # verdict fail: see the recommended action
EXIT_GATE_UNKNOWN = 2   # the check itself could not finish
