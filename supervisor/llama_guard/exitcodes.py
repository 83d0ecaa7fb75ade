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
