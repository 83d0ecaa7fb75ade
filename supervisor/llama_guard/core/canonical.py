"""What a request makes llama-server compute, as bytes: the canonical form a crash fingerprint hashes.

A request that crashes llama-server crashes it again when sent with another sampling seed, other
whitespace, another client id or with ``stream`` flipped: none of these changes the code the server runs
up to the crash (the template, the tokenizer, the grammar or schema, the image, the prefill). The
fingerprint (:class:`llama_guard.core.suspects.Fingerprint`) must see through them, else each variant
is a new request and costs crashes of its own. The rule, pure:

- The route: llama-server's aliases of one handler are one route (:data:`ROUTES`: ``/completions`` is
  ``/completion``, ``/v1/chat/completions`` is ``/chat/completions``, …). The query string of a POST to
  an inference route is dropped (those handlers read no query parameter); any other target is kept whole.
- A body that is a JSON object (up to its whole size) is parsed, the top-level keys of
  :data:`IGNORED_KEYS` are dropped (fields that name, route or deliver the request, and the sampling seed), every
  string is taken with its runs of whitespace as one space and no whitespace at either end, a float
  with an integral value is that integer (``0.0`` is ``0``), and it is written back with sorted keys
  and no spacing: key order and the JSON's own formatting do not count either.
- Any other body (not JSON, not an object, invalid UTF-8) is its bytes as they came.

Kept, because they change what is computed: the prompt or messages (but for whitespace), the sampling
parameters (temperature, top-k, …: the sampler chain runs on each token), ``n_probs``/``logprobs``/
``top_logprobs`` (llama-server copies and sorts the logits before sampling for them: a code path of its
own), ``n_predict``/``max_tokens`` (how far the decode goes), ``cache_prompt`` (whether the prefix is
evaluated again), grammars, schemas, tools, images, LoRA choices and every unknown key.
"""

from __future__ import annotations

import json
from typing import Any

#: llama-server's routes that share one handler (tools/server/server.cpp), by the route they are known as.
ROUTES: dict[str, str] = {
    "/completions": "/completion",
    "/v1/chat/completions": "/chat/completions",
    "/v1/responses": "/responses",
    "/v1/audio/transcriptions": "/audio/transcriptions",
    "/embeddings": "/embedding",
    "/reranking": "/rerank", "/v1/rerank": "/rerank", "/v1/reranking": "/rerank",
    "/v1/chat/completions/input_tokens": "/chat/completions/input_tokens",
    "/v1/responses/input_tokens": "/responses/input_tokens",
}
#: POST routes whose handlers read no query parameter (after :data:`ROUTES`).
NO_QUERY = frozenset({"/completion", "/v1/completions", "/chat/completions", "/responses", "/infill",
                      "/v1/messages", "/embedding", "/v1/embeddings", "/rerank", "/tokenize", "/detokenize",
                      "/apply-template", "/v1/messages/count_tokens"})
#: Top-level body keys that do not change what llama-server computes up to a crash: how the answer is
#: delivered (``stream``, ``stream_options``, ``timings_per_token``, ``return_progress``,
#: ``return_tokens``), who asks and under which id (``user``, ``metadata``, ``store``, ``id``,
#: ``request_id``, ``client_id``, ``id_slot``: the slot is any slot), and the sampling seed (which numbers
#: the sampler draws, not which code runs).
IGNORED_KEYS = frozenset({"stream", "stream_options", "timings_per_token", "return_progress", "return_tokens",
                          "user", "metadata", "store", "id", "request_id", "client_id", "id_slot", "seed"})


def route(method: str, target: str) -> str:
    """The request target as the fingerprint knows it (``target``: origin form, path and query)."""
    path, sep, query = target.partition("?")
    path = ROUTES.get(path, path)
    if method == "POST" and path in NO_QUERY:
        return path
    return f"{path}{sep}{query}"


def canonical_body(body: bytes) -> bytes:
    """The bytes a fingerprint hashes for ``body`` (the rule in the module's docstring)."""
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            return body
        kept = {key: _plain(item) for key, item in value.items() if key not in IGNORED_KEYS}
        return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return body


def _plain(value: Any) -> Any:
    """``value`` with whitespace runs of its strings as one space (ends stripped), integral floats as ints."""
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
