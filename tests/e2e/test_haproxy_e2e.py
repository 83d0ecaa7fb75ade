"""End to end: the shipped balancer pool (deploy/haproxy/haproxy.cfg) with the REAL HAProxy before two llama-guard
boxes on this host, each with its own REAL llama-server on the REAL SmolLM2 model.

Two client loops send completions through HAProxy while one box at a time goes through a kill -9 of its
llama-server, a planned restart (``llama-guard restart``), a SIGTERM of its daemon (then started again) and a
reload that changes its server's flags (SIGHUP), and last a SIGTERM inside the seconds before the checks notice
(the box's checks turned off on the stats socket: the balancer's L7 retries carry the clients). No client may see a
failure, and the balancer's own view (its stats socket, ``show stat``) must show each box leave (DOWN: its
``/readyz`` answered 503, or nothing) and return (UP), with traffic through it again. The test prints what the
clients saw per scenario (a table, in the run's summary: tests/conftest.py). A second test checks the retry rule
alone, before two small HTTP servers, one of them answering 503 as a stopping llama-guard does.

Each box's llama-server is the real one behind a gate (a shell wrapper): a serving start waits while the gate
file exists, as a 16 GB model's load would, so the box stays not ready until the test has seen the balancer take
it out — on positive markers (the stats socket, the daemon's events), never a sleep or a race against the
checks. For the SIGTERM, the box's llama-server is paused (SIGSTOP) with an answer in flight, so the exit drain
lasts until the test has seen the balancer take the draining box out while its daemon still runs.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import ROOT, DaemonRun, RunPool, free_port, terminate
from needs import unavailable

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

SHIPPED = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
BACKEND = "llama_guard"
WAIT_S = 120.0  # the longest wait for one marker (a load on a busy 2-core host)

GATE = """#!/bin/sh
# The real llama-server; a serving start (--model) first waits while the gate file exists.
case " $* " in *" --model "*) while [ -e "{gate}" ]; do sleep 0.05; done ;; esac
exec "{real}" "$@"
"""


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def pool_config(bind: int, boxes: list[tuple[str, int]], stats: Path) -> str:
    """The shipped file with this host's addresses: the clients' port, the boxes' front doors, the stats socket
    (and, when not root, without the privilege drop). Everything else is run as shipped."""
    text = SHIPPED.read_text()

    def once(pattern: str, new: str) -> None:
        nonlocal text
        text, n = re.subn(pattern, new, text, flags=re.M)
        assert n == 1, f"{SHIPPED}: {pattern!r} matched {n} lines"

    once(r"^    bind :8080$", f"    bind 127.0.0.1:{bind}")
    once(r"^    stats socket /run/haproxy/admin\.sock ", f"    stats socket {stats} ")
    if os.geteuid() != 0:
        for key in ("chroot", "user", "group"):
            once(rf"^    {key} .*\n", "")
    text, n = re.subn(r"^    server .*\n", "", text, flags=re.M)
    assert n == 2 and text.rstrip().endswith("X-Served-By %s"), "the shipped file ends with its server lines"
    return text + "".join(f"    server {name} 127.0.0.1:{port}\n" for name, port in boxes)


def command(sock: Path, line: str) -> str:
    """One command on the balancer's stats socket (``show stat``, ``disable health …``); its answer."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(sock))
        conn.sendall(line.encode() + b"\n")
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data.decode()


def show_stat(sock: Path) -> dict[str, dict[str, str]]:
    """The balancer's own view of the backend's servers (``show stat`` on the stats socket), by name."""
    lines = command(sock, "show stat").splitlines()
    header = lines[0].lstrip("# ").split(",")
    rows = csv.DictReader([ln for ln in lines[1:] if ln], fieldnames=header)
    return {row["svname"]: row for row in rows if row["pxname"] == BACKEND}


@dataclass
class Box:
    name: str
    run: DaemonRun
    front: int
    gate: Path

    def readyz(self) -> str:
        """``/readyz`` of the box's front door, as the table shows it."""
        resp = httpx.get(f"http://127.0.0.1:{self.front}/readyz", timeout=10)
        doc = resp.json()
        cause = f"{doc['cause']} ({doc['restart_cause']})" if doc["restart_cause"] else doc["cause"]
        return f"{resp.status_code} {cause}, Retry-After {resp.headers.get('Retry-After')}"


