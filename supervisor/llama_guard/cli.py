"""The ``llama-guard`` command line: run, check, status, bench, restart."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_guard import __version__
from llama_guard.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from llama_guard.paths import resolve_config_path, runtime_dir_of

if TYPE_CHECKING:
    from llama_guard.config import Config

# Each verb imports what it uses: `status` and `restart` need neither pydantic, httpx nor asyncio.


def _load(args: argparse.Namespace) -> tuple[Path, Config]:
    from llama_guard.config import ConfigError, load_config

    path = resolve_config_path(args.config)
    try:
        return path, load_config(path)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"llama-guard: config error: {line}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _runtime_dir(args: argparse.Namespace) -> Path:
    """``--runtime-dir``, else ``[runtime].dir`` of the config, else the default."""
    if args.runtime_dir:
        return Path(args.runtime_dir)
    fast = runtime_dir_of(resolve_config_path(args.config))
    if fast is not None:
        return fast
    from llama_guard.config import ConfigError, RuntimeConfig, load_config

    try:
        return load_config(resolve_config_path(args.config)).runtime.dir
    except ConfigError:
        return RuntimeConfig().dir


def cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from llama_guard.core.daemon import Daemon
    from llama_guard.wiring import make_emitter, make_notifier, make_sources

    path, config = _load(args)
    emitter = make_emitter(config)
    daemon = Daemon(config, path, emitter, notifier=make_notifier(), sources=make_sources(config))
    return asyncio.run(daemon.run())


def cmd_check(args: argparse.Namespace) -> int:
    from llama_guard.preflight import run_checks

    path, config = _load(args)
    results = run_checks(config, path)
    width = max(len(r.name) for r in results)
    worst = EXIT_OK
    for r in results:
        print(f"{r.verdict:<5} {r.name:<{width}}  {r.detail}")
        if r.verdict == "FAIL":
            worst = EXIT_CONFIG
    return worst


def cmd_status(args: argparse.Namespace) -> int:
    from llama_guard.output.status import read_pid, read_status

    runtime_dir = _runtime_dir(args)
    pid = read_pid(runtime_dir)
    snap = read_status(runtime_dir)
    if pid is None or snap is None:
        print(f"llama-guard is not running (nothing live under {runtime_dir})", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(snap, indent=2))
        return EXIT_OK
    age = time.time() - float(snap.get("updated", time.time()))
    print(f"llama-guard pid {pid}: {snap.get('status')}  (snapshot {age:.0f} s old)")
    print(f"  server: {snap.get('base_url')}  pid {snap.get('server_pid') or '- (none running now)'}")
    print(f"  restarts: {snap.get('restarts')}  last failure: {snap.get('last_failure') or '-'}")
    for key in ("gpu", "limits", "planned_restarts"):
        if key == "limits" and isinstance(snap.get(key), dict) and snap[key].get("rows"):
            _print_limits(snap[key])
        elif snap.get(key):
            print(f"  {key}: {json.dumps(snap[key])}")
    events = snap.get("events") or []
    if events:
        print("  recent events:")
        for ev in events:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ev["time"])))
            print(f"    {stamp} {ev['event']}: {ev['message']}")
    return EXIT_OK


_LIMIT_USE = {"RLIMIT_NOFILE": ("fds", "nofile_limit", "open fds"),
              "RLIMIT_NPROC": ("threads", "nproc_limit", "threads")}


def _use_text(limit: str, usage: dict[str, Any]) -> str:
    """``12 open fds (0.3% of 4096)`` for a limit with a sampled use, else ``-``."""
    if limit not in _LIMIT_USE or usage.get(_LIMIT_USE[limit][0]) is None:
        return "-"
    key, limit_key, what = _LIMIT_USE[limit]
    used, value = usage[key], usage.get(limit_key)
    text = f"{used} {what}"
    if isinstance(value, int) and value > 0:  # RLIM_INFINITY is -1
        text += f" ({100.0 * used / value:.1f}% of {value})"
    if limit == "RLIMIT_NOFILE" and usage.get("connections") is not None:
        text += f", {usage['connections']} connections"
    return text


def _print_limits(limits: dict[str, Any]) -> None:
    """The ``limits`` snapshot as a table: configured, llama-guard's own, applied, effective, use."""
    usage: dict[str, Any] = limits.get("usage") or {}
    header = ("limit", "configured", "llama-guard (soft / hard)", "applied (soft / hard)",
              "effective (soft / hard)", "in use")
    table = [header] + [(r.get("limit", "?"), r.get("configured", "-"), r.get("daemon", "-"),
                         r.get("planned", "-"), r.get("effective", "-"), _use_text(r.get("limit", ""), usage))
                        for r in limits["rows"]]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    print("  limits:")
    for row in table:
        print("    " + "  ".join(f"{cell!s:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip())
    source = next((r.get("source") for r in limits["rows"] if r.get("source") not in (None, "-")), None)
    notes = []
    if source:
        notes.append(f"effective = read back from the server ({source})")
    if usage.get("pids_max") is not None:
        notes.append(f"cgroup tasks {usage.get('pids_current')} of pids.max {usage['pids_max']}")
    if not usage:
        notes.append("no use sampled yet ([limits].sample_interval_s)")
    if notes:
        print("    " + "; ".join(notes))


def cmd_restart(args: argparse.Namespace) -> int:
    from llama_guard.output.status import read_pid

    runtime_dir = _runtime_dir(args)
    pid = read_pid(runtime_dir)
    if pid is None:
        print(f"llama-guard: no running daemon found (no live pid file under {runtime_dir})", file=sys.stderr)
        return EXIT_FAILURE
    os.kill(pid, signal.SIGUSR1)
    print(f"asked llama-guard pid {pid} for a graceful server restart (it drains busy slots first)")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    import statistics

    import httpx

    _, config = _load(args)
    url = args.url or config.server.base_url
    body = {"messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.tokens,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    speeds: list[float] = []
    print(f"bench: {args.runs} runs of {args.tokens} tokens against {url}", file=sys.stderr)
    with httpx.Client(base_url=url, timeout=args.timeout, trust_env=False) as client:
        for i in range(args.runs):
            try:
                resp = client.post("/v1/chat/completions", json=body)
                resp.raise_for_status()
                timings = resp.json().get("timings", {})
            except (httpx.HTTPError, ValueError) as exc:
                print(f"llama-guard: bench request {i + 1} failed: {exc}", file=sys.stderr)
                return EXIT_FAILURE
            speed = float(timings.get("predicted_per_second", 0.0))
            speeds.append(speed)
            print(f"  run {i + 1}/{args.runs}: {timings.get('predicted_n')} tokens, {speed:.1f} tokens/s "
                  f"(prompt {float(timings.get('prompt_per_second', 0.0)):.1f} tokens/s)", file=sys.stderr)
    print(f"median eval speed: {statistics.median(speeds):.1f} tokens/s "
          f"(min {min(speeds):.1f}, max {max(speeds):.1f}, n={len(speeds)})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-guard", description="Supervise one llama.cpp llama-server (see README.md).",
        epilog="Every verb takes --config PATH; without it $LLAMA_GUARD_CONFIG, else "
               "/etc/llama-guard/llama-guard.toml. Keys can be overridden as LLAMA_GUARD_<SECTION>__<KEY>. "
               "Exit codes of run: 0 stopped, 69 GPU unrecoverable, 70 internal error, 75 crash loop, "
               "78 configuration error.")
    parser.add_argument("--version", action="version", version=f"llama-guard {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="{run,check,status,restart,bench}")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help="config file (default: $LLAMA_GUARD_CONFIG, "
                                        "else /etc/llama-guard/llama-guard.toml)")
        return p

    add("run", "run the daemon in the foreground (what systemd starts)").set_defaults(func=cmd_run)
    add("check", "preflight: config, binary and flags, model, GPU, limits").set_defaults(func=cmd_check)
    p = add("status", "what the running daemon sees now")
    p.add_argument("--json", action="store_true", help="print the raw snapshot")
    p.add_argument("--runtime-dir", help="the daemon's [runtime].dir")
    p.set_defaults(func=cmd_status)
    p = add("restart", "ask the running daemon for a graceful server restart (SIGUSR1)")
    p.add_argument("--runtime-dir", help="the daemon's [runtime].dir")
    p.set_defaults(func=cmd_restart)
    p = add("bench", "generation speed: median eval tokens/s of N completions")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--url", help="server URL (default: from [server])")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except BrokenPipeError:  # `llama-guard status | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
