"""Preflight of a llama-server build (llama_guard.upgrade): the release read from ``--version``, a
build that cannot start (a signal, a missing shared library, no answer) and a build whose ``--help``
lacks a flag llama-guard passes are refused with the cause; the real build passes. The doubles are
small scripts in front of the real llama-server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from harness import ROOT, base_sections, config_text, free_port
from llama_guard.config import Config, load_config
from llama_guard.config.argv import build_argv, flags_in
from llama_guard.host.build import release_of, run_bounded
from llama_guard.preflight.server import check_offload
from llama_guard.upgrade.preflight import preflight, unknown_flags
from llama_guard.vocab.verdicts import Verdict


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def without_flag(tmp_path: Path, real: Path, flag: str, name: str = "llama-server-new") -> Path:
    """A build without ``flag`` (as after llama.cpp removed it): its ``--help`` is the real one without
    it, and a start that passes it fails as llama-server does."""
    return script(tmp_path, name,
                  f'case "$*" in *--help*) "{real}" "$@" 2>&1 | grep -v -- "{flag}"; exit 0;; esac\n'
                  f'case "$*" in *"{flag} "*) echo "error: invalid argument: {flag}" >&2; exit 1;; esac\n'
                  f'exec "{real}" "$@"\n')


@pytest.mark.parametrize(("text", "release"), [
    ("version: 4242 (abc1234)\nbuilt with GNU 12.2.0 for Linux x86_64", "b4242 (abc1234)"),
    ("version: 1.0.0 (0123abcd)\nbuilt with cc", "v1.0.0 (0123abcd)"),
    ("llama-server version: v1.2.3-rc.1 (deadbeef01)", "v1.2.3-rc.1 (deadbeef01)"),
    ("version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0", "v0.6.0-dev"),
    ("version: 7112 (build 7112, commit 0123abc)", "b7112 (0123abc)"),
    ("some fork 7", "some fork 7"),
    ("", "unknown"),
])
def test_the_release_is_read_from_semver_or_the_build_number(text: str, release: str) -> None:
    assert release_of(text) == release


def test_flags_are_matched_as_whole_words() -> None:
    listing = "-m, --model FNAME\n--mlock-all\n-ngl, --gpu-layers, --n-gpu-layers N\n"
    argv = ["llama-server", "--model", "m.gguf", "--mlock", "--n-gpu-layers", "-1", "--defrag-thold", "0.1"]
    assert unknown_flags(argv, listing) == ("--defrag-thold", "--mlock")


def test_a_run_is_bounded_in_time_and_output(tmp_path: Path) -> None:
    endless = script(tmp_path, "endless", "yes llama\n")
    ran = run_bounded([str(endless)], 1.0, max_bytes=4096)
    assert ran.returncode is None  # killed at the deadline, with its process group
    assert len(ran.text) == 4096
    assert "did not finish within 1 s" in ran.failure("endless", 1.0)


def test_a_run_ends_when_the_build_exits_though_a_process_it_left_holds_its_output(tmp_path: Path) -> None:
    """A wrapper that leaves ``setsid sleep`` behind: the pipe stays open, the build has exited."""
    leaves = script(tmp_path, "leaves", "setsid sleep 30 &\necho 'version: 4242 (abc1234)'\n")
    ran = run_bounded([str(leaves)], 20.0)
    assert ran.returncode == 0 and "version: 4242" in ran.text
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [])[:2] == ["sleep", "30"]:
            proc.kill()


def config_for(tmp_path: Path, binary: Path, model: Path, extra: list[str] | None = None,
               env: dict[str, str] | None = None) -> Config:
    sections = base_sections(tmp_path, str(binary), str(model), free_port())
    if extra:
        sections["server"]["extra_args"] = extra
    if env:
        sections["server"]["env"] = env
    path = tmp_path / "config.toml"
    path.write_text(config_text(sections))
    return load_config(path)


@pytest.mark.real
def test_the_real_build_passes_and_names_its_release(tmp_path: Path, llama_server_bin: Path,
                                                     real_model: Path) -> None:
    result = preflight(config_for(tmp_path, llama_server_bin, real_model), llama_server_bin)
    assert result.passed, result.cause
    assert result.build is not None and result.build.release.startswith(("b", "v")), result.build
    assert "version" in result.build.version


@pytest.mark.real
@pytest.mark.parametrize("flag", ["--metrics", "--cache-type-k"])
def test_a_build_whose_help_lacks_a_flag_is_refused_naming_it(tmp_path: Path, llama_server_bin: Path,
                                                              real_model: Path, flag: str) -> None:
    new = without_flag(tmp_path, llama_server_bin, flag)
    result = preflight(config_for(tmp_path, new, real_model), new)
    assert not result.passed
    assert result.unknown_flags == (flag,)
    assert f"does not know {flag}" in result.cause and result.build is not None
    assert result.build.release in result.cause


@pytest.mark.real
def test_a_flag_of_extra_args_the_build_never_had_is_refused(tmp_path: Path, llama_server_bin: Path,
                                                             real_model: Path) -> None:
    result = preflight(config_for(tmp_path, llama_server_bin, real_model, ["--no-such-flag-xyz", "1"]),
                       llama_server_bin)
    assert result.unknown_flags == ("--no-such-flag-xyz",)


@pytest.mark.real
@pytest.mark.parametrize(("body", "cause"), [
    ('case "$*" in *--version*) kill -SEGV $$;; esac\nexec "{real}" "$@"\n', "--version died by SIGSEGV"),
    ('case "$*" in *--help*) kill -ILL $$;; esac\nexec "{real}" "$@"\n', "--help died by SIGILL"),
    ('echo "llama-server: error while loading shared libraries: libllama.so: cannot open shared object file" >&2\n'
     "exit 127\n", "--version exited with status 127: "),
    ('case "$*" in *--version*) sleep 600;; esac\nexec "{real}" "$@"\n', "--version did not finish within 1 s"),
])
def test_a_build_that_cannot_start_is_refused_with_the_cause(tmp_path: Path, llama_server_bin: Path,
                                                            real_model: Path, body: str, cause: str) -> None:
    new = script(tmp_path, "llama-server-new", body.format(real=llama_server_bin))
    result = preflight(config_for(tmp_path, new, real_model), new, version_timeout_s=1.0)
    assert not result.passed
    assert f"{new} {cause}" in result.cause, result.cause


@pytest.mark.real
def test_check_names_every_unknown_flag_and_the_build(tmp_path: Path, llama_server_bin: Path,
                                                      real_model: Path) -> None:
    """``check`` on a config whose build lacks ``--metrics`` and whose extra_args pass a flag no
    build has: the flags line names both, the binary line the build's release."""
    new = without_flag(tmp_path, llama_server_bin, "--metrics")
    sections = base_sections(tmp_path, str(new), str(real_model), free_port())
    sections["server"]["extra_args"] = ["--defrag-thold-xyz", "0.1"]
    path = tmp_path / "config.toml"
    path.write_text(config_text(sections))
    out = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    lines = {x.split()[1]: x for x in out.stdout.splitlines() if len(x.split()) > 1}
    assert lines["flags"].split()[0] == "FAIL", out.stdout
    assert "does not know: --defrag-thold-xyz --metrics" in lines["flags"], out.stdout
    assert lines["binary"].split()[0] == "OK", out.stdout
    assert " build b" in lines["binary"] or " build v" in lines["binary"], out.stdout
    assert out.returncode == 78


