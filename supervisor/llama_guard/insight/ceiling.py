"""The decode speed ceiling: memory bandwidth ÷ bytes read per generated token.

Decoding one token reads every offloaded weight once, plus the KV cache up to the current context
(docs/insight.md): a 16 GB model on a ~900 GB/s V100 (NVIDIA's datasheet) cannot beat ~56 tokens/s.
The bandwidth is ``[gpu].memory_bandwidth_gbs`` when set, else NVML's memory bus width (bits) ÷ 8 ×
max memory clock (MHz) × 2 (double data rate): H200 6016 bit × 3201 MHz → 4.81 TB/s, V100 4096 bit ×
877 MHz → 898 GB/s. Units: bytes, bytes/s, tokens/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Below this efficiency a model is not limited by memory bandwidth: the report names what binds.
BANDWIDTH_BOUND_FRACTION = 0.2


def bandwidth_from_bus(bus_width_bits: int, mem_clock_mhz: int) -> float:
    """Peak memory bandwidth in bytes/s: ``bits / 8 × MHz × 1e6 × 2`` (DDR). Raises ValueError for a
    non-positive input."""
    if bus_width_bits <= 0 or mem_clock_mhz <= 0:
        raise ValueError(f"bus width {bus_width_bits} bit and memory clock {mem_clock_mhz} MHz must be positive")
    return bus_width_bits / 8 * mem_clock_mhz * 1e6 * 2


def ceiling_tokens_per_s(bandwidth_bytes_s: float, bytes_per_token: float) -> float:
    """The decode ceiling in tokens/s. Raises ValueError for a non-positive input."""
    if bandwidth_bytes_s <= 0 or bytes_per_token <= 0:
        raise ValueError("bandwidth and bytes per token must be positive")
    return bandwidth_bytes_s / bytes_per_token


@dataclass(frozen=True)
class Ceiling:
    """The ceiling of one configuration and how a measured speed compares with it.

    ``bandwidth`` bytes/s (None: unknown), ``source`` where it came from, ``bytes_per_token`` the
    weights + KV cache read per token, ``measured`` the median eval tokens/s (None: not measured).
    """

    bandwidth: float | None
    source: str
    weights_read: int
    kv_read: int
    context: int
    measured: float | None = None
    on_gpu: bool = True
    host_weights_read: int = 0
    """Weight bytes read from host memory per token besides the GPU's (the layers a partial offload
    leaves on the CPU): not in the ceiling, which is the GPU's alone."""

    @property
    def bytes_per_token(self) -> int:
        return self.weights_read + self.kv_read

    @property
    def tokens_per_s(self) -> float | None:
        """The ceiling (None when the bandwidth is unknown)."""
        if self.bandwidth is None or self.bytes_per_token <= 0:
            return None
        return ceiling_tokens_per_s(self.bandwidth, self.bytes_per_token)

    @property
    def efficiency(self) -> float | None:
        """measured ÷ ceiling (None when either is unknown)."""
        ceiling = self.tokens_per_s
        if ceiling is None or self.measured is None:
            return None
        return self.measured / ceiling

    @property
    def bandwidth_bound(self) -> bool | None:
        """Whether the measurement is close enough to the ceiling to call bandwidth the binding limit."""
        eff = self.efficiency
        return None if eff is None else eff >= BANDWIDTH_BOUND_FRACTION

    def verdict(self) -> str:
        """One human sentence: the ceiling, the efficiency, and which limit binds."""
        ceiling = self.tokens_per_s
        if ceiling is None:
            return (f"ceiling unknown: {self.source} (set [gpu].memory_bandwidth_gbs to compare); "
                    f"{self.bytes_per_token / 1e6:.0f} MB read per token")
        head = (f"ceiling {ceiling:,.0f} tokens/s = {self.bandwidth / 1e9:,.0f} GB/s ({self.source}) ÷ "  # type: ignore[operator]
                f"{self.bytes_per_token / 1e6:,.1f} MB per token (weights {self.weights_read / 1e6:,.1f} MB + "
                f"KV cache {self.kv_read / 1e6:,.1f} MB at {self.context} tokens)")
        if self.measured is None:
            return head
        eff = self.efficiency or 0.0
        if self.bandwidth_bound:
            return f"{head}; measured {self.measured:,.1f} tokens/s = {eff:.0%} of it: bandwidth-bound"
        per_token_ms = 1e3 / self.measured if self.measured > 0 else float("inf")
        read_ms = 1e3 / ceiling
        if self.host_weights_read and self.on_gpu:
            host_gbs = self.host_weights_read * self.measured / 1e9
            return (f"{head}; measured {self.measured:,.1f} tokens/s is far below it: not bound by the GPU's "
                    f"bandwidth. {self.host_weights_read / 1e6:,.0f} MB of weights stay in host memory and are "
                    f"read by the CPU each token ({host_gbs:,.1f} GB/s at this speed): the host's memory "
                    f"bandwidth and the CPU bind — offload more layers to move toward the ceiling")
        why = ("fixed per-token costs bind (kernel launches per layer, synchronisation, sampling and HTTP on the "
               "host) — typical of a small model; a bigger model moves toward the ceiling") if self.on_gpu else (
               "the CPU's arithmetic binds (threads × cores), not memory — or the stated bandwidth is optimistic")
        return (f"{head}; measured {self.measured:,.1f} tokens/s is far below it: not bandwidth-bound. "
                f"Each token takes {per_token_ms:.2f} ms, of which reading memory needs only {read_ms:.3f} ms: "
                f"{why}")

    def as_dict(self) -> dict[str, Any]:
        """JSON form (bytes, bytes/s, tokens/s)."""
        out = asdict(self)
        out.update(bytes_per_token=self.bytes_per_token, ceiling_tokens_per_s=self.tokens_per_s,
                   efficiency=self.efficiency, bandwidth_bound=self.bandwidth_bound,
                   binding_limit=None if self.bandwidth_bound is None else
                   ("memory bandwidth" if self.bandwidth_bound else
                    "host memory (layers on the CPU)" if self.on_gpu and self.host_weights_read else
                    "per-token overhead (launch/host)" if self.on_gpu else "CPU compute"),
                   verdict=self.verdict())
        return out
