"""The ``llama-guard`` command line: run, check, status, bench, restart, tune."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_guard import __version__
from llama_guard.host.paths import ENV_CONFIG_PATH, resolve_config_path, runtime_dir_of
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK
from llama_guard.vocab.verdicts import Verdict

if TYPE_CHECKING:
    from llama_guard.config import Config

# Each verb imports what it uses: `status` and `restart` need neither pydantic, aiohttp nor asyncio.


def _load(args: argparse.Namespace) -> tuple[Path, Config]:
    from llama_guard.config import ConfigError, load_config

    path = resolve_config_path(args.config)
    try:
        return path, load_config(path)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"llama-guard: config error: {line}", file=sys.stderr)
        if args.config is None and not path.exists():
            print(f"llama-guard: name another file with --config PATH or ${ENV_CONFIG_PATH} (the shipped one is "
                  "etc/llama-guard.toml)", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def _runtime_dir(args: argparse.Namespace) -> Path:
    """``--runtime-dir``, else ``[runtime].dir`` of the config, else the default."""
    if args.runtime_dir:
        return Path(args.runtime_dir)
    fast = runtime_dir_of(resolve_config_path(args.config))
    if fast is not None:
        return fast
    from llama_guard.config import ConfigError, load_config
    from llama_guard.config.sections import RuntimeConfig

    path = resolve_config_path(args.config)
    try:
        return load_config(path).runtime.dir
    except ConfigError as exc:
        # Never guess: a daemon started from this file (before the bad edit) may well be running
        # under its own [runtime].dir, and "not running" would then be a false alarm.
        for line in exc.lines:
            print(f"llama-guard: config error: {line}", file=sys.stderr)
        default = RuntimeConfig().dir
        print(f"llama-guard: cannot tell where the daemon of {path} keeps its pid file; fix the file, "
              f"or name the directory with --runtime-dir (the default is {default})", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


@contextlib.contextmanager
def _ca_bundle_unread() -> Iterator[None]:
    """While the daemon's modules are imported, ``SSL_CERT_FILE`` names an empty file (``os.devnull``).

    aiohttp builds its default TLS contexts when it is imported (``aiohttp/connector.py``,
    ``_make_ssl_context``); the verifying one reads the system's whole CA bundle file (OpenSSL's
    ``X509_STORE_set_default_paths``: 144 certificates here, ~2 MiB of RSS and 40–110 ms of CPU measured on
    the 2-core host) for a daemon that speaks only plain ``http://`` to its server. With the variable set
    the file is not read; the certificate directory (``SSL_CERT_DIR``, looked up by subject hash when a
    certificate is verified) still answers any TLS check. The variable is restored on leaving: no child
    inherits it (and no thread runs yet to read the environment meanwhile)."""
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = os.devnull
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = saved


def cmd_run(args: argparse.Namespace) -> int:
    with _ca_bundle_unread():
        import uvloop

        from llama_guard.app.wiring import make_emitter, make_notifier, make_watchers
        from llama_guard.core.daemon import Daemon
        from llama_guard.output import stderr

    path, config = _load(args)
    output = stderr.install()  # the loop never waits on its own output
    try:
        emitter = make_emitter(config)
        made = make_watchers(config, nvml_module=args.nvml_module, emitter=emitter)
        daemon = Daemon(config, path, emitter, notifier=make_notifier(), watchers=made.watchers, gpu=made.gpu,
                        child=made.child, slots=made.slots, front=made.front, exporter=made.exporter,
                        builds=made.builds)
        return uvloop.run(daemon.run())  # libuv's loop: the relay's socket work in C (docs/front.md)
    finally:
        output.drain()


def cmd_check(args: argparse.Namespace) -> int:
    from llama_guard.preflight import run_checks

    if args.json:
        return _check_json(args)
    path, config = _load(args)
    results = run_checks(config, path, nvml_module=args.nvml_module)
    worst = EXIT_CONFIG if any(r.verdict is Verdict.FAIL for r in results) else EXIT_OK
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{r.verdict:<5} {r.name:<{width}}  {r.detail}")
    return worst


def _check_json(args: argparse.Namespace) -> int:
    """``check --json``: one node verdict and action (exit 0 pass/warn, 1 fail, 2 unknown), then the lines."""
    from llama_guard.config import ConfigError, load_config
    from llama_guard.preflight import run_checks
    from llama_guard.preflight.check_report import document, overall, unknown
    from llama_guard.vocab.verdicts import CheckResult

    path = resolve_config_path(args.config)
    try:
        config = load_config(path)
    except ConfigError as exc:
        results = [CheckResult("config", Verdict.FAIL, line) for line in exc.lines]
        node = overall(results)
    else:
        try:
            results = run_checks(config, path, nvml_module=args.nvml_module)
            node = overall(results)
        except Exception as exc:  # a gate must answer: "unknown" (exit 2) rather than a traceback
            results = []
            node = unknown(f"the check did not finish: {type(exc).__name__}: {exc}")
    print(json.dumps(document(results, node), indent=2))
    return node.exit_code


def cmd_status(args: argparse.Namespace) -> int:
    from llama_guard.status.status import locate_daemon, read_status
    from llama_guard.status.status_view import EXIT_NOT_RUNNING, EXIT_STATUS_UNKNOWN, document, exit_code, render

    runtime_dir = _runtime_dir(args)
    try:
        found = locate_daemon(runtime_dir)
        snap = read_status(runtime_dir) if found.pid is not None else None
    except PermissionError as exc:
        print(f"llama-guard: cannot read {exc.filename or runtime_dir}: permission denied "
              "(the runtime directory is the daemon's own, mode 0700: run as root)", file=sys.stderr)
        return EXIT_STATUS_UNKNOWN
    if found.note:
        print(f"llama-guard: {found.note}", file=sys.stderr)
    if found.pid is None:
        if args.json:
            print(json.dumps({"schema": 1, "running": False, "ready": False, "runtime_dir": str(runtime_dir)}))
        print(f"llama-guard is not running (no daemon serves {runtime_dir})", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if snap is None or snap.get("daemon_pid") != found.pid:
        # The daemon rewrites its snapshot within seconds: this one is missing or another's.
        whose = "missing" if snap is None else f"from pid {snap.get('daemon_pid')}"
        print(f"llama-guard pid {found.pid} serves {runtime_dir}, but its status.json is {whose}; "
              "try again in a few seconds", file=sys.stderr)
        return EXIT_STATUS_UNKNOWN
    doc = document(snap)
    if args.json:
        print(json.dumps({**doc, "running": True}, indent=2, default=str))
    else:
        print("\n".join(render(doc)))
    return exit_code(snap)


def cmd_restart(args: argparse.Namespace) -> int:
    from llama_guard.status.status import locate_daemon

    runtime_dir = _runtime_dir(args)
    try:
        found = locate_daemon(runtime_dir)
    except PermissionError as exc:
        print(f"llama-guard: cannot read {exc.filename or runtime_dir}: permission denied (run as root)",
              file=sys.stderr)
        return EXIT_FAILURE
    if found.note:
        print(f"llama-guard: {found.note}", file=sys.stderr)
    pid = found.pid
    if pid is None:
        print(f"llama-guard: no running daemon found (none serves {runtime_dir})", file=sys.stderr)
        return EXIT_FAILURE
    os.kill(pid, signal.SIGUSR1)
    print(f"asked llama-guard pid {pid} for a graceful server restart (it drains busy slots first; while the "
          "server still loads or restores its slots, once it is ready). Its restart_requested event says what "
          "became of it: deferred, under_way or refused, with the reason, when not done at once")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from llama_guard.config import ConfigError
    from llama_guard.config.api_key import read_api_key
    from llama_guard.tune.bench import (
        BenchError,
        Progress,
        Target,
        ceiling_for,
        describe,
        free_port,
        record,
        run_interleaved,
        spawned_server,
    )
    from llama_guard.tune.compare import CompareError, Side, on_port, ratio_line, ratios, sides

    path, config = _load(args)
    chosen = [Side(path.name, config)]
    if args.compare:
        try:
            chosen = list(sides(path, config, Path(args.compare)))
        except ConfigError as exc:
            for line in exc.lines:
                print(f"llama-guard: config error: {line}", file=sys.stderr)
            return EXIT_CONFIG
        except CompareError as exc:
            print(f"llama-guard: bench --compare: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    spawn = args.spawn or bool(args.compare)
    if spawn:  # the bench's own servers, each on a free port: never a running daemon's server on the configured one
        chosen = [Side(side.label, on_port(side.config, free_port())) for side in chosen]
    urls = [args.url if args.url and not spawn else side.config.server.base_url for side in chosen]
    for side, url in zip(chosen, urls, strict=True):
        print(f"bench {side.label}: warm-up + {args.runs} runs of {args.tokens} tokens against {url}"
              f"{' (server started for the bench)' if spawn else ''}", file=sys.stderr)
    if len(chosen) > 1:
        print("the runs alternate, one on each server in turn", file=sys.stderr)
    logs: list[Path] = []  # the spawned servers' output: kept (and named) when the bench fails, else removed
    try:
        with contextlib.ExitStack() as stack:
            if spawn:
                for side in chosen:
                    fd, log_name = tempfile.mkstemp(prefix="llama-guard-bench-", suffix=".log")
                    os.close(fd)
                    logs.append(Path(log_name))
                    stack.enter_context(spawned_server(side.config, logs[-1]))
            targets = [Target(url, read_api_key(side.config.server)) for side, url in zip(chosen, urls, strict=True)]
            results = run_interleaved(targets, runs=args.runs, tokens=args.tokens, prompt=args.prompt,
                                      timeout_s=args.timeout,
                                      progress=Progress(args.runs, " / ".join(s.label for s in chosen) + " "))
    except BenchError as exc:
        print(f"llama-guard: bench: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ConfigError as exc:
        print(f"llama-guard: config error: {exc.lines[0]}", file=sys.stderr)
        return EXIT_CONFIG
    for log in logs:
        log.unlink(missing_ok=True)
    for side, result in zip(chosen, results, strict=True):
        result.label = side.label
        result.ceiling = ceiling_for(side.config, result, nvml_module=args.nvml_module)
        if not spawn:
            record(side.config.runtime.dir, result)
    if args.json:
        out: dict[str, object] = {"results": [r.as_dict() for r in results]}
        if len(results) == 2:
            out.update(ratios(*results))
        print(json.dumps(out, indent=2))
        return EXIT_OK
    for r in results:
        print("\n".join(describe(r)))
    if len(results) == 2:
        print(ratio_line(*results))
    return EXIT_OK


def cmd_tune(args: argparse.Namespace) -> int:
    from llama_guard.tune.command import run_tune

    path, config = _load(args)
    return run_tune(path, config, minutes=args.minutes, apply=args.apply, as_json=args.json,
                    nvml_module=args.nvml_module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-guard", description="Supervise one llama.cpp llama-server (see README.md).",
        epilog="Every verb takes --config PATH; without it $LLAMA_GUARD_CONFIG, else "
               "/etc/llama-guard/llama-guard.toml. Keys can be overridden as LLAMA_GUARD_<SECTION>__<KEY>. "
               "Exit codes of run: 0 stopped, 69 GPU unrecoverable, 70 internal error, 75 crash loop, "
               "78 configuration error.")
    parser.add_argument("--version", action="version", version=f"llama-guard {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="{run,check,status,restart,bench,tune}")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help="config file (default: $LLAMA_GUARD_CONFIG, "
                                        "else /etc/llama-guard/llama-guard.toml)")
        return p

    add("run", "run the daemon in the foreground (what systemd starts)").set_defaults(func=cmd_run)
    p = add("check", "preflight: config, binary and flags, model, GPU, limits, VRAM budget")
    p.add_argument("--json", action="store_true", help="one node verdict (pass/warn/fail/unknown) and recommended "
                                                       "action (none/fix_config/reset_gpu/reboot), then every line; "
                                                       "exit 0 pass or warn, 1 fail, 2 unknown")
    p.set_defaults(func=cmd_check)
    p = add("status", "what the running daemon sees now (exit 0 ready, 1 not ready, 3 not running, "
                      "4 unknown, 78 config unreadable)")
    p.add_argument("--json", action="store_true", help="the snapshot as a versioned document (schema 1)")
    p.add_argument("--runtime-dir", help="the daemon's [runtime].dir")
    p.set_defaults(func=cmd_status)
    p = add("restart", "ask the running daemon for a graceful server restart (SIGUSR1)")
    p.add_argument("--runtime-dir", help="the daemon's [runtime].dir")
    p.set_defaults(func=cmd_restart)
    p = add("bench", "generation speed: median eval tokens/s of N completions, against the bandwidth ceiling")
    p.add_argument("--runs", type=_positive, default=10, help="measured runs after one warm-up (default 10)")
    p.add_argument("--tokens", type=_positive, default=256, help="tokens generated per run (default 256)")
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--url", help="server URL (default: from [server])")
    p.add_argument("--spawn", action="store_true", help="start a server from the config for the bench (its port "
                                                        "must be free) instead of measuring the running one")
    p.add_argument("--compare", metavar="OTHER", help="bench this config's server and another side by side, each "
                   "started for it, their runs alternating, and print both and the ratio: OTHER is a llama-server "
                   "executable (another build, with this config) or another config file (OTHER.toml)")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=cmd_bench)
    p = add("tune", "find the fastest [server] flags that fit the GPU, by measurement (a serving daemon lends it)")
    p.add_argument("--minutes", type=_positive_float, default=30.0, help="time for the search (default 30)")
    p.add_argument("--apply", action="store_true", help="write the winning flags into the config file "
                                                        "(comments and other keys kept)")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=cmd_tune)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def main(argv: Sequence[str] | None = None, *, nvml_module: Any = None) -> int:
    """Parse ``argv`` and run the verb; ``nvml_module`` is the pynvml module for ``run``, ``check`` and
    ``bench`` (None: the real ``pynvml``; tests/run_with_fake_nvml.py passes a fake)."""
    args = build_parser().parse_args(argv)
    args.nvml_module = nvml_module
    try:
        code: int = args.func(args)
    except BrokenPipeError:  # `llama-guard status | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
