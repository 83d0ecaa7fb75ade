"""llama-guard's own short requests to llama-server's inference endpoints: one per endpoint clients use
most (path and JSON body, a token or two of output). An upgrade's trial sends the first (its decode-speed
measurement, on the chat endpoint, does not reach the native ``/completion``); a run of client HTTP 5xx on a
build on probation is confirmed — or not — by all of them (:mod:`llama_guard.upgrade.watcher`): a client's
input that the server rejects with 500 fails llama-guard's requests no more than it would fail the last
good build."""

from __future__ import annotations

from llama_guard.core.client import Answer, ServerClient

NATIVE_PATH = "/completion"  # llama-server's native endpoint
CHAT_PATH = "/v1/chat/completions"

#: (path, JSON body) of each request, in the order they are sent.
OWN_REQUESTS: tuple[tuple[str, dict[str, object]], ...] = (
    (NATIVE_PATH, {"prompt": "Hello", "n_predict": 1, "temperature": 0}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0}),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "temperature": 0}),
)


def answer_problem(path: str, answer: Answer) -> str:
    """"" for a 2xx ``answer`` to ``POST path``, else what it answered (status and the start of its body)."""
    if 200 <= answer.status < 300:
        return ""
    return f"POST {path} answered HTTP {answer.status}: {' '.join(answer.text.split())[:300]}"


async def own_requests_failure(client: ServerClient, timeout_s: float) -> str:
    """Each of :data:`OWN_REQUESTS` sent with ``client`` (each within ``timeout_s`` seconds): "" when every
    one answered 2xx, else what the first that did not answered. Raises :class:`RequestFailed` when one
    got no complete answer (a server that does not answer is the liveness watch's to judge)."""
    for path, body in OWN_REQUESTS:
        problem = answer_problem(path, await client.post(path, json=body, timeout_s=timeout_s))
        if problem:
            return problem
    return ""

