"""Resuming a stream of generated text that a server's end cut mid-way (pure: no I/O).

A client's stream that had begun (its first event went out) and was cut by llama-server's end is
continued by the next server: the request is sent again with the text the client already has given
back — appended to the raw prompt (``/completion``, ``/completions``, ``/v1/completions``), or as the
start of the assistant's message (``/chat/completions``, ``/v1/chat/completions``: a trailing assistant
message continued, not closed, with ``continue_final_message``) — and the token budget
(``n_predict`` / ``max_tokens`` / ``max_completion_tokens``) less the tokens that text took. At
temperature 0 the continuation is the uncut answer's rest.

:class:`Transcript` reads what the client was sent, event by event (text, tokens, what forbids a
resume); :func:`continuation` builds the next request's body from the client's, or says why the
stream cannot be resumed exactly. Shapes: llama.cpp's ``tools/server/server-task.cpp``
(``server_task_result_cmpl_partial::to_json_*``), ``server-common.cpp``
(``oaicompat_chat_params_parse``: the prefill; ``tokenize_input_subprompt``, ``tokenize_mixed``: a
prompt of several pieces, each tokenized on its own, so that the text sent keeps the token boundary
it had after the prompt), ``server-context.cpp`` (``process_token``: one event per token, text held
back while it may begin a stop string; a native event's ``tokens_predicted``).
"""

from __future__ import annotations

import enum
import json
from typing import Any

DIGEST_BYTES = 65536  # the stream's bytes kept before they are read for their text (then dropped)


class Api(enum.Enum):
    """The shape of a generation endpoint's stream."""

    NATIVE = "native"        # /completion: {"content", "tokens_predicted", "stop"}
    COMPLETIONS = "completions"  # OpenAI /v1/completions: {"choices": [{"text"}]}
    CHAT = "chat"            # OpenAI chat: {"choices": [{"delta": {"content"}}]}


#: The endpoints whose streams can be resumed, by path.
API_OF: dict[str, Api] = {"/completion": Api.NATIVE, "/completions": Api.NATIVE, "/v1/completions": Api.COMPLETIONS,
                          "/chat/completions": Api.CHAT, "/v1/chat/completions": Api.CHAT}
BUDGET_KEYS = ("n_predict", "max_tokens", "max_completion_tokens")


class Transcript:
    """What the client was sent of one stream of ``api`` (across resumes): :attr:`text`, the tokens
    it took (:attr:`tokens`), and :attr:`blocker`, the first reason found in the events why the rest
    cannot be generated exactly (None: none). Bytes are kept until :data:`DIGEST_BYTES` pile up, then
    read and dropped: what stays is the text and a partial event."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self._pending = bytearray()
        self._parts: list[str] = []
        self.tokens = 0
        self.blocker: str | None = None
        self._base = 0  # tokens sent before the current server's stream (native counts restart per server)
        self._events = 0  # text events of the current server's stream (OpenAI shapes: one per token)

    def feed(self, chunk: bytes) -> None:
        """The next bytes relayed to the client."""
        self._pending += chunk
        if len(self._pending) >= DIGEST_BYTES:
            self._digest()

    @property
    def text(self) -> str:
        """The generated text the client holds (read after :meth:`settle`)."""
        return "".join(self._parts)

    def settle(self) -> None:
        """Read every complete event; a partial one left over (the cut fell inside an event the client
        holds half of) is a blocker."""
        self._digest()
        if self._pending.strip():
            self.blocker = self.blocker or "the cut fell inside an event, which the client holds half of"

    def resumed(self) -> None:
        """The next server's stream continues this one: its own counts start again."""
        self._base, self._events = self.tokens, 0
        self._pending.clear()

    def _digest(self) -> None:
        end = self._pending.rfind(b"\n\n")
        if end < 0:
            return
        block, self._pending = bytes(self._pending[:end]), self._pending[end + 2:]
        for event in block.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]" or not payload:
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.blocker = self.blocker or "an event was not JSON"
            return
        if not isinstance(obj, dict):
            self.blocker = self.blocker or "an event was not a JSON object"
            return
        if "error" in obj:
            self.blocker = self.blocker or "llama-server sent an error event"
            return
        if self.api is Api.NATIVE:
            self._native(obj)
        else:
            self._openai(obj)

    def _native(self, obj: dict[str, Any]) -> None:
        if obj.get("stop"):
            self.blocker = self.blocker or "the answer's last event had been sent"
            return
        text = obj.get("content")
        if isinstance(text, str) and text:
            self._parts.append(text)
            predicted = obj.get("tokens_predicted")
            self.tokens = self._base + predicted if isinstance(predicted, int) else self.tokens + 1

    def _openai(self, obj: dict[str, Any]) -> None:
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            if "usage" in obj:
                self.blocker = self.blocker or "the answer's last event had been sent"
            return
        if len(choices) != 1 or not isinstance(choices[0], dict):
            self.blocker = self.blocker or "the stream holds several choices"
            return
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.blocker = self.blocker or "the answer's last event had been sent"
            return
        if choice.get("logprobs"):
            self.blocker = self.blocker or "the events carry logprobs"
        if self.api is Api.COMPLETIONS:
            text = choice.get("text")
            self._events += 1  # one event per token, its text held back while it may begin a stop string
            if isinstance(text, str) and text:
                self._parts.append(text)
                self.tokens = self._base + self._events
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if delta.get("tool_calls"):
            self.blocker = self.blocker or "a tool call was being streamed (its arguments half sent)"
        if delta.get("reasoning_content"):
            self.blocker = self.blocker or "the model's reasoning was being streamed"
        text = delta.get("content")
        if isinstance(text, str) and text:
            self._parts.append(text)
            self.tokens += 1


