"""The policy's rule for a taken port (pure): the holder named, retries without crash counting
within ``port_wait_s``, then exit 78 naming the holder; a ready server ends the episode."""

from __future__ import annotations

from llama_guard.model.actions import FindPortHolder
from llama_guard.model.inputs import Boot, Exited, HealthOk, PortHolder, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.types import Params, State, initial_state
from llama_guard.vocab.exitcodes import EXIT_CONFIG
from llama_guard.vocab.phases import Phase
from test_judgement import emitted, feed, names

P = Params(port=8080, port_wait_s=10.0, port_retry_s=2.0, max_restarts=2, backoff_initial_s=1)
BIND = "0.00.002.798 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"


def taken_start(s: State, pid: int, now: float,
                holder: tuple[int, str] | None = (4242, "nc")) -> tuple[State, list[object]]:
    s, _ = decide(s, Spawned(pid), now)
    s, acts = feed(s, pid, [BIND], now + 0.01)
    out = list(acts)
    if holder is not None:
        s, acts = decide(s, PortHolder(8080, *holder), now + 0.02)
        out += acts
    s, acts = decide(s, Exited(pid, 1), now + 0.03)
    return s, out + list(acts)


def test_a_taken_port_is_named_retried_without_counting_then_78_naming_the_holder() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, acts = decide(s, Spawned(100), 0.0)
    s, acts = feed(s, 100, [BIND], 0.01)
    assert acts == [FindPortHolder(8080)]
    s, acts = decide(s, Exited(100, 1), 0.02)  # the exit before the holder is known
    assert s.phase is Phase.BACKOFF and s.failures == () and "server_backoff" in names(acts)
    s, acts = decide(s, PortHolder(8080, 4242, "nc"), 0.05)  # answers while backing off
    taken = emitted(acts, "server_port_taken")
    assert taken.fields["holder_pid"] == 4242 and taken.fields["holder"] == "pid 4242 (nc)"
    now = 2.05
    for pid in range(101, 110):
        s, _ = decide(s, Tick(), now)
        s, acts = taken_start(s, pid, now, holder=None)
        if s.phase is Phase.EXITED:
            break
        assert s.phase is Phase.BACKOFF and s.failures == (), names(acts)  # more than max_restarts: no crash loop
        now = (s.deadline or now) + 0.01
    assert s.phase is Phase.EXITED and s.exit.code == EXIT_CONFIG
    failure = emitted(acts, "server_boot_failure")
    assert "pid 4242 (nc)" in str(failure.fields["cause"]) and failure.fields["port"] == 8080
    assert now >= P.port_wait_s


def test_a_port_that_frees_up_ends_the_episode() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, _ = taken_start(s, 100, 0.0)
    s, _ = decide(s, Tick(), 3.0)
    s, _ = decide(s, Spawned(101), 3.0)
    s, _ = decide(s, HealthOk(101), 4.0)
    assert s.phase is Phase.READY and s.port_taken_since is None and s.port_holder is None
    # Taken again much later: a fresh bound, not the old one.
    s, _ = decide(s, Exited(101, -9), 100.0)
    s, _ = decide(s, Tick(), 100.0)
    s, _ = taken_start(s, 102, 100.0)
    assert s.phase is Phase.BACKOFF and s.port_taken_since == 100.01
