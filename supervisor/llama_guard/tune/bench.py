"""``llama-guard bench``: generation speed measured the way operators measure it, against the ceiling.

One warm-up completion (not counted), then ``runs`` completions of ``tokens`` generated tokens each
(``ignore_eos``, ``cache_prompt: false`` so that every run prefills its prompt), at temperature 0 on
``POST /v1/chat/completions``. The figures are the server's own ``timings`` (``predicted_per_second``:
eval tokens/s; ``prompt_per_second``: prefill tokens/s), summarised as median, min, max and
population standard deviation. :func:`spawned_server` starts a server from a configuration (for
``--spawn`` and ``--compare``) and stops it again with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from llama_guard.config import Config
from llama_guard.core.client import BlockingClient, Cancel, RequestFailed
from llama_guard.core.own_requests import CHAT_PATH, OWN_REQUESTS, answer_problem

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
BENCH_FILE = "bench.json"  # the last bench's result under [runtime].dir (exported as metrics)
TIMING_KEYS = ("predicted_n", "predicted_per_second", "prompt_n", "prompt_per_second")


class BenchError(RuntimeError):
    """A request failed, the server did not become ready in time, or a timing was missing."""


@dataclass(frozen=True)
class RunTimings:
    """One completion's ``timings``: token counts and tokens/s as the server measured them."""

    predicted_n: int
    predicted_per_second: float
    prompt_n: int
    prompt_per_second: float


@dataclass(frozen=True)
class Spread:
    """median, min, max and population standard deviation of one figure (tokens/s)."""

    median: float
    min: float
    max: float
    stdev: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values), statistics.pstdev(values))


class RunFigures:
    """What a record of runs (``runs``, at least one) says: :attr:`eval` and :attr:`prompt` tokens/s,
    each a :class:`Spread` (the bench's result and each of tune's candidates)."""

    runs: list[RunTimings]

    @property
    def eval(self) -> Spread:
        """Eval (decode) tokens/s of the runs."""
        return Spread.of([r.predicted_per_second for r in self.runs])

    @property
    def prompt(self) -> Spread:
        """Prompt (prefill) tokens/s of the runs."""
        return Spread.of([r.prompt_per_second for r in self.runs])


@dataclass
class BenchResult(RunFigures):
    """The runs and their summary; ``context`` is the median tokens in the context at the end of a run
    (prompt + generated), the context the ceiling's KV cache read is counted at."""

    url: str
    runs: list[RunTimings]
    tokens: int
    label: str = ""
    ceiling: dict[str, Any] | None = None
    finished: float = field(default_factory=time.time)

    @property
    def context(self) -> int:
        return int(statistics.median(r.prompt_n + r.predicted_n for r in self.runs))

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "url": self.url, "runs": [asdict(r) for r in self.runs],
                "tokens": self.tokens, "n": len(self.runs), "eval_tokens_per_s": asdict(self.eval),
                "prompt_tokens_per_s": asdict(self.prompt), "context": self.context, "ceiling": self.ceiling,
                "finished": self.finished}


