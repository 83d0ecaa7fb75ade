"""What the user's own llama-server flags say, as llama-guard reads them (config/argv.py), and the front door's
answer to the endpoints llama-guard enables only for itself (front/exposed.py); ``[front].listen``
with several addresses; router mode and a missing own ``--slot-save-path`` refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_guard.config.argv import Endpoints, build_argv, own_slot_save_problem, user_endpoints
from llama_guard.config.listen import FrontConfig, MetricsConfig, parse_listens
from llama_guard.config.server import ServerConfig
from llama_guard.front.exposed import not_enabled
from pydantic import ValidationError

OFF = Endpoints(metrics=False, slots=False, slot_actions=False)


def test_endpoints_follow_the_users_flags_and_environment() -> None:
    assert user_endpoints(ServerConfig(), {}) == Endpoints(metrics=False, slots=True, slot_actions=False)
    assert user_endpoints(ServerConfig(extra_args=["--metrics", "--no-slots"]), {}) == \
        Endpoints(metrics=True, slots=False, slot_actions=False)
    assert user_endpoints(ServerConfig(extra_args=["--no-slots", "--slots", "--slot-save-path", "/x"]), {}) == \
        Endpoints(metrics=False, slots=True, slot_actions=True)
    # llama.cpp's environment switches; the command line wins over them
    assert user_endpoints(ServerConfig(), {"LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_ENDPOINT_SLOTS": "off"}) \
        == Endpoints(metrics=True, slots=False, slot_actions=False)
    assert user_endpoints(ServerConfig(env={"LLAMA_ARG_ENDPOINT_SLOTS": "0"}, extra_args=["--slots"]), {}).slots


def test_argv_always_enables_what_llama_guard_needs_and_drops_the_users_switches() -> None:
    argv = build_argv(ServerConfig(extra_args=["--no-slots", "--metrics", "--jinja"]))
    assert argv.count("--metrics") == 1 and argv.count("--slots") == 1 and "--no-slots" not in argv
    assert argv[-1] == "--jinja"


@pytest.mark.parametrize(("method", "target", "message"), [
    ("GET", "/metrics", "metrics endpoint"),
    ("HEAD", "/metrics?x=1", "metrics endpoint"),
    ("GET", "/metric%73", "metrics endpoint"),          # cpp-httplib routes the decoded path
    ("GET", "/slots", "slots endpoint"),
    ("POST", "/slots/0?action=save", "slots action"),
    ("POST", "/slots/12?action=erase", "slots action"),
    ("POST", "/%73lots/1?action=restore", "slots action"),
])
def test_the_front_door_answers_as_llama_server_with_the_endpoint_off(method: str, target: str,
                                                                        message: str) -> None:
    resp = not_enabled(method, target, OFF)
    assert resp is not None and resp.status == 501 and resp.content_type == "application/json"
    assert resp.charset == "utf-8"
    assert resp.text is not None
    body = json.loads(resp.text)
    assert list(body["error"]) == ["code", "message", "type"]  # nlohmann's sorted keys
    assert body["error"]["code"] == 501 and body["error"]["type"] == "not_supported_error"
    assert message in body["error"]["message"]


@pytest.mark.parametrize(("method", "target"), [
    ("POST", "/metrics"), ("GET", "/slots/0"), ("POST", "/slots"), ("POST", "/slots/0/x"), ("GET", "/props"),
    ("POST", "/completion"), ("GET", "/metricsx"),
])
def test_other_requests_go_to_the_server(method: str, target: str) -> None:
    assert not_enabled(method, target, OFF) is None


def test_enabled_endpoints_go_to_the_server() -> None:
    on = Endpoints(metrics=True, slots=True, slot_actions=True)
    assert all(not_enabled(m, t, on) is None for m, t in (("GET", "/metrics"), ("GET", "/slots"),
                                                            ("POST", "/slots/0?action=save")))


def test_front_listen_takes_several_addresses_on_one_port() -> None:
    front = FrontConfig(listen="127.0.0.1:8080,[::1]:8080")
    assert front.addresses == [("127.0.0.1", 8080), ("::1", 8080)] and front.address == ("127.0.0.1", 8080)
    assert parse_listens("8080") == [("127.0.0.1", 8080)]
    assert parse_listens("127.0.0.1:8080, 127.0.0.2:8080") == [("127.0.0.1", 8080), ("127.0.0.2", 8080)]
    for bad, why in (("127.0.0.1:8080,127.0.0.1:8080", "twice"), ("127.0.0.1:8080,[::1]:8081", "same port"),
                     ("127.0.0.1:8080,", "expected PORT")):
        with pytest.raises(ValidationError, match=why):
            FrontConfig(listen=bad)
    with pytest.raises(ValidationError, match="one address"):
        MetricsConfig(listen="127.0.0.1:9400,127.0.0.2:9400")


@pytest.mark.parametrize("flag", ["--models-dir", "--models-preset=/p.ini", "--models-max", "--no-models-autoload"])
def test_router_mode_is_refused_with_the_reason(flag: str) -> None:
    with pytest.raises(ValidationError, match="router mode"):
        ServerConfig(extra_args=[flag, "x"])


def test_a_missing_own_slot_save_path_is_a_problem_and_stays_missing(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    problem = own_slot_save_problem(ServerConfig(extra_args=["--slot-save-path", str(missing)]))
    assert "not a directory" in problem and str(missing) in problem and not missing.exists()
    afile = tmp_path / "file"
    afile.write_text("")
    assert "not a directory" in own_slot_save_problem(ServerConfig(extra_args=[f"--slot-save-path={afile}"]))
    assert own_slot_save_problem(ServerConfig(extra_args=["--slot-save-path", str(tmp_path)])) == ""
    assert own_slot_save_problem(ServerConfig()) == ""


def test_check_fails_a_missing_own_slot_save_path_and_says_nothing_without_one(tmp_path: Path) -> None:
    from llama_guard.config import Config
    from llama_guard.preflight.server import check_slot_save_path
    from llama_guard.vocab.verdicts import Verdict

    assert check_slot_save_path(Config()) == []
    (row,) = check_slot_save_path(Config(server=ServerConfig(extra_args=["--slot-save-path", str(tmp_path / "x")])))
    assert row.verdict is Verdict.FAIL and "not a directory" in row.detail and not (tmp_path / "x").exists()
    (row,) = check_slot_save_path(Config(server=ServerConfig(extra_args=["--slot-save-path", str(tmp_path)])))
    assert row.verdict is Verdict.OK
