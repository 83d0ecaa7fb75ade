"""A llama-server build that the CPU refuses (a native build run where its AMX path faults: SIGILL
at ``tilezero``, SIGSEGV at ``ldtilecfg``, alternating from start to start) is a verdict after at
most three starts: exit 78 naming the illegal instruction and the rebuild, never a crash loop that
ends in 75 for systemd to restart.

The server binary is a wrapper that prints llama-server's first load line and then dies by the
signal of its start (SIGILL, SIGSEGV, SIGILL …): what the faulting native build did on this kind of
host, without depending on which CPU the test runs on (the real build here is the portable one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import RunPool
from llama_guard.vocab.exitcodes import EXIT_CONFIG

pytestmark = [pytest.mark.real, pytest.mark.timeout(120)]

WRAPPER = """#!/bin/sh
case "$*" in *--version*|*--help*) exec "{real}" "$@";; esac  # these do not compute: they pass
n=$(cat "{dir}/starts" 2>/dev/null | wc -l)
echo "$$" >> "{dir}/starts"
echo "load_tensors: loading model tensors, this can take a while... (mmap = true)" >&2
if [ $((n % 2)) -eq 0 ]; then kill -ILL $$; else kill -SEGV $$; fi
exec "{real}" "$@"
"""


def test_a_build_dying_by_sigill_and_sigsegv_is_exit_78_within_three_starts(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    wrapper = tmp_path / "llama-server-native"
    wrapper.write_text(WRAPPER.format(dir=tmp_path, real=llama_server_bin))
    wrapper.chmod(0o755)
    pool = RunPool()
    try:
        run = pool.new(tmp_path, str(wrapper), str(real_model), {"recovery": {"repeat_confirm_s": 1.0}}).start()
        assert run.wait_exit(90) == EXIT_CONFIG
        starts = (tmp_path / "starts").read_text().split()
        assert len(starts) <= 3, starts
        verdict = run.wait_event("server_boot_failure", 1)
        cause = str(verdict["cause"])
        assert cause.startswith("llama-server dies with an illegal instruction"), cause
        assert "built for CPU instructions this machine cannot run" in cause and "GGML_NATIVE=OFF" in cause
        assert "crash_loop" not in run.names()
        assert "version:" in str(verdict["build"])  # the real binary's --version (it does not compute)
        assert [e["signal"] for e in run.events() if e["event"] == "server_exited"] == [4, 11, 4][:len(starts)]
    finally:
        assert not pool.finish()