class Progress:
    """A one-line progress bar on ``stream`` (stderr), drawn only when it is a terminal."""

    def __init__(self, total: int, label: str = "", stream: IO[str] | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label}[{bar}] {done}/{self.total} {text}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def completion(client: BlockingClient, tokens: int, prompt: str, timeout_s: float) -> RunTimings:
    """One completion within ``timeout_s``; its ``timings``. Raises :class:`BenchError`."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}
    try:
        resp = client.post(CHAT_PATH, json=body, timeout_s=timeout_s)
    except RequestFailed as exc:
        raise BenchError(f"completion failed: POST {CHAT_PATH}: {exc}") from exc
    if resp.status != 200:
        raise BenchError(f"completion failed: POST {CHAT_PATH} answered HTTP {resp.status}: "
                         f"{' '.join(resp.text.split())[:300]}")
    return _timings(resp.text)


def _timings(text: str) -> RunTimings:
    """The ``timings`` of a chat completion's answer ``text``. Raises :class:`BenchError` naming what is
    missing or malformed (llama-server answers them; a proxy or another server may not)."""
    where = f"POST {CHAT_PATH}"
    try:
        answer = json.loads(text)
    except ValueError:
        raise BenchError(f"completion failed: {where} answered no JSON: {' '.join(text.split())[:200]!r}") from None
    t = answer.get("timings") if isinstance(answer, dict) else None
    if not isinstance(t, dict):
        raise BenchError(f"completion failed: {where} answered without \"timings\" (llama-server's own "
                         "figures; is this llama-server?)")
    missing = [k for k in TIMING_KEYS if k not in t]
    if missing:
        raise BenchError(f"completion failed: {where} answered \"timings\" without {', '.join(missing)}")
    try:
        return RunTimings(int(t["predicted_n"]), float(t["predicted_per_second"]),
                          int(t["prompt_n"]), float(t["prompt_per_second"]))
    except (TypeError, ValueError):
        raise BenchError(f"completion failed: {where} answered \"timings\" that are not numbers: "
                         f"{json.dumps({k: t[k] for k in TIMING_KEYS})[:200]}") from None


def native_completion(client: BlockingClient, timeout_s: float) -> None:
    """One short completion on llama-server's native ``POST /completion`` (the endpoint the trial's chat
    measurement does not reach). Raises :class:`BenchError` on a failed request or a non-2xx answer."""
    path, body = OWN_REQUESTS[0]
    try:
        problem = answer_problem(path, client.post(path, json=body, timeout_s=timeout_s))
    except RequestFailed as exc:
        raise BenchError(f"POST {path} failed: {exc}") from exc
    if problem:
        raise BenchError(problem)


@dataclass(frozen=True)
class Target:
    """A server to measure: its base URL and the API key its requests carry ("" for none)."""

    url: str
    api_key: str = ""


def run_bench(url: str, *, runs: int = 10, tokens: int = 256, prompt: str = DEFAULT_PROMPT, timeout_s: float = 300.0,
              warmup: bool = True, progress: Progress | None = None, api_key: str = "",
              cancel: Cancel | None = None) -> BenchResult:
    """Warm up, then ``runs`` completions of ``tokens`` tokens against ``url``; each request has
    ``timeout_s`` and, with ``api_key`` (``[server].api_key_file``'s key), a Bearer token.
    Raises :class:`BenchError` on the first failed request (and once ``cancel`` is set)."""
    return run_interleaved([Target(url, api_key)], runs=runs, tokens=tokens, prompt=prompt, timeout_s=timeout_s,
                           warmup=warmup, progress=progress, cancel=cancel)[0]


def run_interleaved(targets: list[Target], *, runs: int = 10, tokens: int = 256, prompt: str = DEFAULT_PROMPT,
                    timeout_s: float = 300.0, warmup: bool = True,
                    progress: Progress | None = None, cancel: Cancel | None = None) -> list[BenchResult]:
    """Warm each of ``targets`` up, then ``runs`` rounds of one completion of ``tokens`` tokens on
    each target in turn (A, B, A, B …: a slow spell of the host falls on all of them alike instead of
    on whichever ran then); one :class:`BenchResult` per target, in order. ``progress`` counts rounds.
    Raises :class:`BenchError` on the first failed request (and once ``cancel`` is set)."""
    if runs < 1 or tokens < 1:
        raise BenchError("runs and tokens must be at least 1")
    done: list[list[RunTimings]] = [[] for _ in targets]
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(BlockingClient(t.url, t.api_key, cancel)) for t in targets]
        if warmup:
            if progress:
                progress.update(0, "warm-up")
            for client in clients:
                completion(client, tokens, prompt, timeout_s)
        for i in range(runs):
            for client, record in zip(clients, done, strict=True):
                record.append(completion(client, tokens, prompt, timeout_s))
            if progress:
                progress.update(i + 1, " / ".join(f"{r[-1].predicted_per_second:,.1f}" for r in done) + " tokens/s")
    if progress:
        progress.close()
    return [BenchResult(url=t.url, runs=r, tokens=tokens) for t, r in zip(targets, done, strict=True)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def decode_speed(url: str, api_key: str, runs: int, tokens: int, timeout_s: float,
                 cancel: Cancel | None = None) -> float:
    """The median decode tokens/s of :func:`run_bench` (warm-up, ``runs`` completions of ``tokens``
    tokens), after one request to the native ``/completion`` that must answer 2xx: an upgrade's trial
    measures each build with it. Raises :class:`BenchError` (also once ``cancel`` is set: the request
    under way is cut)."""
    with BlockingClient(url, api_key, cancel) as client:
        native_completion(client, timeout_s)
    return run_bench(url, runs=runs, tokens=tokens, timeout_s=timeout_s, api_key=api_key, cancel=cancel).eval.median


@contextlib.contextmanager
def spawned_server(config: Config, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start llama-server as ``config`` describes (llama-guard's own argv, and the daemon's child
    set-up: environment without the service manager's variables, ``[limits]`` rlimits, the drop to
    ``[server].user``, death with its parent), wait for ``/health`` 200
    within ``[health].load_timeout_s``, yield the process, then stop it: SIGTERM, ``[recovery].stop_grace_s``,
    SIGKILL. Its output goes to ``log_path``. Raises :class:`BenchError` when it exits or is not ready in time."""
    from llama_guard.config.argv import build_argv, resolve_binary
    from llama_guard.core.child import ChildSetup, child_environ, popen
    from llama_guard.core.privileges import drop_argv, server_identity
    from llama_guard.limits.own import can_raise_hard_limits, read_own_limits
    from llama_guard.limits.plan import plan_child_limits

    server = config.server
    binary = resolve_binary(server.binary)
    if binary is None:
        raise BenchError(f"{server.binary!r} not found ([server].binary)")
    try:  # the daemon's child set-up: environment, rlimits, then the drop to [server].user
        identity = server_identity(server.user, server.group, server.supplementary_groups)
    except (ValueError, OSError) as exc:
        raise BenchError(f"[server].user: {exc}") from None
    plan = plan_child_limits(config, read_own_limits(), can_raise_hard_limits())
    try:
        setup = ChildSetup(tuple(drop_argv(identity)), plan.settings)
    except FileNotFoundError as exc:
        raise BenchError(str(exc)) from None
    with log_path.open("wb") as log:
        try:  # its --help probe (build_argv) dropped too: never run a build as root
            proc = popen(build_argv(server, binary, run_as=setup.wrapper), child_environ(os.environ, server.env),
                         setup, stdout=log)
        except OSError as exc:
            raise BenchError(f"cannot execute {binary}: {exc.strerror or exc}") from None
    try:
        deadline = time.monotonic() + config.health.load_timeout_s
        with BlockingClient(config.server.base_url) as c:
            while True:
                if proc.poll() is not None:
                    raise BenchError(f"llama-server exited with {proc.returncode} before it was ready "
                                     f"(log: {log_path})")
                with contextlib.suppress(RequestFailed):
                    if c.get("/health", timeout_s=config.health.timeout_s).status == 200:
                        break
                if time.monotonic() > deadline:
                    raise BenchError(f"llama-server not ready within {config.health.load_timeout_s:g} s "
                                     f"(log: {log_path})")
                time.sleep(0.1)
        yield proc
    finally:
        _stop(proc, config.recovery.stop_grace_s)


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def ceiling_for(config: Config, result: BenchResult, *, nvml_module: Any = None) -> dict[str, Any]:
    """The ceiling of ``config`` at ``result``'s context and median, as a dict (``Ceiling.as_dict``);
    ``{"error": ...}`` when the model's metadata cannot be read."""
    from llama_guard.gpu.info import gpu_memory_facts
    from llama_guard.insight.budget import Settings, kv_read_bytes, layers_on_gpu, weights_read_bytes
    from llama_guard.insight.ceiling import Ceiling
    from llama_guard.insight.model_facts import ModelFactsError, read_model_facts

    try:
        facts = read_model_facts(config.server.model)
    except ModelFactsError as exc:
        return {"error": str(exc)}
    gpu = gpu_memory_facts(config, nvml_module=nvml_module)
    s = Settings.from_server(config.server)
    on_gpu = gpu.name != "" and config.server.n_gpu_layers > 0
    layers = layers_on_gpu(facts.n_layer, s.n_gpu_layers)[0] if on_gpu else None
    source = gpu.bandwidth_source
    if gpu.bandwidth is None and not gpu.name:
        source = "no GPU found and [gpu].memory_bandwidth_gbs not set"
    weights = weights_read_bytes(facts, s, gpu=on_gpu)
    host = weights_read_bytes(facts, s, gpu=False) - weights if on_gpu else 0
    ceiling = Ceiling(bandwidth=gpu.bandwidth, source=source, weights_read=weights,
                      kv_read=kv_read_bytes(facts, s, result.context, layers), context=result.context,
                      measured=result.eval.median, on_gpu=on_gpu, host_weights_read=max(0, host))
    out = ceiling.as_dict()
    if on_gpu and layers is not None and len(layers) < facts.n_layer:
        out["note"] = "partial offload: only the GPU's share is counted; the CPU layers are slower still"
    return out


def record(runtime_dir: Path, result: BenchResult) -> None:
    """Keep the last result as ``<runtime_dir>/bench.json`` (for the metrics); never raises."""
    with contextlib.suppress(OSError):
        tmp = runtime_dir / f".{BENCH_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(result.as_dict()))
        tmp.replace(runtime_dir / BENCH_FILE)


def read_recorded(runtime_dir: Path) -> dict[str, Any] | None:
    """The last recorded bench result, or None."""
    try:
        data = json.loads((runtime_dir / BENCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(result: BenchResult) -> list[str]:
    """Human lines: the medians with their spread, and the ceiling sentence."""
    e, p = result.eval, result.prompt
    lines = [f"{result.label + ': ' if result.label else ''}eval {e.median:,.1f} tokens/s median "
             f"(min {e.min:,.1f}, max {e.max:,.1f}, sd {e.stdev:,.1f}); prompt {p.median:,.1f} tokens/s median "
             f"(min {p.min:,.1f}, max {p.max:,.1f}); {len(result.runs)} runs × {result.tokens} tokens, "
             f"context {result.context}"]
    if result.ceiling:
        lines.append("  " + str(result.ceiling.get("verdict") or result.ceiling.get("error")))
        if result.ceiling.get("note"):
            lines.append("  " + str(result.ceiling["note"]))
    return lines
