"""The ports the daemon is handed by name (the GPU, the child set-up, the KV slots, the front door,
the exporter): the wiring hands each one, every one a watcher too; a start asks them in its order
(child set-up, GPU, KV slots) and the first refusal ends it, the later ports not asked. Against
the real llama-server binary and model (the spawner checks both before it asks the ports)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from llama_guard.config import Config
from llama_guard.core.offload import daemon_lanes
from llama_guard.core.ports import RlimitSettings
from llama_guard.core.spawner import Spawner
from llama_guard.model.inputs import SpawnFailed
from llama_guard.model.watcher import Context, Watcher
from llama_guard.output.eventlog import Emitter

pytestmark = pytest.mark.usefixtures("clean_env")


class Asked:
    """What each port was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class Child:
    def __init__(self, asked: Asked, refusal: str | None) -> None:
        self.asked, self.refusal = asked, refusal

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        self.asked.calls.append(f"child.before_spawn({previous_pid})")
        return self.refusal

    def child_rlimits(self) -> RlimitSettings:
        self.asked.calls.append("child.child_rlimits")
        return ()


class Gpu:
    def __init__(self, asked: Asked, refusal: str | None) -> None:
        self.asked, self.refusal = asked, refusal

    async def before_spawn(self, ctx: Context, previous_pid: int | None) -> str | None:
        self.asked.calls.append(f"gpu.before_spawn({previous_pid})")
        return self.refusal


class Slots:
    def __init__(self, asked: Asked) -> None:
        self.asked = asked

    async def before_spawn(self, ctx: Context, binary: Path, env: Mapping[str, str]) -> None:
        self.asked.calls.append("slots.before_spawn")


def _config(tmp_path: Path, binary: Path, model: Path) -> Config:
    return Config.model_validate({"server": {"binary": str(binary), "model": str(model), "n_gpu_layers": 0},
                                  "gpu": {"enabled": "off"}, "runtime": {"dir": str(tmp_path)}})


def _start(config: Config, child: Child, gpu: Gpu, slots: Slots) -> SpawnFailed | object:
    async def go() -> SpawnFailed | object:
        ctx = Context(get_config=lambda: config,
                      emit=lambda *_, **__: None, post=lambda _: None, post_threadsafe=lambda _: None,
                      clock=time.monotonic, loop=asyncio.get_running_loop())
        spawner = Spawner(lambda *_, **__: None, daemon_lanes(), time.monotonic,
                          child=child, gpu=gpu, slots=slots)  # type: ignore[arg-type]
        return await spawner.start(config, ctx)

    return asyncio.run(go())


@pytest.mark.parametrize("refusing", ["child", "gpu"])
def test_a_start_asks_the_ports_in_order_and_the_first_refusal_ends_it(
        tmp_path: Path, llama_server_bin: Path, real_model: Path, refusing: str) -> None:
    asked = Asked()
    child = Child(asked, "the child's limits cannot be planned" if refusing == "child" else None)
    gpu = Gpu(asked, "the GPU does not answer NVML" if refusing == "gpu" else None)
    outcome = _start(_config(tmp_path, llama_server_bin, real_model), child, gpu, Slots(asked))
    refusal = child.refusal or gpu.refusal
    assert outcome == SpawnFailed(str(refusal), fatal=False)
    expected = ["child.before_spawn(None)", "gpu.before_spawn(None)"]
    assert asked.calls == (expected[:1] if refusing == "child" else expected)


def test_a_starts_help_probe_runs_the_build_as_the_server_user(tmp_path: Path) -> None:
    """The ``--help`` probe before every start (how this build spells ``--mlock``) runs the build as
    ``[server].user``, as llama-server itself then runs: it ran as root, so a build that account can
    replace got root's privileges at every start."""
    import shutil
    import tempfile

    from llama_guard.core.privileges import resolve_identity

    shared = Path(tempfile.mkdtemp(prefix="llama-guard-build-"))  # pytest's tmp_path is 0700, root's
    try:
        shared.chmod(0o755)
        log = shared / "runs.log"
        log.touch()
        log.chmod(0o666)
        binary = shared / "llama-server"
        binary.write_text(f'#!/bin/sh\necho "$(id -u) $1" >> "{log}"\necho "--mlock"\n')
        binary.chmod(0o755)
        model = tmp_path / "model.gguf"
        model.write_bytes(b"GGUF" + bytes(64))
        config = _config(tmp_path, binary, model)
        config = config.model_copy(update={"server": config.server.model_copy(update={"mlock": True})})
        asked = Asked()

        async def go() -> SpawnFailed | object:
            ctx = Context(get_config=lambda: config,
                          emit=lambda *_, **__: None, post=lambda _: None, post_threadsafe=lambda _: None,
                          clock=time.monotonic, loop=asyncio.get_running_loop())
            spawner = Spawner(lambda *_, **__: None, daemon_lanes(), time.monotonic,
                              child=Child(asked, "refused after the probe"))  # type: ignore[arg-type]
            spawner.identity = resolve_identity("nobody", "", ())
            return await spawner.start(config, ctx)

        assert asyncio.run(go()) == SpawnFailed("refused after the probe", fatal=False)
        assert log.read_text().splitlines() == ["65534 --help"]
    finally:
        shutil.rmtree(shared)