@dataclass
class Clients:
    """Client loops through the balancer; ``seen``: (scenario, status or error, box that answered)."""

    port: int
    scenario: str = "start"
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, n: int) -> None:
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.done.is_set():
                scenario = self.scenario
                try:
                    resp = client.post(f"http://127.0.0.1:{self.port}/completion",
                                       json={"prompt": "Hi", "n_predict": 2, "cache_prompt": False})
                    self.seen.append((scenario, str(resp.status_code), resp.headers.get("x-served-by", "-")))
                except httpx.HTTPError as exc:
                    self.seen.append((scenario, type(exc).__name__, "-"))

    def served_by(self, scenario: str, box: str) -> bool:
        return any(s == scenario and b == box and st == "200" for s, st, b in list(self.seen))

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(WAIT_S)


@dataclass
class Fleet:
    boxes: dict[str, Box]
    stats: Path
    clients: Clients

    def state(self, box: str) -> str:
        return show_stat(self.stats)[box]["status"]

    def counter(self, svname: str, key: str) -> int:
        return int(show_stat(self.stats)[svname][key] or 0)

    def retries(self) -> int:
        """Requests the balancer sent again: retries on the same box (``wretr``) and to another (``wredis``)."""
        return self.counter("BACKEND", "wretr") + self.counter("BACKEND", "wredis")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path, real_model: Path) -> Iterator[Fleet]:
    binary = shutil.which("haproxy")
    if binary is None:
        unavailable("haproxy not found (apt-get install haproxy)")
    pool = RunPool()
    boxes: dict[str, Box] = {}
    haproxy: subprocess.Popen[bytes] | None = None
    clients: Clients | None = None
    try:
        for name in ("box1", "box2"):
            where = tmp_path_factory.mktemp(name)
            gate, wrapper = where / "gate", where / "llama-server"
            wrapper.write_text(GATE.format(gate=gate, real=llama_server_bin))
            wrapper.chmod(0o755)
            front = free_port()
            run = pool.new(where, str(wrapper), str(real_model), {
                "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 120.0},
                "server": {"parallel": 2, "ctx_size": 2048},
                # hangs are not under test: a paused server (the SIGTERM scenario) is never judged hung here
                "health": {"canary": False, "interval_s": 1.0, "hang_strikes": 120, "timeout_s": 5.0},
                "recovery": {"stable_after_s": 1.0, "max_restarts": 10}})
            boxes[name] = Box(name, run.start(), front, gate)
        for box in boxes.values():
            box.run.wait_event("server_ready", WAIT_S)
        where = tmp_path_factory.mktemp("haproxy")
        stats, cfg, port = where / "stats.sock", where / "haproxy.cfg", free_port()
        cfg.write_text(pool_config(port, [(b.name, b.front) for b in boxes.values()], stats))
        with (where / "haproxy.log").open("ab") as log:
            haproxy = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log, stderr=log,
                                       stdin=subprocess.DEVNULL)
        fleet = Fleet(boxes, stats, Clients(port))
        wait_until("the stats socket answers", lambda: stats.exists() and bool(_quiet(show_stat, stats)))
        wait_until("both boxes UP", lambda: all(fleet.state(b) == "UP" for b in boxes))
        clients = fleet.clients
        clients.start(2)
        yield fleet
    finally:
        if clients is not None:
            clients.stop()
        if haproxy is not None:
            terminate(haproxy, 10)
        for box in boxes.values():
            box.gate.unlink(missing_ok=True)
        leftovers = pool.finish()
        if leftovers:
            pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def _quiet(read: Callable[[Path], Any], path: Path) -> Any:
    try:
        return read(path)
    except OSError:
        return None


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    return subprocess.run([sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=str(ROOT), env=env)


def test_a_client_loop_through_haproxy_sees_no_failure_while_each_box_leaves_and_returns(
        fleet: Fleet, request: pytest.FixtureRequest) -> None:
    box1, box2 = fleet.boxes["box1"], fleet.boxes["box2"]
    clients = fleet.clients
    wait_until("both boxes answered through the balancer",
               lambda: clients.served_by("start", "box1") and clients.served_by("start", "box2"))
    rows: list[tuple[str, str, str]] = []  # (scenario, /readyz while out, the balancer's view)

    def scenario(label: str, box: Box, fault: Callable[[], None], *, gated: bool = True,
                 while_out: Callable[[], None] = lambda: None, back: Callable[[], None] = lambda: None) -> None:
        """``fault`` on ``box``; the balancer takes it out (DOWN) and, once the box is ready again, puts it
        back (UP) and sends it traffic. ``gated``: the box's next llama-server waits for the test's word."""
        downs = fleet.counter(box.name, "chkdown")
        ready = box.run.count("server_ready")
        if gated:
            box.gate.touch()
        clients.scenario = label
        fault()
        wait_until(f"{label}: the balancer takes {box.name} out", lambda: fleet.state(box.name) == "DOWN")
        readyz = box.readyz() if box.run.proc is not None and box.run.proc.poll() is None else "(no daemon)"
        while_out()
        box.gate.unlink(missing_ok=True)
        back()
        box.run.wait_event("server_ready", WAIT_S, skip=ready)
        wait_until(f"{label}: the balancer puts {box.name} back", lambda: fleet.state(box.name) == "UP")
        wait_until(f"{label}: {box.name} answers through the balancer again",
                   lambda: clients.served_by(label, box.name))
        assert fleet.counter(box.name, "chkdown") == downs + 1
        rows.append((label, readyz, f"{box.name} UP → DOWN → UP"))

    # 1. kill -9 of box1's llama-server: its front door holds the requests it has and replays them.
    scenario("kill -9 of box1's llama-server", box1,
             lambda: os.kill(box1.run.wait_event("server_ready", 10, skip=box1.run.count("server_ready") - 1)
                             ["server_pid"], signal.SIGKILL))
    # 2. a planned restart of box2 (llama-guard restart): drained, its /readyz 503 from the drain's start.
    scenario("llama-guard restart of box2", box2,
             lambda: _ok(cli("restart", "--config", str(box2.run.config))))

    # 3. SIGTERM of box1's daemon with an answer in flight (its server paused): the draining box is taken out
    # while its daemon still runs; its client then leaves, the daemon exits, is started again and comes back.
    held: dict[str, Any] = {}

    def sigterm() -> None:
        held["server"] = box1.run.wait_event("server_ready", 10, skip=box1.run.count("server_ready") - 1)["server_pid"]
        held["client"] = answer = socket.create_connection(("127.0.0.1", box1.front), timeout=WAIT_S)
        body = b'{"prompt": "Once upon a time", "n_predict": 256, "stream": true}'
        answer.sendall(b"POST /completion HTTP/1.1\r\nHost: box1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:  # the answer's first event: the request is in flight in a slot
            chunk = answer.recv(65536)
            assert chunk, got
            got += chunk
        os.kill(held["server"], signal.SIGSTOP)
        box1.run.signal(signal.SIGTERM)
        box1.run.wait_event("daemon_stopping", 30)

    def stopped() -> None:
        assert box1.run.proc is not None and box1.run.proc.poll() is None, "the draining box left after its stop"
        os.kill(held["server"], signal.SIGCONT)
        held["client"].close()  # the client leaves: nothing is in flight any more, the daemon stops
        assert box1.run.wait_exit(WAIT_S) == 0

    scenario("SIGTERM of box1's daemon, started again", box1, sigterm, gated=False, while_out=stopped,
             back=box1.run.start)

    # 4. a reload of box2 that changes its server's flags (SIGHUP): a drained restart on the new flags.
    def reload() -> None:
        box2.run.config.write_text(box2.run.config.read_text().replace("ctx_size = 2048", "ctx_size = 3072", 1))
        reloaded = box2.run.count("config_reloaded")
        box2.run.signal(signal.SIGHUP)
        box2.run.wait_event("config_reloaded", 30, skip=reloaded)

    scenario("reload of box2 (new ctx_size)", box2, reload)

    # 5. SIGTERM of box2's daemon inside the checks' window (its health checks off, as in the ~2.5 s before they
    # notice): the requests the balancer still sends it get llama-guard's 503 while it drains, or no connection
    # once it has gone, and each is sent again to box1 (retry-on 503 / conn-failure, redispatch).
    def unnoticed() -> None:
        retries = fleet.retries()
        command(fleet.stats, f"disable health {BACKEND}/box2")
        box2.run.signal(signal.SIGTERM)
        wait_until("the balancer sent a request box2 refused again", lambda: fleet.retries() > retries)
        assert box2.run.wait_exit(WAIT_S) == 0
        command(fleet.stats, f"enable health {BACKEND}/box2")

    scenario("SIGTERM of box2 before the checks notice", box2, unnoticed, gated=False, back=box2.run.start)

    clients.stop()
    table = _table(clients.seen, rows, fleet)
    request.node.add_report_section("call", "table", table)
    print(table)
    failed = [(s, st, b) for s, st, b in clients.seen if st != "200"]
    assert not failed, f"{len(failed)} failed requests through the balancer: {failed[:10]}\n{table}"
    assert all(_scenario_count(clients.seen, label) > 0 for label, _, _ in rows)


def _ok(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stdout + out.stderr


def _scenario_count(seen: list[tuple[str, str, str]], label: str) -> int:
    return sum(1 for s, _, _ in seen if s == label)


def _table(seen: list[tuple[str, str, str]], rows: list[tuple[str, str, str]], fleet: Fleet) -> str:
    """What the clients saw through the balancer, per scenario."""
    head = ("scenario", "requests", "statuses", "box1", "box2", "/readyz of the box while out", "balancer (show stat)")
    lines = [head]
    for label, readyz, view in rows:
        mine = [(st, b) for s, st, b in seen if s == label]
        statuses = Counter(st for st, _ in mine)
        boxes = Counter(b for _, b in mine)
        lines.append((label, str(len(mine)), " ".join(f"{k}×{v}" for k, v in sorted(statuses.items())),
                      str(boxes["box1"]), str(boxes["box2"]), readyz, view))
    stat = show_stat(fleet.stats)["BACKEND"]  # the backend's own row
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.append(f"the balancer's L7 retries: {stat['wretr']}, redispatches: {stat['wredis']} "
               f"(show stat, backend {BACKEND})")
    return "\n".join(out)


#: Two boxes for the balancer's retry rule alone: box1 answers 200 after 0.5 s; box2 is a llama-guard that stops
#: before its checks notice — its /readyz still 200, every other request llama-guard's 503 at once.
DOUBLES = """
import asyncio, sys
from aiohttp import web

async def box1(request):
    await request.read()
    await asyncio.sleep(0.5)
    return web.json_response({"content": "Hi"})

async def box2(request):
    await request.read()
    if request.path == "/readyz":
        return web.json_response({"ready": True})
    return web.json_response({"error": {"code": 503, "message": "llama-guard front door: llama-guard is stopping"}},
                             status=503, headers={"Retry-After": "5"})

async def main():
    for port, handler in ((int(sys.argv[1]), box1), (int(sys.argv[2]), box2)):
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("listening", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_what_a_stopping_box_refuses_before_its_checks_notice_is_sent_to_the_other(tmp_path: Path) -> None:
    """The shipped file's retry rule alone, with no race against the checks: each of 60 completions that lands on
    the refusing box is sent again to the other. Without the file's ``option http-buffer-request``, 23 to 36 of the
    60 reached their clients as 503 (deploy/haproxy/README.md)."""
    binary = shutil.which("haproxy")
    if binary is None:
        unavailable("haproxy not found (apt-get install haproxy)")
    ports = free_port(), free_port()
    doubles = subprocess.Popen([sys.executable, "-c", DOUBLES, *map(str, ports)], stdout=subprocess.PIPE, text=True)
    haproxy: subprocess.Popen[bytes] | None = None
    try:
        assert doubles.stdout is not None and doubles.stdout.readline().strip() == "listening"
        stats, port = tmp_path / "stats.sock", free_port()
        (tmp_path / "haproxy.cfg").write_text(pool_config(port, [("box1", ports[0]), ("box2", ports[1])], stats))
        haproxy = subprocess.Popen([binary, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdin=subprocess.DEVNULL)
        wait_until("both boxes UP", lambda: stats.exists() and all(
            row["status"] == "UP" for name, row in (_quiet(show_stat, stats) or {"-": {"status": ""}}).items()
            if name != "BACKEND"))

        def one(_: int) -> tuple[int, str]:
            resp = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 2},
                              timeout=60)
            return resp.status_code, resp.headers.get("x-served-by", "-")

        with ThreadPoolExecutor(4) as pool:
            answers = Counter(pool.map(one, range(60)))
        assert answers == {(200, "box1"): 60}, answers
        assert int(show_stat(stats)["box2"]["wredis"]) > 0  # the refused requests were sent again elsewhere
    finally:
        if haproxy is not None:
            terminate(haproxy, 10)
        terminate(doubles, 10)
