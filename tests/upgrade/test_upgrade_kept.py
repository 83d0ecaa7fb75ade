"""The last good builds kept (llama_guard.upgrade.kept): the executable and the libraries beside it,
read-only, content-hashed, the last two; a copy whose content changed is not used."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.core.privileges import drop_argv, resolve_identity
from llama_guard.host.build import Build, file_sha256
from llama_guard.upgrade.figures import record
from llama_guard.upgrade.kept import KEEP_MAX, builds_dir, keep, listing, verified


def a_build(where: Path, tag: str) -> Build:
    """A build directory: an executable, a library and the usual links to it."""
    where.mkdir(parents=True)
    exe = where / "llama-server"
    exe.write_text(f"#!/bin/sh\necho 'version: {tag}'\n")
    exe.chmod(0o755)
    (where / "libllama.so.0.6.0").write_bytes(f"library of {tag}".encode() * 100)
    (where / "libllama.so.0").symlink_to("libllama.so.0.6.0")
    (where / "libllama.so").symlink_to("libllama.so.0")
    (where / "notes.txt").write_text("not a library")
    return Build(exe, file_sha256(exe), f"version: {tag}", f"b{tag}")


def test_a_kept_build_is_a_read_only_hashed_copy_with_its_libraries(tmp_path: Path) -> None:
    build = a_build(tmp_path / "src", "1")
    kept = keep(build, tmp_path / "builds")
    assert kept.dir.parent == tmp_path / "builds" and kept.dir.name == build.sha256[:16]
    assert sorted(p.name for p in kept.dir.iterdir()) == ["libllama.so", "libllama.so.0", "libllama.so.0.6.0",
                                                         "llama-server", "manifest.json"]
    assert os.readlink(kept.dir / "libllama.so.0") == "libllama.so.0.6.0"
    assert kept.files["libllama.so.0.6.0"] == file_sha256(tmp_path / "src" / "libllama.so.0.6.0")
    assert kept.build.sha256 == build.sha256 and kept.build.path == kept.dir / "llama-server"
    for entry in [kept.dir, *(p for p in kept.dir.iterdir() if not p.is_symlink())]:
        assert not entry.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), entry
    assert verified(kept) == ""
    assert keep(build, tmp_path / "builds").dir == kept.dir  # kept once


def test_only_the_last_two_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "builds"
    dirs = [keep(a_build(tmp_path / f"src{i}", str(i)), root).dir for i in range(3)]
    assert [k.dir for k in listing(root)] == dirs[:0:-1]
    assert len(listing(root)) == KEEP_MAX and not dirs[0].exists()


@pytest.mark.parametrize("victim", ["llama-server", "libllama.so.0.6.0"])
def test_a_copy_whose_content_changed_is_not_used(tmp_path: Path, victim: str) -> None:
    kept = keep(a_build(tmp_path / "src", "1"), tmp_path / "builds")
    target = kept.dir / victim
    kept.dir.chmod(0o755)
    target.chmod(0o644)
    target.write_bytes(target.read_bytes() + b"\0")
    target.chmod(0o444)
    assert verified(kept) == f"{target} no longer has the content that was kept"


def test_a_copy_made_writable_is_not_used(tmp_path: Path) -> None:
    kept = keep(a_build(tmp_path / "src", "1"), tmp_path / "builds")
    (kept.dir / "libllama.so.0.6.0").chmod(0o666)
    assert "is not a read-only regular file" in verified(kept)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A directory as systemd makes ``StateDirectory=`` (mode 0755, root's), outside pytest's own
    (mode 0700: no other user reaches into it)."""
    path = Path(tempfile.mkdtemp(prefix="llama-guard-state-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize("first", ["the copy", "the trial figures"])
def test_a_kept_copy_runs_as_the_server_user_under_the_units_umask(state_dir: Path, first: str) -> None:
    """The unit's ``UMask=0027`` made ``builds/`` mode 0750, root's: ``[server].user`` could not reach
    the copy, and a roll-back to it could not start (an outage). Whichever makes ``builds/`` first
    (a copy, or a trial's figures written beside the copies), the copy runs as that user."""
    build = a_build(state_dir / "src", "1")
    umask = os.umask(0o027)
    try:
        if first == "the trial figures":
            record(state_dir / "builds", {build.sha256: 12.5}, "0" * 16)
        kept = keep(build, state_dir / "builds")
    finally:
        os.umask(umask)
    ran = subprocess.run([*drop_argv(resolve_identity("nobody", "", ())), str(kept.build.path)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert (ran.returncode, ran.stdout) == (0, "version: 1\n"), ran.stderr


def test_the_copies_live_in_the_state_directory(tmp_path: Path) -> None:
    assert builds_dir(tmp_path / "run", {"STATE_DIRECTORY": "/var/lib/llama-guard:/x"}) == \
        Path("/var/lib/llama-guard/builds")
    assert builds_dir(tmp_path / "run", {}) == tmp_path / "run" / "builds"


async def test_a_preflight_that_does_not_return_starts_the_server_unverified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preflight that does not return (a binary on a hung filesystem: its stat or its hash read never
    returns; here the preflight itself waits on an event) is no build fault: the start goes on with the
    configured binary (as before preflights existed)."""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.core.ports import BuildChoice
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade import watcher

    monkeypatch.setattr(watcher, "PREFLIGHT_CALL_S", 0.5)
    release = threading.Event()
    monkeypatch.setattr(watcher, "preflight", lambda *a, **k: release.wait())
    hung = a_build(tmp_path / "hung", "2").path
    cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "server": {"binary": str(hung)}})
    events: list[tuple[str, dict[str, object]]] = []
    ctx = Context(get_config=lambda: cfg, emit=lambda name, **f: events.append((name, f)),
                  post=lambda i: None, post_threadsafe=lambda i: None, clock=lambda: 0.0,
                  loop=asyncio.get_running_loop())
    keep(a_build(tmp_path / "good", "1"), tmp_path / "builds")  # a last good build is at hand: preflights run
    source = watcher.UpgradeSource()
    await source.start(ctx)
    assert await source.before_spawn(ctx, hung) == BuildChoice(hung)
    assert events == [("blocking_call_timeout", {"call": f"preflight of {hung}", "timeout_s": 0.5,
                                                 "effect": "the server is started without it"})]
    release.set()  # the call left on its lane returns



async def test_a_reload_whose_binary_lookup_does_not_return_is_refused_and_the_loop_runs_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload's ``$PATH`` lookup of the new binary (it stats files: a hung filesystem) runs on a lane,
    bounded: the reload is refused, said, and the running configuration stays. Before, it ran on the
    event loop, which a hung stat would have stopped."""
    import asyncio
    import threading

    from llama_guard.config import Config
    from llama_guard.core.ports import ReloadBuild
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade import watcher

    monkeypatch.setattr(watcher, "PREFLIGHT_CALL_S", 0.5)
    release = threading.Event()
    monkeypatch.setattr(watcher, "resolve_binary", lambda *a, **k: release.wait())
    old = Config.model_validate({"runtime": {"dir": str(tmp_path)}})
    new = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "server": {"binary": "llama-server-next"}})
    events: list[tuple[str, dict[str, object]]] = []
    ctx = Context(get_config=lambda: old, emit=lambda name, **f: events.append((name, f)),
                  post=lambda i: None, post_threadsafe=lambda i: None, clock=lambda: 0.0,
                  loop=asyncio.get_running_loop())
    source = watcher.UpgradeSource()
    await source.start(ctx)
    ticks = 0

    async def ticker() -> None:  # the loop runs on while the lookup hangs
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.ensure_future(ticker())
    try:
        assert await source.vet_reload(old, new) is ReloadBuild.REFUSED
    finally:
        beat.cancel()
        release.set()
    assert ticks >= 1
    assert events == [("blocking_call_timeout", {"call": "looking up llama-server-next", "timeout_s": 0.5,
                                                 "effect": "the reload is refused; the running configuration stays"})]
    assert source.refused is not None and "did not finish" in source.refused.cause


async def test_the_binary_pointed_at_the_kept_copy_of_the_serving_build_is_no_upgrade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[server].binary`` pointed at the kept copy of the build that serves: the same build (its
    executable's hash, its libraries checked when kept), so no trial — and it starts with the copy's own
    libraries first, as a roll-back to it does. The same executable copied anywhere else stays a new build
    to try (it may sit beside other libraries)."""
    import asyncio
    import shutil

    from llama_guard.config import Config
    from llama_guard.core.ports import BuildChoice, ReloadBuild
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade import watcher
    from llama_guard.upgrade.preflight import Preflight

    def passes(config: Config, binary: Path) -> Preflight:
        return Preflight(Build(binary, file_sha256(binary), "version: 1", "b1"), "")

    monkeypatch.setattr(watcher, "preflight", passes)
    serving = a_build(tmp_path / "src", "1")
    old = Config.model_validate({"runtime": {"dir": str(tmp_path / "run")}, "server": {"binary": str(serving.path)}})
    source = watcher.UpgradeSource()
    kept = keep(serving, source._root(old))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "src", elsewhere, symlinks=True)
    ctx = Context(get_config=lambda: old, emit=lambda name, **f: None, post=lambda i: None,
                  post_threadsafe=lambda i: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    await source.start(ctx)
    source.lineage.ready(serving, 0.0)
    source.lineage.pass_probation()

    def pointed_at(binary: Path) -> Config:
        return old.model_copy(update={"server": old.server.model_copy(update={"binary": str(binary)})})

    assert await source.vet_reload(old, pointed_at(kept.build.path)) is ReloadBuild.SAME
    assert await source.vet_reload(old, pointed_at(elsewhere / "llama-server")) is ReloadBuild.NEW
    copy = pointed_at(kept.build.path)
    choice = await source.before_spawn(Context(get_config=lambda: copy, emit=lambda name, **f: None,
                                               post=lambda i: None, post_threadsafe=lambda i: None,
                                               clock=lambda: 0.0, loop=asyncio.get_running_loop()),
                                       kept.build.path)
    assert choice == BuildChoice(kept.build.path, kept.dir)


async def test_a_kept_copy_the_server_user_cannot_reach_is_not_rolled_back_to(state_dir: Path) -> None:
    """Outside systemd the copies lie in ``<[runtime].dir>/builds``, and a runtime directory is 0700,
    root's: as ``[server].user`` the copy cannot start. It is refused at the roll-back with
    ``upgrade_copy_failed`` naming the directory, as a copy that fails its hashes is, rather than
    started to fail; with llama-guard's own user it is used."""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade.watcher import UpgradeSource

    runtime = state_dir / "run"
    runtime.mkdir(mode=0o700)
    kept = keep(a_build(state_dir / "good", "1"), runtime / "builds")
    events: list[tuple[str, dict[str, object]]] = []
    for user in ("nobody", ""):
        cfg = Config.model_validate({"runtime": {"dir": str(runtime)}, "server": {"user": user}})
        ctx = Context(get_config=lambda cfg=cfg: cfg, emit=lambda name, **f: events.append((name, f)),
                      post=lambda i: None, post_threadsafe=lambda i: None, clock=lambda: 0.0,
                      loop=asyncio.get_running_loop())
        source = UpgradeSource()
        await source.start(ctx)
        found = await source._last_good(cfg, exclude=None)
        if user:
            assert found is None
            assert events == [("upgrade_copy_failed", {
                "build": kept.build.short, "dir": str(kept.dir),
                "reason": f"{kept.build.path}: {runtime} is not searchable for [server].user (uid 65534)"})]
        else:
            assert found is not None and found[1].binary == kept.build.path


async def test_a_roll_back_after_a_reload_to_another_server_user_starts_a_build_that_user_runs(
        state_dir: Path) -> None:
    """A reload changed ``[server].user`` and the binary, and the new build failed: the serving build's
    file (in a directory of mode 0700, root's) still holds it, but the new user cannot execute it — the
    roll-back starts its kept copy instead; for llama-guard's own user, the serving file itself."""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade.watcher import UpgradeSource

    private = state_dir / "private"
    private.mkdir(mode=0o700)
    serving = a_build(private / "bin", "1")
    kept = keep(serving, state_dir / "builds")
    for user, expected in (("nobody", kept.build.path), ("", serving.path)):
        cfg = Config.model_validate({"runtime": {"dir": str(state_dir)}, "server": {"user": user}})
        ctx = Context(get_config=lambda cfg=cfg: cfg, emit=lambda name, **f: None, post=lambda i: None,
                      post_threadsafe=lambda i: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
        source = UpgradeSource()
        await source.start(ctx)
        source.lineage.ready(serving, 0.0)
        found = await source._last_good(cfg, exclude=None)
        assert found is not None and found[1].binary == expected, user


async def test_a_build_started_unverified_is_identified_as_the_server_user(state_dir: Path) -> None:
    """A first start (nothing kept yet) runs the configured build unverified; once it is ready its
    ``--version`` identifies it — as ``[server].user``, as the preflight runs it, never as root: a build
    that account can replace must not get root's privileges from llama-guard."""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade.watcher import UpgradeSource, _Identify

    exe = state_dir / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\necho \"version: 1 (uid $(id -u))\"\n")
    exe.chmod(0o755)
    cfg = Config.model_validate({"runtime": {"dir": str(state_dir)}, "server": {"user": "nobody"}})
    ctx = Context(get_config=lambda: cfg, emit=lambda name, **f: None, post=lambda i: None,
                  post_threadsafe=lambda i: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    source = UpgradeSource()
    await source.start(ctx)
    source._pids[4242] = exe
    await source._identify(ctx, _Identify(exe, 4242, 0.0))
    assert source.serving is not None and source.serving.version == "version: 1 (uid 65534)"


@pytest.mark.parametrize("layout", ["libraries beside it", "libraries in ../lib"])
async def test_a_copy_that_does_not_start_as_the_server_user_is_not_kept(state_dir: Path, layout: str) -> None:
    """A build that passed its probation is copied, then the copy is run as a roll-back would run it
    (as ``[server].user``, ``LD_LIBRARY_PATH`` on its directory). A build installed with its libraries
    in ``../lib`` (``cmake --install``'s layout: only ``lib*.so*`` beside the executable is copied)
    loads where it was built but not as a copy: that copy is removed with ``upgrade_copy_failed``,
    not left for a roll-back to fail on. (A double loader: the script needs ``libllama.so``.)"""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade.watcher import UpgradeSource

    prefix = state_dir / "opt"
    bin_dir = prefix / "bin"
    lib_dir = bin_dir if layout == "libraries beside it" else prefix / "lib"
    bin_dir.mkdir(parents=True)
    lib_dir.mkdir(exist_ok=True)
    (lib_dir / "libllama.so").write_bytes(b"library")
    exe = bin_dir / "llama-server"
    exe.write_text('#!/bin/sh\n'
                   'for d in "$(dirname "$0")" "$(dirname "$0")/../lib" $(echo "$LD_LIBRARY_PATH" | tr : " "); do\n'
                   '  [ -r "$d/libllama.so" ] && { echo "version: 1 (abc1234)"; exit 0; }\ndone\n'
                   'echo "llama-server: error while loading shared libraries: libllama.so" >&2; exit 127\n')
    exe.chmod(0o755)
    build = Build(exe, file_sha256(exe), "version: 1 (abc1234)", "b1 (abc1234)")
    cfg = Config.model_validate({"runtime": {"dir": str(state_dir)}, "server": {"user": "nobody"}})
    events: list[tuple[str, dict[str, object]]] = []
    reported = asyncio.Event()

    def emit(name: str, **fields: object) -> None:
        events.append((name, fields))
        reported.set()

    ctx = Context(get_config=lambda: cfg, emit=emit, post=lambda i: None, post_threadsafe=lambda i: None,
                  clock=lambda: 0.0, loop=asyncio.get_running_loop())
    source = UpgradeSource()
    await source.start(ctx)
    runs = asyncio.create_task(source.run(ctx))
    try:
        source._jobs.put_nowait(build)  # its probation passed
        await reported.wait()
    finally:
        runs.cancel()
    [(name, fields)] = events
    if layout == "libraries beside it":
        assert name == "upgrade_copy_kept" and len(listing(state_dir / "builds")) == 1, events
    else:
        assert name == "upgrade_copy_failed" and "error while loading shared libraries" in str(fields["reason"])
        assert listing(state_dir / "builds") == [] and source.snapshot()["kept"] == []  # type: ignore[index]


async def test_copies_an_older_llama_guard_left_out_of_reach_are_opened_at_start(state_dir: Path) -> None:
    """A ``builds/`` an older llama-guard made 0750 under the unit's umask holds copies the server user
    cannot run: the daemon's start opens it, so that the first roll-back finds them usable."""
    import asyncio

    from llama_guard.config import Config
    from llama_guard.model.watcher import Context
    from llama_guard.upgrade.watcher import UpgradeSource

    kept = keep(a_build(state_dir / "good", "1"), state_dir / "builds")
    (state_dir / "builds").chmod(0o750)
    cfg = Config.model_validate({"runtime": {"dir": str(state_dir)}, "server": {"user": "nobody"}})
    ctx = Context(get_config=lambda: cfg, emit=lambda name, **f: None, post=lambda i: None,
                  post_threadsafe=lambda i: None, clock=lambda: 0.0, loop=asyncio.get_running_loop())
    source = UpgradeSource()
    await source.start(ctx)
    found = await source._last_good(cfg, exclude=None)
    assert found is not None and found[1].binary == kept.build.path