def continuation(api: Api, body: bytes, transcript: Transcript, *, chat_prefill: bool) -> bytes | str:
    """The body that makes the next server continue the stream ``transcript`` read, for the client's
    request ``body`` (JSON) to an endpoint of ``api``; or, as a ``str``, why the stream cannot be
    resumed exactly. ``chat_prefill``: llama-server continues a trailing assistant message (its
    default; not with ``--no-prefill-assistant`` or ``--no-jinja``)."""
    transcript.settle()
    if transcript.blocker is not None:
        return transcript.blocker
    try:
        request = json.loads(body)
    except ValueError:
        return "the request body is not JSON"
    if not isinstance(request, dict):
        return "the request body is not a JSON object"
    reason = _refusal(api, request, chat_prefill)
    if reason is not None:
        return reason
    text = transcript.text
    if not text:
        return body  # nothing generated reached the client: the same request again
    out = dict(request)
    if api is Api.CHAT:
        messages = list(request["messages"])
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            content = last.get("content")
            if not isinstance(content, str):
                return "the request's own assistant prefill is not plain text"
            messages[-1] = {**last, "content": content + text}
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        # Said outright (not left to the prefill llama-server infers from a trailing assistant message):
        # only then does its stream leave out the text given back (task_result_state, is_continuation).
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = _prompt(request.get("prompt"), text)
        if isinstance(prompt, str):
            return prompt
        out["prompt"] = prompt["prompt"]
    for key in BUDGET_KEYS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            if value <= transcript.tokens:  # llama-server predicts one token even for a budget of 0
                return "the answer's token budget was spent: only its last event was missing"
            out[key] = value - transcript.tokens
    return json.dumps(out, ensure_ascii=False).encode()


def _refusal(api: Api, request: dict[str, Any], chat_prefill: bool) -> str | None:
    """Why this request's stream cannot be continued exactly (None: it can)."""
    if request.get("stream") is not True:
        return "the request is not a stream"
    for key in ("n", "n_cmpl"):
        if isinstance(request.get(key), int) and request[key] > 1:
            return f"{key} > 1: several answers share the stream"
    if request.get("logprobs") or request.get("top_logprobs") or request.get("n_probs"):
        return "the answer carries logprobs, which the resumed part would compute from another context"
    if request.get("grammar") or request.get("json_schema") or _constrained(request.get("response_format")):
        return "a grammar or JSON schema constrains the answer from its start"
    if request.get("echo"):
        return "the answer echoes the prompt"
    if api is Api.CHAT:
        if request.get("tools") and request.get("tool_choice") != "none":
            return "the request offers tools: a tool call may have been half sent"
        if not chat_prefill:
            return ("llama-server runs with --no-prefill-assistant or --no-jinja: the text sent cannot be given "
                    "back as the start of the assistant's message")
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return "the request has no messages"
    return None


def _constrained(response_format: object) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") not in (None, "text")


def _prompt(prompt: object, text: str) -> dict[str, object] | str:
    """The raw prompt followed by ``text``, each tokenized on its own (``{"prompt": ...}``), or why not."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": {"prompt_string": [prompt, text]}}
    if isinstance(prompt, list) and prompt and any(isinstance(p, int) and not isinstance(p, bool) for p in prompt) \
            and all(isinstance(p, (int, str)) and not isinstance(p, bool) for p in prompt):
        return {"prompt": [*prompt, text]}  # token ids (and strings): one prompt
    return "the prompt is not one text or one list of tokens (several prompts, or multimodal data)"
