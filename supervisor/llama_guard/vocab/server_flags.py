"""llama-server's flags as llama-guard treats them: the ones it sets itself from typed keys, the ones
whose value is a secret, the KV cache types that are quantized. Pure lists, read by the
configuration's validators and by the argv builder."""

from __future__ import annotations

import re
from typing import Literal

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
QUANTIZED_CACHE_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})

# Flags llama-guard sets itself from typed keys; extra_args may not repeat them.
OWNED_FLAGS = frozenset({
    "-m", "--model", "--host", "--port", "-ngl", "--gpu-layers", "--n-gpu-layers", "-c", "--ctx-size",
    "-np", "--parallel", "-b", "--batch-size", "-ub", "--ubatch-size", "-ctk", "--cache-type-k",
    "-ctv", "--cache-type-v", "-fa", "--flash-attn", "-t", "--threads", "-tb", "--threads-batch",
    "--mlock", "--api-key-file",
})
# Endpoint switches llama-guard sets itself for its own probes (--metrics, --slots): in extra_args they
# say what the user's clients may see, which the front door answers as llama-server would under them
# (argv.user_endpoints); they never reach llama-server's argv from extra_args.
ENDPOINT_FLAGS = frozenset({"--metrics", "--slots", "--no-slots"})
# Environment variables of the same switches (llama.cpp common/arg.cpp; a command-line flag wins).
METRICS_ENV = "LLAMA_ARG_ENDPOINT_METRICS"
SLOTS_ENV = "LLAMA_ARG_ENDPOINT_SLOTS"
# llama-server's router mode (no --model: one child llama-server per model, started on demand): llama-guard
# supervises one server on one model and cannot run it.
ROUTER_FLAGS = frozenset({"--models-dir", "--models-max", "--models-preset", "--no-models-autoload",
                          "--models-autoload"})
# Flags whose value is a secret: refused in extra_args, since a secret in llama-server's argv shows
# in events, journald, status.json and `ps`; the key belongs in [server].api_key_file.
SECRET_FLAGS = frozenset({"--api-key", "--hf-token", "-hft"})
# [server].env names that carry secrets the same way (LLAMA_API_KEY, HF_TOKEN, LLAMA_ARG_API_KEY ...).
SECRET_NAME = re.compile(r"(^|_)(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD)(_|$)", re.IGNORECASE)


def is_secret_env(name: str) -> bool:
    """Whether an environment variable (or flag) named ``name`` carries a secret by its name."""
    return SECRET_NAME.search(name.replace("-", "_")) is not None


# Switches that keep llama-server from continuing a trailing assistant message (its assistant prefill,
# on by default), with the environment variables that set them (llama.cpp's common/arg.cpp).
_NO_PREFILL_FLAGS = frozenset({"--no-prefill-assistant", "--no-jinja"})
_PREFILL_ENV = ("LLAMA_ARG_PREFILL_ASSISTANT", "LLAMA_ARG_JINJA")
_FALSEY = frozenset({"off", "disabled", "false", "0"})  # common_arg_utils::is_falsey


def chat_prefill(extra_args: list[str], env: dict[str, str]) -> bool:
    """Whether llama-server, started with ``extra_args`` and ``env``, continues a chat whose last
    message is the assistant's (the prefill: Jinja templates on, ``--prefill-assistant`` not turned off)."""
    if any(arg in _NO_PREFILL_FLAGS for arg in extra_args):
        return False
    return not any(env.get(name, "").strip().lower() in _FALSEY for name in _PREFILL_ENV)
