"""``[tune]``: the floors and the budget of ``llama-guard tune`` (the search for the fastest
``[server]`` flags that fit the GPU). Sizes in MiB, context in tokens."""

from __future__ import annotations

from pydantic import Field, model_validator

from llama_guard.config.base import Section
from llama_guard.vocab.server_flags import CacheType

# The KV cache types the write-up kept: q4_0 was faster but hurt quality.
DEFAULT_CACHE_TYPES: tuple[CacheType, ...] = ("f16", "q8_0")


class TuneConfig(Section):
    """``[tune]``: what the tuner may change and how it measures.

    ``vram_margin_mib`` is kept free below the VRAM available when a candidate is priced by
    ``check``'s VRAM model (the estimate is ±10 %); ``min_ctx_size`` the smallest context it may
    choose (tokens; a smaller context refuses longer conversations); ``cache_types`` the KV cache
    types it may choose (q4_0 costs quality: only when listed); ``max_parallel`` the most slots
    (None: the configured ``[server].parallel``), ``min_parallel`` the fewest; ``binaries`` other
    llama-server builds to try (a build option such as MMQ cannot be set by a flag); ``runs`` and
    ``tokens`` the completions per measurement and the tokens each generates."""

    vram_margin_mib: int = Field(512, ge=0)
    min_ctx_size: int = Field(8192, ge=256)
    cache_types: list[CacheType] = Field(default_factory=lambda: list(DEFAULT_CACHE_TYPES), min_length=1)
    min_parallel: int = Field(1, ge=1, le=256)
    max_parallel: int | None = Field(None, ge=1, le=256)
    binaries: list[str] = Field(default_factory=list)
    runs: int = Field(5, ge=2, le=50)
    tokens: int = Field(256, ge=8, le=4096)

    @model_validator(mode="after")
    def _consistent(self) -> TuneConfig:
        if self.max_parallel is not None and self.max_parallel < self.min_parallel:
            raise ValueError(f"max_parallel ({self.max_parallel}) is below min_parallel ({self.min_parallel})")
        for binary in self.binaries:
            if not binary or "\0" in binary:
                raise ValueError("binaries: each entry names a llama-server executable")
        return self
