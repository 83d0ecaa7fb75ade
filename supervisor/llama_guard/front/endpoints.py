"""What a client request to llama-server is, by its method and path: the inference endpoints.

One table for two rules of the front door: which answers can count as liveness progress
(:mod:`llama_guard.front.decoded`: only generations and embeddings, whose answers carry llama-server's
own token counts or vectors) and which requests may be sent again after a server died under them
(:func:`replayable`). Paths are llama-server's routes (``tools/server/server.cpp`` in llama.cpp:
the native ones and their OpenAI/Anthropic-compatible aliases); the query string is not part of the
path (``/slots?action=erase`` is ``/slots``).
"""

from __future__ import annotations

import enum

from aiohttp import hdrs


class Work(enum.Enum):
    """What an inference request makes llama-server compute."""

    GENERATION = "generation"  # prefill, then decode: the answer counts the tokens predicted
    EMBEDDING = "embedding"    # prefill only: the answer holds the vectors
    TEXT = "text"              # tokenizer / template work: no model evaluation


#: POST routes by what they compute. Everything else (``/slots``, ``/lora-adapters``, ``/props``, unknown
#: paths) may change the server's state or is not known: never replayed, never progress.
INFERENCE: dict[str, Work] = {
    **dict.fromkeys(("/completion", "/completions", "/v1/completions", "/chat/completions",
                     "/v1/chat/completions", "/infill", "/v1/messages"), Work.GENERATION),
    **dict.fromkeys(("/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
                     "/v1/reranking"), Work.EMBEDDING),
    **dict.fromkeys(("/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens"), Work.TEXT),
}
#: Methods that change nothing on the server by definition (RFC 9110, section 9.2.1): sent again safely.
SAFE_METHODS = frozenset({hdrs.METH_GET, hdrs.METH_HEAD})


def path_of(target: str) -> str:
    """The path of an origin-form request target (``/path?query`` → ``/path``)."""
    return target.split("?", 1)[0]


def work_of(method: str, target: str) -> Work | None:
    """What a request computes (None: no inference request: another method, or a path not in
    :data:`INFERENCE`)."""
    return INFERENCE.get(path_of(target)) if method == hdrs.METH_POST else None


def replayable(method: str, target: str) -> bool:
    """Whether a request that llama-server may have received before it died can be sent to the next
    server: a safe method, or a POST to an inference endpoint (it changes no server state but the
    slot's KV cache, which the next server does not have anyway)."""
    return method in SAFE_METHODS or work_of(method, target) is not None