@pytest.mark.real
def test_the_build_runs_with_the_environment_llama_server_gets(tmp_path: Path, llama_server_bin: Path,
                                                               real_model: Path) -> None:
    """A build that finds its libraries only through ``[server].env`` (LD_LIBRARY_PATH there) passes."""
    new = script(tmp_path, "llama-server-env", '[ "$BUILD_LIBS" = here ] || { echo "llama-server: error while '
                 'loading shared libraries: libggml.so" >&2; exit 127; }\n' f'exec "{llama_server_bin}" "$@"\n')
    assert not preflight(config_for(tmp_path, new, real_model), new).passed
    result = preflight(config_for(tmp_path, new, real_model, env={"BUILD_LIBS": "here"}), new)
    assert result.passed, result.cause


@pytest.mark.real
def test_a_build_the_server_user_cannot_execute_is_refused_as_that_user(tmp_path: Path, llama_server_bin: Path,
                                                                       real_model: Path) -> None:
    """Root may execute what ``[server].user`` may not (here: a build in a directory of mode 0700 owned by
    root, as after a ``make install`` into root's home): refused at the preflight, naming the cause, not
    found at the start. The real build, which that user can run, passes as that user."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    new = script(private, "llama-server-new", f'exec "{llama_server_bin}" "$@"\n')
    config = config_for(tmp_path, new, real_model)
    as_nobody = config.model_copy(update={"server": config.server.model_copy(update={"user": "nobody"})})
    assert preflight(config, new).passed  # as root
    refused = preflight(as_nobody, new)
    assert not refused.passed and refused.build is None
    assert f"{new} --version exited with status" in refused.cause and "Permission denied" in refused.cause, \
        refused.cause
    served = preflight(as_nobody.model_copy(update={"server": as_nobody.server.model_copy(
        update={"binary": str(llama_server_bin)})}), llama_server_bin)
    assert served.passed, served.cause


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user reaches (pytest's tmp_path is 0700, root's)."""
    path = Path(tempfile.mkdtemp(prefix="llama-guard-build-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_neither_the_preflight_nor_check_runs_the_build_as_root(shared_dir: Path) -> None:
    """Every run of the build that a preflight or ``check`` makes — ``--version``, ``--help``, the
    ``--help`` probe that picks how ``--mlock`` is spelt, ``--list-devices`` — is as ``[server].user``:
    the probe and ``--list-devices`` ran as root, so a build that account can replace got root's
    privileges (and the probe judged a build root could run)."""
    log = shared_dir / "runs.log"
    log.touch()
    log.chmod(0o666)
    model = shared_dir / "model.gguf"
    config = config_for(shared_dir, Path("/nonexistent/llama-server"), model)
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"user": "nobody", "mlock": True, "n_gpu_layers": 99})})
    flags = " ".join(dict.fromkeys(flags_in(build_argv(config.server, None, config.slots, config.runtime))))
    exe = script(shared_dir, "llama-server", f'echo "$(id -u) $1" >> "{log}"\n'
                 'case "$1" in --version) echo "version: 1 (abc1234)";;\n'
                 f'--help) for f in {flags}; do echo "$f"; done;;\n'
                 '--list-devices) printf "Available devices:\\n  CUDA0: a GPU\\n";; esac\n')
    config = config.model_copy(update={"server": config.server.model_copy(update={"binary": str(exe)})})
    result = preflight(config, exe)
    assert result.passed, result.cause
    assert check_offload(config)[0].verdict is Verdict.OK
    runs = log.read_text().splitlines()
    assert sorted(set(runs)) == ["65534 --help", "65534 --list-devices", "65534 --version"], runs


