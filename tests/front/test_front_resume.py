"""The resume of a cut stream, as a rule (pure): what the client was sent, the next request's body, and
every reason a stream cannot be continued exactly. Event shapes are llama-server's
(tools/server/server-task.cpp)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llama_guard.front.resume import Api, Transcript, continuation
from llama_guard.front.sse import is_comment
from llama_guard.vocab.server_flags import chat_prefill


def sse(*objs: object) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)


def native(text: str, n: int) -> dict[str, Any]:
    return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": n,
            "tokens_evaluated": 7}


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 1, "id": "chatcmpl-a",
            "model": "m", "object": "chat.completion.chunk"}


def text(piece: str) -> dict[str, Any]:
    return {"choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
            "object": "text_completion"}


def resumed(api: Api, request: dict[str, Any], stream: bytes, prefill: bool = True) -> dict[str, Any] | str:
    transcript = Transcript(api)
    transcript.feed(stream)
    out = continuation(api, json.dumps(request).encode(), transcript, chat_prefill=prefill)
    return out if isinstance(out, str) else json.loads(out)


def test_a_raw_prompt_gets_the_text_sent_as_its_own_piece_and_the_budget_less_its_tokens() -> None:
    # Tokens 3 and 4 were held back (they may begin a stop string), then sent with token 5: 5 tokens.
    stream = sse(native("Once", 1), native(" upon", 2), native("", 3), native("", 4), native(" a time", 5)) + b":\n\n"
    body = resumed(Api.NATIVE, {"prompt": "Tell me", "n_predict": 40, "stream": True, "temperature": 0}, stream)
    assert body == {"prompt": {"prompt_string": ["Tell me", "Once upon a time"]}, "n_predict": 35, "stream": True,
                    "temperature": 0}


def test_tokens_held_back_at_the_cut_are_generated_again() -> None:
    stream = sse(native("A", 1), native("", 2))  # token 2 held back, never sent
    body = resumed(Api.NATIVE, {"prompt": [1, 2, 3], "max_tokens": 10, "stream": True}, stream)
    assert body == {"prompt": [1, 2, 3, "A"], "max_tokens": 9, "stream": True}


def test_openai_completions_count_one_event_per_token() -> None:
    stream = sse(text("red"), text(""), text(", blue"), text(""))
    body = resumed(Api.COMPLETIONS, {"prompt": ["The colors:"], "max_tokens": 8, "stream": True}, stream)
    assert body == {"prompt": {"prompt_string": ["The colors:", "red, blue"]}, "max_tokens": 5, "stream": True}


def test_a_chat_gets_the_text_sent_back_as_the_start_of_the_assistants_message() -> None:
    stream = sse(chunk({"role": "assistant", "content": None}), chunk({"content": "The"}), chunk({"content": " sea"}))
    request = {"messages": [{"role": "user", "content": "A poem"}], "max_completion_tokens": 20, "stream": True}
    body = resumed(Api.CHAT, request, stream)
    assert isinstance(body, dict)
    assert body["messages"] == [{"role": "user", "content": "A poem"}, {"role": "assistant", "content": "The sea"}]
    assert body["max_completion_tokens"] == 18
    # said outright: llama-server's stream then leaves out the text given back (it would send it again)
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False


def test_a_chat_with_its_own_prefill_is_continued_after_it() -> None:
    request = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2"}],
               "stream": True}
    body = resumed(Api.CHAT, request, sse(chunk({"content": ", 3"})))
    assert isinstance(body, dict) and body["messages"][-1] == {"role": "assistant", "content": "1, 2, 3"}
    assert "max_tokens" not in body  # no budget given: none made up


def test_nothing_generated_yet_sends_the_same_request_again() -> None:
    request = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 5}
    raw = json.dumps(request).encode()
    transcript = Transcript(Api.CHAT)
    transcript.feed(sse(chunk({"role": "assistant", "content": None})))
    assert continuation(Api.CHAT, raw, transcript, chat_prefill=True) == raw


@pytest.mark.parametrize(("api", "request_", "stream", "why"), [
    (Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True}, b"", "logprobs"),
    (Api.NATIVE, {"prompt": "x", "stream": True, "n_probs": 3}, b"", "logprobs"),
    (Api.COMPLETIONS, {"prompt": "x", "stream": True, "n": 2}, b"", "n > 1"),
    (Api.NATIVE, {"prompt": "x", "stream": True, "n_cmpl": 2}, b"", "n_cmpl > 1"),
    (Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                "tools": [{"type": "function", "function": {"name": "f"}}]}, b"", "tools"),
    (Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}, sse(chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]})), "tool call"),
    (Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}, sse(chunk(
        {"reasoning_content": "Let me think"})), "reasoning"),
    (Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                "response_format": {"type": "json_object"}}, b"", "JSON schema"),
    (Api.NATIVE, {"prompt": "x", "stream": True, "grammar": "root ::= \"a\""}, b"", "grammar"),
    (Api.NATIVE, {"prompt": ["a", "b"], "stream": True}, sse(native("y", 1)), "several prompts"),
    (Api.NATIVE, {"prompt": "x", "stream": True}, sse(native("y", 1)) + b'data: {"content": "z"', "inside an event"),
    (Api.NATIVE, {"prompt": "x", "stream": True}, sse({"content": "", "stop": True}), "last event"),
    (Api.NATIVE, {"prompt": "x", "stream": True}, b'data: {"error": {"code": 500}}\n\n', "error event"),
    (Api.COMPLETIONS, {"prompt": "x", "stream": True, "echo": True}, b"", "echoes"),
    (Api.NATIVE, {"prompt": "x", "stream": True, "n_predict": 2}, sse(native("a", 1), native("b", 2)), "budget"),
], ids=["chat-logprobs", "n_probs", "n", "n_cmpl", "tools", "tool-call-half-sent", "reasoning", "json", "grammar",
        "several-prompts", "cut-inside-an-event", "complete", "error-event", "echo", "budget-spent"])
def test_a_stream_that_cannot_be_continued_exactly_says_why(api: Api, request_: dict[str, Any], stream: bytes,
                                                             why: str) -> None:
    reason = resumed(api, request_, stream)
    assert isinstance(reason, str) and why in reason, reason


def test_a_chat_is_not_continued_by_a_server_without_the_prefill() -> None:
    reason = resumed(Api.CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True},
                     sse(chunk({"content": "y"})), prefill=False)
    assert isinstance(reason, str) and "--no-prefill-assistant" in reason
    assert chat_prefill([], {}) and chat_prefill(["--jinja"], {"LLAMA_ARG_JINJA": "1"})
    assert not chat_prefill(["--no-prefill-assistant"], {})
    assert not chat_prefill([], {"LLAMA_ARG_JINJA": "off"})
    assert not chat_prefill([], {"LLAMA_ARG_PREFILL_ASSISTANT": "false"})


def test_kept_bytes_are_read_and_dropped_as_they_pile_up() -> None:
    transcript = Transcript(Api.NATIVE)
    for i in range(5000):
        transcript.feed(sse(native("ab", i + 1)))
    assert len(transcript._pending) < 65536
    transcript.settle()
    assert transcript.text == "ab" * 5000 and transcript.tokens == 5000


def test_sse_comments_are_no_event() -> None:
    assert is_comment(b":\n\n") and is_comment(b": ping\r\n\r\n")
    assert not is_comment(b":\n\ndata: {}\n\n") and not is_comment(b"data: {}\n\n") and not is_comment(b"")