def test_the_wiring_hands_each_port_by_name_and_each_is_a_watcher(tmp_path: Path) -> None:
    from llama_guard.app.wiring import make_watchers
    from llama_guard.exporter.metrics import MetricsSource
    from llama_guard.front.source import FrontSource
    from llama_guard.gpu.watcher import GpuSource
    from llama_guard.limits.watcher import LimitsSource
    from llama_guard.slots.watcher import SlotsSource

    cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "gpu": {"enabled": "off"}})
    made = make_watchers(cfg, emitter=Emitter(min_level="error", fmt="json"))
    ports = (made.gpu, made.child, made.slots, made.front, made.exporter)
    kinds = (GpuSource, LimitsSource, SlotsSource, FrontSource, MetricsSource)
    assert [type(p) for p in ports] == list(kinds)
    assert all(any(p is w for w in made.watchers) for p in ports)


class Fragment:
    """A GPU port that only shows its status fragment (or fails to)."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def status_fragment(self) -> str:
        if self.text is None:
            raise RuntimeError("no reading")
        return self.text


def test_the_status_line_shows_the_gpu_ports_fragment_and_survives_a_failing_port(tmp_path: Path) -> None:
    from llama_guard.core.daemon import Daemon

    cfg = Config.model_validate({"runtime": {"dir": str(tmp_path)}, "gpu": {"enabled": "off"}})

    def line(gpu: Fragment | None) -> str:
        daemon = Daemon(cfg, tmp_path / "lg.toml", Emitter(min_level="critical", fmt="json"),
                        gpu=gpu)  # type: ignore[arg-type]
        return daemon.status.line()

    without = line(None)
    assert line(Fragment("GPU 0 61°C 212 W")) == f"{without}, GPU 0 61°C 212 W"
    assert line(Fragment("")) == without and line(Fragment(None)) == without


class DrainOrder(Watcher):
    """A watcher and a KV slot port that note when a drained server is asked to let go, and its exit."""

    name = "drain-order"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def before_spawn(self, ctx: Context, binary: Path, env: Mapping[str, str]) -> None:
        return None

    async def restore(self, ctx: Context, pid: int) -> None:
        return None

    async def after_drain(self, ctx: Context, pid: int) -> None:
        self.calls.append(f"slots.after_drain({pid})")

    async def before_reset_stop(self, ctx: Context, pid: int) -> None:
        return None

    async def before_drained_stop(self, ctx: Context, pid: int) -> None:
        self.calls.append(f"before_drained_stop({pid})")

    def on_exit(self, ctx: Context, pid: int, returncode: int | None) -> None:
        self.calls.append(f"exit({pid})")


def test_a_drained_server_is_let_go_by_every_watcher_after_its_slots_are_saved_and_before_its_sigterm(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    # llama-server's graceful exit waits for the requests it answers and for idle keep-alive
    # connections: every watcher (the front door's upstream pool, the restart samples) lets go of
    # the drained server before its SIGTERM, after the slot saves.
    from llama_guard.core.daemon import Daemon
    from llama_guard.model.inputs import RestartRequest, StopRequest

    config = _config(tmp_path, llama_server_bin, real_model)
    order = DrainOrder()
    daemon = Daemon(config, tmp_path / "lg.toml", Emitter(min_level="critical", fmt="json"),
                    watchers=[order], slots=order)

    async def go() -> None:
        task = asyncio.ensure_future(daemon.run())
        deadline = time.monotonic() + 60
        while daemon.ctx is None or daemon.state.phase.value != "ready":
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        first = daemon.state.pid
        daemon.queue.put_nowait(RestartRequest("test"))
        while f"exit({first})" not in order.calls:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        daemon.queue.put_nowait(StopRequest("test over"))
        await asyncio.wait_for(task, 30)
        calls = order.calls[:order.calls.index(f"exit({first})") + 1]
        assert calls == [f"slots.after_drain({first})", f"before_drained_stop({first})", f"exit({first})"]

    asyncio.run(go())
