"""Classification of llama-server's log lines into failure families.

One ordered table of patterns → families (docs/llama-server.md names the llama.cpp sources). Patterns match the text
anywhere in a line, never a position: lines come with or without the elapsed/level prefix
(``0.00.450.903 I srv ...``), with or without a ``[pid]`` prefix, and the logger's lines can
interleave with an abort's direct stderr writes inside one physical line. The first matching
row wins, so the more specific families (OOM) sit above the general ones (GPU error, boot).
Unknown lines are harmless.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass


class Family(enum.Enum):
    """What one log line says about the server."""

    HARMLESS = "harmless"
    OOM = "oom"                        # out of GPU memory, at load or at run time
    GPU_FATAL = "gpu_fatal"            # fatal GPU runtime error other than OOM
    # The kernel's launch watchdog ended one of the server's kernels (one channel, not the GPU):
    # restart the server, never reset the GPU.
    GPU_WATCHDOG = "gpu_watchdog"
    DEVICE_LOST = "device_lost"        # the backend lost its device (Vulkan's ErrorDeviceLost)
    GPU_ABORT = "gpu_abort"            # the "<file>.cu:<line>: CUDA error" abort line, message elsewhere
    BOOT_CONFIG = "boot_config"        # cannot start for a configuration reason
    LOAD_FAILED = "load_failed"        # model load failed; the cause is on another line
    GPU_UNAVAILABLE = "gpu_unavailable"  # the server found no usable GPU and falls back to the CPU
    RESOURCE_LIMIT = "resource_limit"  # an rlimit bit (memlock, threads, file descriptors)
    # An allocation failed; llama.cpp may recover (retry without pipeline parallelism, a per-request
    # HTTP 500): fatal only if the process then aborts, exits or never becomes ready.
    ALLOC_FAILED = "alloc_failed"
    ALLOC_RECOVERED = "alloc_recovered"  # llama.cpp says it recovers from the allocation failure
    # A fixed property of the binary, the driver or the card: no restart or reset can fix it.
    GPU_INCOMPATIBLE = "gpu_incompatible"
    # The server's port is taken: another process may hold it for a while (after a crash, a
    # client on an ephemeral port): retried within a bound, then a configuration error.
    PORT_IN_USE = "port_in_use"
    ERROR = "error"                    # any other error or abort line (kept to name a failure)
    # An exception the server caught: it answered that request with an error and carries on.
    HANDLED_ERROR = "handled_error"


@dataclass(frozen=True)
class LineClass:
    """The verdict on one line: its family, a short cause and, for limits, which rlimit; for
    :attr:`Family.GPU_INCOMPATIBLE` ``limit`` holds the fix."""

    family: Family
    cause: str = ""
    limit: str = ""
    request_kind: str = ""  # for exception lines: the kind of request the text points at ("" unknown)
    # Another process holds what the server needs (the port; the GPU in exclusive-process mode, which
    # CUDA words "busy or unavailable"): the failure can end by itself and says nothing of the binary.
    held_elsewhere: bool = False


# Families whose lines name a failure (the "last error line" of a server that then exits).
ERROR_FAMILIES = frozenset({Family.OOM, Family.GPU_FATAL, Family.GPU_WATCHDOG, Family.DEVICE_LOST,
                            Family.GPU_ABORT, Family.BOOT_CONFIG, Family.PORT_IN_USE, Family.LOAD_FAILED,
                            Family.RESOURCE_LIMIT, Family.ALLOC_FAILED, Family.GPU_INCOMPATIBLE, Family.ERROR})


_GPU_API = r"(?:CUDA|HIP|ROCm|MUSA|SYCL)"
# CUDA's cudaErrorDevicesUnavailable: another process holds a GPU in exclusive-process compute mode.
_GPU_HELD = re.compile(r"busy or unavailable", re.IGNORECASE)
_FIX_REBUILD = ("rebuild llama.cpp for this GPU's architecture (CMAKE_CUDA_ARCHITECTURES, e.g. 90 for "
                "an H100/H200) or use a build that includes it")
_FIX_DRIVER = "update the NVIDIA driver to one that supports the binary's CUDA version (or rebuild with an older CUDA)"
_FIX_DRIVER_OR_REBUILD = ("update the NVIDIA driver to one that supports the CUDA toolkit the binary was built "
                          "with, or rebuild llama.cpp with a toolkit this driver supports")
_FIX_DRIVER_MATCH = ("install matching NVIDIA kernel driver and user-space libraries (libcuda) of one "
                     "version, then reboot")


def _fixed(cause: str, limit: str = "") -> Callable[[re.Match[str]], tuple[str, str]]:
    return lambda _m: (cause, limit)


def _group(template: str) -> Callable[[re.Match[str]], tuple[str, str]]:
    return lambda m: (template.format(*(g.strip() for g in m.groups())), "")


_Row = tuple[re.Pattern[str], Family, Callable[[re.Match[str]], tuple[str, str]]]


def _row(pattern: str, family: Family, cause: Callable[[re.Match[str]], tuple[str, str]]) -> _Row:
    return (re.compile(pattern, re.IGNORECASE), family, cause)


F = Family
TABLE: tuple[_Row, ...] = (
    # Not failures: the server copes on its own, or a client asked for too much.
    _row(r"failed to find free space in the KV cache", F.HARMLESS, _fixed("KV cache full, batch retried")),
    _row(r"exceeds the available context size", F.HARMLESS, _fixed("client request too long")),
    # A GPU backend that cannot initialise: the server falls back to the CPU (the reason may be an
    # incompatibility below; the policy looks inside).
    _row(r"failed to initialize " + _GPU_API + r": (.+?)\s*$", F.GPU_UNAVAILABLE, _group("{0}")),
    # Faults no restart or reset can fix (docs/llama-server.md): the binary was built for another
    # GPU architecture or toolkit, or the driver is too old for the CUDA runtime.
    _row(r"provided PTX was compiled with an unsupported toolchain", F.GPU_INCOMPATIBLE,
         _fixed("the binary's PTX was compiled with a newer CUDA toolchain than the driver supports",
                _FIX_DRIVER_OR_REBUILD)),
    _row(r"no kernel image is available for execution on the device", F.GPU_INCOMPATIBLE,
         _fixed("the binary has no kernel image for this GPU's architecture", _FIX_REBUILD)),
    _row(r"driver version is insufficient for (?:CUDA|HIP) runtime version", F.GPU_INCOMPATIBLE,
         _fixed("the GPU driver is older than the binary's CUDA runtime", _FIX_DRIVER)),
    _row(r"unsupported display driver\s*/\s*cuda driver combination", F.GPU_INCOMPATIBLE,
         _fixed("the system has an unsupported display driver / CUDA driver combination", _FIX_DRIVER_MATCH)),
    # Out of memory, fatal by itself: the CUDA_CHECK abort (the process aborts next) and a KV cache
    # that does not fit (the context is not created; the server exits).
    _row(_GPU_API + r" error: out of memory", F.OOM, _fixed("GPU runtime out of memory")),
    # Vulkan words it as vulkan.hpp's result name or the C enum (ggml-vulkan.cpp).
    _row(r"ErrorOutOfDeviceMemory|VK_ERROR_OUT_OF_DEVICE_MEMORY|OutOfDeviceMemoryError", F.OOM,
         _fixed("device out of memory (Vulkan)")),
    _row(r"failed to allocate buffer for kv cache", F.OOM, _fixed("failed to allocate the KV cache")),
    # An allocation failed; llama.cpp may recover from it (the policy judges by what follows).
    _row(r"cudaMalloc failed: out of memory", F.ALLOC_FAILED, _fixed("cudaMalloc failed: out of memory")),
    _row(r"failed to allocate (\S+) buffer of size (\d+)", F.ALLOC_FAILED,
         _group("failed to allocate {0} buffer of {1} bytes")),
    _row(r"unable to allocate (\S+) buffer", F.ALLOC_FAILED, _group("unable to allocate {0} buffer")),
    _row(r"failed to allocate compute buffers", F.ALLOC_FAILED, _fixed("failed to allocate compute buffers")),
    _row(r"Device memory allocation of size (\d+) failed", F.ALLOC_FAILED,
         _group("Vulkan device memory allocation of {0} bytes failed")),
    # llama.cpp's own recovery from a failed allocation.
    _row(r"retrying without pipeline parallelism", F.ALLOC_RECOVERED,
         _fixed("compute buffers reserved again without pipeline parallelism")),
    # The launch watchdog: a kernel ran past the time the driver allows on its channel (CUDA's
    # cudaErrorLaunchTimeout, HIP's hipErrorLaunchTimeOut).
    _row(r"launch timed out and was terminated|ErrorLaunchTimeOut|CUDA_ERROR_LAUNCH_TIMEOUT", F.GPU_WATCHDOG,
         _fixed("the launch watchdog ended a kernel (the launch timed out and was terminated)")),
    # Vulkan: the device was lost (driver reset, hang, GPU gone).
    _row(r"ErrorDeviceLost|VK_ERROR_DEVICE_LOST|DeviceLostError", F.DEVICE_LOST,
         _fixed("the GPU device was lost (Vulkan ErrorDeviceLost)")),
    # Fatal GPU runtime errors other than OOM.
    _row(_GPU_API + r" error: (.+?)\s*$", F.GPU_FATAL, _group("{0}")),
    _row(r"\.cu[h]?:\d+: " + _GPU_API + r" error", F.GPU_ABORT, _fixed("GPU runtime error (abort)")),
    _row(r"ggml_cuda_compute_forward: (\S+) failed", F.GPU_ABORT, _group("{0} failed on the GPU")),
    # The GPU is silently unavailable: the server would run on the CPU.
    _row(r"no usable GPU found", F.GPU_UNAVAILABLE, _fixed("no usable GPU found")),
    _row(r"offloaded 0/(\d+) layers to GPU", F.GPU_UNAVAILABLE, _group("none of {0} layers offloaded to the GPU")),
    # Resource limits.
    _row(r"failed to mlock", F.RESOURCE_LIMIT, _fixed("failed to mlock the model", "RLIMIT_MEMLOCK")),
    _row(r"RLIMIT_MEMLOCK", F.RESOURCE_LIMIT, _fixed("memlock limit too low", "RLIMIT_MEMLOCK")),
    _row(r"Resource temporarily unavailable", F.RESOURCE_LIMIT,
         _fixed("thread creation failed: Resource temporarily unavailable", "RLIMIT_NPROC")),
    _row(r"Too many open files", F.RESOURCE_LIMIT, _fixed("too many open files", "RLIMIT_NOFILE")),
    # Boot failures for a configuration reason: restarting cannot help.
    _row(r"error: invalid argument: (\S+)", F.BOOT_CONFIG, _group("llama-server rejected the argument {0}")),
    _row(r"error while handling argument \"?([^\"\s:]+)", F.BOOT_CONFIG,
         _group("llama-server rejected the argument {0}")),
    _row(r"quantized V cache requires flash_attn", F.BOOT_CONFIG,
         _fixed("quantized V cache requires flash attention (set flash_attn = 'on')")),
    _row(r"failed to open GGUF file '([^']*)' \(([^)]*)\)", F.BOOT_CONFIG, _group("cannot open model {0}: {1}")),
    _row(r"Address already in use", F.PORT_IN_USE, _fixed("the port is already in use (Address already in use)")),
    _row(r"couldn't bind HTTP server socket", F.PORT_IN_USE,
         _fixed("couldn't bind the HTTP server socket (port in use or address unavailable)")),
    _row(r"error loading model: (.+?)\s*$", F.BOOT_CONFIG, _group("error loading model: {0}")),
    _row(r"failed to load model '?([^'\s]*)", F.BOOT_CONFIG, _group("failed to load model {0}")),
    _row(r"failed to create_context", F.BOOT_CONFIG, _fixed("llama-server could not create a context")),
    _row(r"exiting due to model loading error", F.LOAD_FAILED, _fixed("model loading error")),
    # An exception the HTTP handler caught: that request got an error reply; the server carries on.
    # (llama-server's "got exception:" / "got another exception:" of the HTTP layer, "send_error" of a
    # task, a grammar that does not parse: the client gets a 4xx/5xx answer.)
    _row(r"(?:got|caught)(?: another)? exception:\s*(.+?)\s*$", F.HANDLED_ERROR, _group("request failed: {0}")),
    _row(r"send_error: task id = \d+, error: (.+?)\s*$", F.HANDLED_ERROR, _group("request failed: {0}")),
    _row(r"error parsing grammar|failed to parse grammar", F.HANDLED_ERROR,
         _fixed("request failed: its grammar does not parse")),
    _row(r"failed to launch slot with task", F.HANDLED_ERROR, _fixed("request failed: its slot was not launched")),
    # Any other error or abort line: not a verdict by itself, but it names why a server exited.
    _row(r"GGML_ASSERT\((.+?)\) failed", F.ERROR, _group("assertion failed: {0}")),
    _row(r"terminate called after throwing an instance of '([^']+)'", F.ERROR, _group("uncaught exception {0}")),
    _row(r"what\(\):\s*(.+?)\s*$", F.ERROR, _group("uncaught exception: {0}")),
    _row(r"terminate called", F.ERROR, _fixed("uncaught exception")),
    # glibc's heap checks abort the process (often while unwinding after another error).
    _row(r"(double free or corruption[^\n]*|free\(\): invalid \w+|malloc\(\): [\w ]+|corrupted size vs\. prev_size"
         r"|munmap_chunk\(\): invalid pointer)", F.ERROR, _group("glibc heap check aborted: {0}")),
    _row(r"\b(?:error|failed|fatal|abort(?:ed|ing)?|panic)\b", F.ERROR, _fixed("error line")),
)

_HARMLESS = LineClass(Family.HARMLESS)


# What an exception's text says about the request that raised it (first match wins).
_REQUEST_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), kind) for pattern, kind in (
        (r"grammar|json[_ ]schema|response_format", "grammar-constrained request (grammar, json_schema, "
                                                    "response_format)"),
        (r"tool[_ ]?(?:call|choice)|\btools\b|parse tool|function call", "tool-call request"),
        (r"jinja|chat template|template", "chat-template rendering"),
        (r"embedding|pooling", "embeddings request"),
        (r"rerank", "rerank request"),
        (r"infill", "infill request"),
        (r"json\.exception|parse_error|invalid json", "malformed JSON request"),
        (r"image|mtmd|multimodal|clip", "multimodal (image) request"),
    ))


def request_kind(text: str) -> str:
    """The kind of request an exception's text points at; "" when it names none."""
    return next((kind for pattern, kind in _REQUEST_KINDS if pattern.search(text)), "")


def classify_line(line: str) -> LineClass:
    """The family of one llama-server log line (any prefix; trailing newline allowed)."""
    for pattern, family, cause in TABLE:
        match = pattern.search(line)
        if match:
            text, limit = cause(match)
            exception = family is Family.HANDLED_ERROR or (family is Family.ERROR and "exception" in text)
            kind = request_kind(text) if exception else ""
            held = family is Family.PORT_IN_USE or _GPU_HELD.search(line) is not None
            return LineClass(family, text, limit, kind, held)
    return _HARMLESS
