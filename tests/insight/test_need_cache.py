"""The VRAM need estimate is learned off the spawn path: once per (model file, settings), kept on disk
under the runtime dir, awaited by the admission only when another process holds VRAM; and the GGUF
header read behind it steps over the tokenizer arrays yet reads the same facts as the gguf package."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from fake_nvml import FakeNvml
from gguf_synth import write_gguf
from llama_guard.config import Config
from llama_guard.gpu import DeviceSelector, Nvml
from llama_guard.gpu.reset import ResetExecutor
from llama_guard.gpu.watcher import GpuSource
from llama_guard.insight import model_facts
from llama_guard.insight.budget import Settings
from llama_guard.insight.need_cache import MAX_ENTRIES, NEED_FILE, NeedCache, need_key
from llama_guard.model.watcher import Context
from llama_guard.preflight.vram_check import estimated_need_mib, need_mib_in_child


class Estimates:
    """A stand-in estimate (the child process) that counts its calls and can be held or fail."""

    def __init__(self, mib: int = 700, error: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.mib, self.error = mib, error
        self.release = threading.Event()
        self.release.set()

    def __call__(self, model: str, settings: Settings) -> int | None:
        self.calls.append(model)
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        return self.mib


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "m.gguf")


def test_learned_once_per_file_and_settings_and_kept_on_disk(tmp_path: Path, model: Path) -> None:
    est = Estimates()
    cache = NeedCache(est)
    cache.open(tmp_path)
    settings = Settings(ctx_size=4096)
    assert cache.learn(str(model), settings) == 700
    assert cache.learn(str(model), settings) == 700 and len(est.calls) == 1
    assert cache.learn(str(model), Settings(ctx_size=8192)) == 700 and len(est.calls) == 2  # other settings
    again = NeedCache(Estimates(mib=1))  # the daemon restarted: the file answers
    again.open(tmp_path)
    assert again.known(need_key(str(model), settings)) == (True, 700)
    os.utime(model, ns=(1, 1))  # the file was replaced: a new key
    assert again.known(need_key(str(model), settings)) == (False, None)
    assert again.learn(str(model), settings) == 1


def test_a_bad_cache_file_is_an_empty_cache_and_the_newest_entries_are_kept(tmp_path: Path, model: Path) -> None:
    (tmp_path / NEED_FILE).write_text("{not json")
    est = Estimates()
    cache = NeedCache(est)
    cache.open(tmp_path)
    for ctx in range(MAX_ENTRIES + 2):
        cache.learn(str(model), Settings(ctx_size=256 * (ctx + 1)))
    saved = json.loads((tmp_path / NEED_FILE).read_text())["needs"]
    assert len(saved) == MAX_ENTRIES
    assert need_key(str(model), Settings(ctx_size=256)) not in saved  # the oldest went first
    assert cache.known(need_key(str(tmp_path / "missing.gguf"), Settings())) == (False, None)


def test_the_child_estimate_matches_the_in_process_one(real_model: Path) -> None:
    config = Config.model_validate({"server": {"model": str(real_model), "n_gpu_layers": 99, "ctx_size": 4096}})
    settings = Settings.from_server(config.server)
    assert need_mib_in_child(str(real_model), settings) == estimated_need_mib(config)
    assert need_mib_in_child(str(real_model), Settings(n_gpu_layers=0)) is None


def test_the_header_read_gives_the_packages_fields_without_the_string_arrays(real_model: Path) -> None:
    fast = model_facts._header_reader(real_model)
    plain = gguf.GGUFReader(real_model, "r")
    assert fast.fields.keys() == plain.fields.keys()
    for key, field in plain.fields.items():
        if field.types[:1] == [gguf.GGUFValueType.ARRAY] and field.types[-1] == gguf.GGUFValueType.STRING:
            assert int(fast.fields[key].parts[-1][0]) == len(field.data), key  # only the length is kept
        else:
            assert fast.fields[key].contents() == field.contents(), key
    assert [(t.name, int(t.n_bytes)) for t in fast.tensors] == [(t.name, int(t.n_bytes)) for t in plain.tensors]
    assert model_facts.read_model_facts(real_model).n_vocab == len(plain.fields["tokenizer.ggml.tokens"].data)


# ------------------------------------------------------------------ the GPU watcher's use of it


@pytest.fixture
def foreign_pid() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "30"])
    yield proc.pid
    proc.kill()
    proc.wait()


def watched(fake: FakeNvml, tmp: Path, model: Path, est: Estimates) -> tuple[GpuSource, Context]:
    cfg = Config.model_validate({"server": {"model": str(model), "n_gpu_layers": 99},
                                 "runtime": {"dir": str(tmp / "run")}})
    (tmp / "run").mkdir(exist_ok=True)
    src = GpuSource(need_cache=NeedCache(est))
    src.nvml = Nvml(DeviceSelector(), module=fake)
    src.identity = src.nvml.open()
    src.executor = ResetExecutor(src.nvml, halt_xid=src._halt_xid, resume_xid=src._resume_xid)
    ctx = Context(get_config=lambda: cfg,
                  emit=lambda name, **f: None, post=lambda e: None, post_threadsafe=lambda e: None,
                  clock=lambda: 0.0, loop=asyncio.get_running_loop())
    return src, ctx


async def test_a_start_does_not_wait_for_the_estimate_when_no_other_process_holds_vram(
        tmp_path: Path, model: Path) -> None:
    est = Estimates()
    est.release.clear()  # the GGUF read is still running
    src, ctx = watched(FakeNvml(), tmp_path, model, est)
    learning = src.need.learn(ctx.config)  # what start() does once the GPU is watched
    facts = await asyncio.wait_for(src.vram_facts(ctx), 2.0)  # the estimate is held for 10 s: no wait for it
    assert facts is not None and facts.need_mib is None and facts.free_mib is not None and not facts.holders
    est.release.set()
    assert learning is not None and await learning == 700
    facts = await src.vram_facts(ctx)
    assert facts is not None and facts.need_mib == 700
    src.on_spawn(ctx, 4242)  # later starts: the learned need, no second read
    assert (await src.vram_facts(ctx)).need_mib == 700  # type: ignore[union-attr]
    assert len(est.calls) == 1
    assert json.loads((tmp_path / "run" / NEED_FILE).read_text())["needs"]  # kept for the next daemon


async def test_with_a_foreign_process_the_polls_share_one_estimate(tmp_path: Path, model: Path,
                                                                   foreign_pid: int) -> None:
    fake = FakeNvml()
    fake.gpus[0].values["processes"] = [(foreign_pid, 1 << 30)]
    est = Estimates()
    est.release.clear()  # the estimate is held until the cut-short poll is over: no race with the host's speed
    src, ctx = watched(fake, tmp_path, model, est)
    polls = [asyncio.ensure_future(src.vram_facts(ctx)) for _ in range(3)]
    with pytest.raises(asyncio.TimeoutError):  # a poll cut short by the daemon's deadline ...
        await asyncio.wait_for(src.vram_facts(ctx), 0.05)
    est.release.set()
    answers = await asyncio.gather(*polls)  # ... does not lose the estimate
    assert [a.need_mib for a in answers] == [700] * 3 and answers[0].holders
    assert len(est.calls) == 1


async def test_a_failing_estimate_is_raised_once_then_unknown(tmp_path: Path, model: Path, foreign_pid: int) -> None:
    fake = FakeNvml()
    fake.gpus[0].values["processes"] = [(foreign_pid, 1 << 30)]
    est = Estimates(error=ValueError("odd GGUF"))
    src, ctx = watched(fake, tmp_path, model, est)
    with pytest.raises(ValueError, match="odd GGUF"):
        await src.vram_facts(ctx)
    facts = await src.vram_facts(ctx)
    assert facts is not None and facts.need_mib is None and facts.error == ""
    assert len(est.calls) == 1


async def test_a_reload_learns_the_new_models_need(tmp_path: Path, model: Path) -> None:
    est = Estimates()
    src, ctx = watched(FakeNvml(), tmp_path, model, est)
    other = write_gguf(tmp_path / "other.gguf", n_layer=2)
    new = ctx.config.model_copy(update={"server": ctx.config.server.model_copy(update={"model": str(other)})})
    src.on_reload(ctx, ctx.config, new)
    assert src.need.learning is not None
    await src.need.learning
    assert est.calls == [str(other)]
