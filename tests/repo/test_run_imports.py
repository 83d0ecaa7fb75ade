"""What ``llama-guard run`` loads: only the modules of the features it runs.

Every module a process imports stays in its memory (and its import in the start-up before the server is
spawned): ``check``/``bench``'s GGUF reader (gguf, numpy), the schedule's cron library (APScheduler,
tzlocal) when no schedule is set, a second HTTP client (httpx) are not loaded by the daemon. A feature's
library is imported when the feature starts (at the daemon's start when it is on), so a missing one still
fails at once, never later.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, DaemonRun, base_sections, free_port, merge

pytestmark = pytest.mark.usefixtures("clean_env")

# Packages the daemon with no schedule must not load; what it must load (the log was read at all).
NOT_LOADED = ("numpy", "gguf", "apscheduler", "tzlocal", "httpx")
LOADED = ("aiohttp", "uvloop", "pydantic", "llama_guard.core.daemon", "llama_guard.front.app")
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)")


def imported(log: Path) -> set[str]:
    """The modules ``python -X importtime`` reported in ``log`` (every import of that process)."""
    return {m.group(1) for m in map(IMPORT_LINE.match, log.read_text(errors="replace").splitlines()) if m}


def test_run_without_a_schedule_loads_no_check_bench_or_schedule_library(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """A real daemon, front door on, no schedule, serving a real llama-server: from its start to its
    stop it never imports numpy, gguf, APScheduler, tzlocal or httpx. ``-X importtime`` is the daemon's
    own flag (a Python child it starts does not inherit it), so the log lists the daemon's imports only."""
    secs = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()),
                 {"front": {"listen": f"127.0.0.1:{free_port()}"}})
    run = DaemonRun(tmp_path, secs, command=[sys.executable, "-X", "importtime", "-m", "llama_guard"])
    run.start()
    try:
        run.wait_event("server_ready", 120)
    finally:
        run.stop()
    modules = imported(run.log_path)
    assert all(m in modules for m in LOADED), sorted(modules)
    assert sorted(m for m in modules if m.split(".")[0] in NOT_LOADED) == []


def test_a_schedule_loads_its_cron_library_with_the_configuration(tmp_path: Path) -> None:
    """With ``restart_cron`` set, APScheduler is imported when the configuration is validated (at the
    daemon's start: a missing library fails there); with it empty, loading the configuration and
    everything ``run`` builds from it imports neither APScheduler nor tzlocal."""
    code = ("import sys\nfrom pathlib import Path\nfrom llama_guard.config import load_config\n"
            "import llama_guard.app.wiring, llama_guard.app.cli\n"
            "load_config(Path(sys.argv[1]))\nprint(sorted(m for m in ('apscheduler', 'tzlocal') if m in sys.modules))")
    seen = {}
    for cron in ("", "30 4 * * *"):
        config = tmp_path / f"cron{len(cron)}.toml"
        config.write_text(f'[schedule]\nrestart_cron = "{cron}"\n')
        out = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True,
                             timeout=60, cwd=str(ROOT))
        assert out.returncode == 0, out.stderr
        seen[cron] = out.stdout.strip().splitlines()[-1]
    assert seen == {"": "[]", "30 4 * * *": "['apscheduler', 'tzlocal']"}


def test_run_imports_aiohttp_without_reading_the_ca_bundle(tmp_path: Path) -> None:
    """``llama-guard run`` imports its modules (aiohttp among them, which builds a verifying TLS context
    at import) without reading the system's CA bundle file, and leaves ``SSL_CERT_FILE`` as it found it:
    a TLS context made afterwards (a child's, a verb's) loads the bundle as usual. The run stops at its
    configuration error (exit 78), after the imports."""
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nport = -1\n")
    # aiohttp's own verifying context (aiohttp/connector.py); a plain default context made after the run.
    code = ("import ssl, sys\nfrom llama_guard.app.cli import main\ntry:\n    main(['run', '--config', sys.argv[1]])\n"
            "except SystemExit as exc:\n    print('exit', exc.code)\nimport aiohttp.connector as c\n"
            "print(c._SSL_CONTEXT_VERIFIED.cert_store_stats()['x509_ca'], "
            "ssl.create_default_context().cert_store_stats()['x509_ca'])")
    out = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=60,
                         cwd=str(ROOT))
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "exit 78", (out.stdout, out.stderr)
    aiohttp_cas, later_cas = map(int, lines[1].split())
    assert aiohttp_cas == 0
    assert later_cas > 0  # the host has a CA bundle, and it is read again once the run's imports are done
