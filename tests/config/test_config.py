"""Configuration: the shipped file, environment overrides and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llama_guard.config import Config, ConfigError, load_config
from llama_guard.config.argv import build_argv
from llama_guard.host.paths import DEFAULT_CONFIG_PATH, resolve_config_path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "etc" / "llama-guard.toml"


pytestmark = pytest.mark.usefixtures("clean_env")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lg.toml"
    path.write_text(text)
    return path


def test_shipped_config_is_the_16_gb_setup() -> None:
    c = load_config(SHIPPED)
    s = c.server
    assert (s.n_gpu_layers, s.ctx_size, s.parallel, s.batch_size, s.ubatch_size) == (56, 8192, 1, 512, 256)
    assert (s.cache_type_k, s.cache_type_v, s.flash_attn, s.threads) == ("q8_0", "q8_0", "on", 8)
    assert s.env == {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "8"}
    assert (s.host, s.port) == ("127.0.0.1", 8081)  # private: clients keep 8080 at the front door
    assert c.front.address == ("127.0.0.1", 8080)


def test_shipped_config_comments_every_key() -> None:
    lines = SHIPPED.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip("# ").strip()
        if "=" in stripped and not line.startswith("#") and not stripped.startswith("["):
            assert lines[i - 1].startswith("#"), f"key without a comment: {line}"


def test_shipped_config_lists_every_key() -> None:
    text = SHIPPED.read_text()
    for section, model in Config.model_fields.items():
        assert f"[{section}]" in text, section
        sub = model.annotation
        assert sub is not None
        for key in sub.model_fields:  # type: ignore[union-attr]
            assert f"\n{key} =" in text or f"\n# {key} =" in text or f"[{section}.{key}]" in text, \
                f"{section}.{key} is not documented in etc/llama-guard.toml"


def test_argv_of_the_shipped_config_uses_current_flags() -> None:
    argv = build_argv(load_config(SHIPPED).server)
    assert "--no-flash-attn" not in argv
    assert argv[argv.index("--flash-attn") + 1] == "on"
    assert argv[argv.index("--cache-type-v") + 1] == "q8_0"
    assert "--metrics" in argv


def test_env_override_wins_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[server]\nport = 9000\nmodel = "/m.gguf"\n')
    monkeypatch.setenv("LLAMA_GUARD_SERVER__PORT", "8001")
    c = load_config(path)
    assert c.server.port == 8001 and str(c.server.model) == "/m.gguf"


def test_path_resolution() -> None:
    assert resolve_config_path("/a.toml", {"LLAMA_GUARD_CONFIG": "/b.toml"}) == Path("/a.toml")
    assert resolve_config_path(None, {"LLAMA_GUARD_CONFIG": "/b.toml"}) == Path("/b.toml")
    assert resolve_config_path(None, {}) == DEFAULT_CONFIG_PATH


@pytest.mark.parametrize(("text", "key", "reason"), [
    ("[server]\nport = 70000\n", "server.port", "less than or equal to 65535"),
    ("[server]\nbogus = 1\n", "server.bogus", "unknown key"),
    ("[nonsense]\na = 1\n", "nonsense", "unknown key"),
    ("[server]\ncache_type_k = 'q9'\n", "server.cache_type_k", "q8_0"),
    ("[server]\nflash_attn = 'off'\n", "server", "flash attention"),
    ("[server]\nbatch_size = 128\nubatch_size = 256\n", "server", "ubatch_size (256) must not exceed"),
    ("[server]\nextra_args = ['--port', '1']\n", "server", "repeats '--port'"),
    ("[server]\nenv = {NOTIFY_SOCKET = '/x'}\n", "server", "NOTIFY_SOCKET"),
    ("[health]\ninterval_s = 0\n", "health.interval_s", "greater than 0"),
    ("[recovery]\nreset_command = []\n", "recovery.reset_command", "non-empty"),
    ("[recovery]\nreset_on = ['sometimes']\n", "recovery.reset_on", "gpu_lost"),
    ("[gpu]\nforeign_processes = 'kill'\n", "gpu.foreign_processes", "warn"),
    # a path goes into text log lines: a control character would forge one
    ('[server]\nbinary = "/opt/llama-server\\n12:00:00 server_ready forged"\n', "server", "control character '\\n'"),
    ('[server]\nmodel = "/m/\\u001b[31mred.gguf"\n', "server", "control character '\\x1b'"),
    ('[server]\napi_key_file = "/etc/key\\n12:00:00 server_ready forged"\n', "server", "control character '\\n'"),
    ('[server]\nbinary = "/opt/llama-server\\u009b2J"\n', "server", "control character '\\x9b'"),  # C1 CSI
    ('[runtime]\ndir = "/run/lg\\u001b]0;owned\\u0007"\n', "runtime.dir", "control character '\\x1b'"),
    ('[slots]\ndir = "/var/lib/slots\\r12:00:00 forged"\n', "slots.dir", "control character '\\r'"),
])
def test_bad_value_names_file_key_and_reason(tmp_path: Path, text: str, key: str, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(line.startswith(f"{path}: {key}") and reason in line for line in info.value.lines), info.value.lines


def test_bad_env_override_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_GUARD_SERVER__PORT", "eighty")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""))
    assert "$LLAMA_GUARD_SERVER__PORT" in info.value.lines[0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.lines == [f"{tmp_path / 'nope.toml'}: no such file"]


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path)


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 2"):
        load_config(write(tmp_path, "[server]\nport = = 1\n"))


@pytest.mark.parametrize("verb", ["run", "check"])
def test_cli_exits_78_with_one_clear_line(tmp_path: Path, verb: str) -> None:
    path = write(tmp_path, "[server]\nport = 'x'\n")
    out = subprocess.run([sys.executable, "-m", "llama_guard", verb, "--config", str(path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 78
    assert out.stderr.strip().splitlines() == [
        f"llama-guard: config error: {path}: server.port: Input should be a valid integer, "
        "unable to parse string as an integer (got 'x')"]


@pytest.mark.parametrize("verb", ["run", "check"])
def test_cli_without_a_config_file_says_how_to_name_one(tmp_path: Path, verb: str) -> None:
    """No --config and the default (here $LLAMA_GUARD_CONFIG) missing: exit 78, and a second line
    names the two ways to give the file; with --config naming a missing file, the first line alone."""
    missing = tmp_path / "nope.toml"
    env = {**os.environ, "LLAMA_GUARD_CONFIG": str(missing)}
    out = subprocess.run([sys.executable, "-m", "llama_guard", verb], capture_output=True, text=True, timeout=60,
                         check=False, env=env)
    assert out.returncode == 78
    assert out.stderr.strip().splitlines() == [
        f"llama-guard: config error: {missing}: no such file",
        "llama-guard: name another file with --config PATH or $LLAMA_GUARD_CONFIG (the shipped one is "
        "etc/llama-guard.toml)"]
    named = subprocess.run([sys.executable, "-m", "llama_guard", verb, "--config", str(missing)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert named.returncode == 78 and len(named.stderr.strip().splitlines()) == 1


SECRET = "sk-lg-0123456789abcdef"


@pytest.mark.parametrize("extra", [
    ["--api-key", SECRET], [f"--api-key={SECRET}"], ["--hf-token", SECRET], [f"--hf-token={SECRET}"],
    ["-hft", SECRET], ["--no-webui", "--api-key", SECRET],
])
def test_secret_flags_in_extra_args_are_refused(tmp_path: Path, extra: list[str]) -> None:
    path = write(tmp_path, f'[server]\nextra_args = {json.dumps(extra)}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "api_key_file" in text and SECRET not in text, text


@pytest.mark.parametrize("name", ["LLAMA_API_KEY", "HF_TOKEN", "LLAMA_ARG_API_KEY", "HUGGING_FACE_HUB_TOKEN",
                                  "OPENAI_APIKEY", "MY_SECRET", "DB_PASSWORD", "llama_api_key"])
def test_secret_env_names_are_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, f'[server.env]\n{name} = "{SECRET}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert name in text and "api_key_file" in text and SECRET not in text, text


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "KEYBOARD"])
def test_ordinary_env_names_pass(tmp_path: Path, name: str) -> None:
    assert load_config(write(tmp_path, f'[server.env]\n{name} = "1"\n')).server.env == {name: "1"}


def test_api_key_file_is_a_typed_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_key_file"):
        load_config(write(tmp_path, '[server]\nextra_args = ["--api-key-file", "/etc/k"]\n'))
    c = load_config(write(tmp_path, '[server]\napi_key_file = "/etc/llama-guard/api-key"\n'))
    argv = build_argv(c.server)
    assert argv[argv.index("--api-key-file") + 1] == "/etc/llama-guard/api-key"


def test_read_api_key(tmp_path: Path) -> None:
    from llama_guard.config.api_key import read_api_key
    from llama_guard.config.server import ServerConfig

    assert read_api_key(ServerConfig()) == ""
    key = tmp_path / "k"
    key.write_text("# comment\n\nfirst-key\nsecond\n")
    assert read_api_key(ServerConfig(api_key_file=str(key))) == "first-key"
    for bad in (" padded\n", "two words\n", "ok\ntab\there\n", "caf\u00e9\n"):
        key.write_text(bad)
        with pytest.raises(ConfigError, match="printable ASCII") as info:
            read_api_key(ServerConfig(api_key_file=str(key)))
        assert bad.strip().split()[-1] not in str(info.value)
    key.write_text("# only a comment\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_api_key(ServerConfig(api_key_file=str(key)))
    with pytest.raises(ConfigError, match="cannot read"):
        read_api_key(ServerConfig(api_key_file=str(tmp_path / "missing")))


@pytest.mark.parametrize(("server", "words"), [
    ({"user": "bad name"}, "not a user/group name"), ({"group": "video"}, "need user"),
    ({"supplementary_groups": ["video"]}, "need user"), ({"user": "x", "supplementary_groups": ["a b"]}, "not a group"),
])
def test_bad_accounts(tmp_path: Path, server: dict[str, object], words: str) -> None:
    from harness import config_text

    with pytest.raises(ConfigError, match=words):
        load_config(write(tmp_path, config_text({"server": server})))


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                                ("10.0.0.5", False), ("gpu-box.example", False)])
def test_loopback(host: str, loopback: bool) -> None:
    from llama_guard.config.server import ServerConfig

    assert ServerConfig(host=host).loopback is loopback