def test_checks_device_lines_are_cleaned(shared_dir: Path) -> None:
    """What ``--list-devices`` prints is named in ``check``'s offload line, on the operator's terminal:
    cleaned as a build's ``--version`` is (an OSC would retitle the terminal)."""
    model = shared_dir / "model.gguf"
    exe = script(shared_dir, "llama-server",
                 'printf "Available devices:\\n  CUDA0: a GPU\\033]0;owned\\007\\033[31m red\\033[0m\\n"\n')
    config = config_for(shared_dir, exe, model)
    config = config.model_copy(update={"server": config.server.model_copy(update={"n_gpu_layers": 99})})
    [line] = check_offload(config)
    assert line.verdict is Verdict.OK and line.detail == "n_gpu_layers = 99 on CUDA0: a GPU red", line


def check_lines(path: Path) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """``check --config path``: its lines by name, and the run."""
    out = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    return {x.split()[1]: x for x in out.stdout.splitlines() if len(x.split()) > 1}, out


@pytest.mark.real
def test_check_names_the_real_builds_version_and_finds_every_flag(tmp_path: Path, llama_server_bin: Path,
                                                                 real_model: Path) -> None:
    sections = base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port())
    path = tmp_path / "config.toml"
    path.write_text(config_text(sections))
    lines, out = check_lines(path)
    version = release_of(subprocess.run([str(llama_server_bin), "--version"], capture_output=True, text=True,
                                        timeout=30).stderr)
    assert lines["binary"].split()[0] == "OK" and f"build {version} (" in lines["binary"], out.stdout
    assert lines["flags"].split()[0] == "OK", out.stdout


@pytest.mark.real
def test_check_runs_the_build_as_the_server_user_and_says_when_it_cannot_switch(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """``check`` runs the build as ``[server].user`` (a build that account cannot execute fails its binary
    row, naming the cause); an account llama-guard cannot switch to fails the "server user" row, and the
    build and its flags are still read, as llama-guard's own user."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    hidden = script(private, "llama-server", f'exec "{llama_server_bin}" "$@"\n')
    for binary, user, row in ((hidden, "nobody", "FAIL"), (llama_server_bin, "nobody", "OK"),
                              (llama_server_bin, "no-such-account-xyz", "OK")):
        sections = base_sections(tmp_path, str(binary), str(real_model), free_port())
        sections["server"]["user"] = user
        path = tmp_path / "config.toml"
        path.write_text(config_text(sections))
        lines, out = check_lines(path)
        assert lines["binary"].split()[0] == row, out.stdout
        if row == "FAIL":
            assert "Permission denied" in lines["binary"], out.stdout
        if user == "no-such-account-xyz":
            account = next(line for line in out.stdout.splitlines() if " server user " in line)
            assert account.split()[0] == "FAIL" and "no-such-account-xyz" in account, out.stdout
            assert lines["flags"].split()[0] == "OK", out.stdout


@pytest.mark.real
def test_check_runs_help_with_the_environment_llama_server_gets(tmp_path: Path, llama_server_bin: Path,
                                                                real_model: Path) -> None:
    """A build that finds its libraries only through ``[server].env``: ``check`` reads its ``--help`` as
    the upgrade preflight does (before, ``--version`` ran with ``[server].env`` and ``--help`` without:
    every flag was reported unknown)."""
    new = script(tmp_path, "llama-server-env", '[ "$BUILD_LIBS" = here ] || { echo "llama-server: error while '
                 'loading shared libraries: libggml.so" >&2; exit 127; }\n' f'exec "{llama_server_bin}" "$@"\n')
    sections = base_sections(tmp_path, str(new), str(real_model), free_port())
    sections["server"]["env"] = {"BUILD_LIBS": "here"}
    path = tmp_path / "config.toml"
    path.write_text(config_text(sections))
    lines, out = check_lines(path)
    assert lines["binary"].split()[0] == "OK", out.stdout
    assert lines["flags"].split()[0] == "OK", out.stdout
