"""The log classifier on real-format lines of every family (docs/llama-server.md)."""

from __future__ import annotations

import pytest
from llama_guard.model.server_log import TABLE, Family, classify_line

PREFIXES = ["", "0.00.450.903 E ", "[12345] ", "0.01.518.422 W srv  "]

CASES: list[tuple[str, Family, str]] = [
    # progress lines are harmless (readiness is /health 200, not a line)
    ("I srv  llama_server: listening on http://127.0.0.1:18080", Family.HARMLESS, ""),
    ("main: server is listening on http://0.0.0.0:8080 - starting the main loop", Family.HARMLESS, ""),
    ("main: model loaded", Family.HARMLESS, ""),
    # OOM at run time and at load, several devices and sizes
    ("CUDA error: out of memory", Family.OOM, ""),
    ("HIP error: out of memory", Family.OOM, ""),
    ("llama_init_from_model: failed to allocate buffer for kv cache", Family.OOM, "KV cache"),
    # allocation failures llama.cpp may recover from (judged by what the process does next)
    ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9216.00 MiB on device 0: cudaMalloc failed: "
     "out of memory", Family.ALLOC_FAILED, ""),
    ("alloc_tensor_range: failed to allocate CUDA0 buffer of size 9663676416", Family.ALLOC_FAILED, "CUDA0"),
    ("ggml_gallocr_reserve_n_impl: failed to allocate ROCm0 buffer of size 1048576", Family.ALLOC_FAILED,
     "ROCm0"),
    ("graph_reserve: failed to allocate compute buffers", Family.ALLOC_FAILED, ""),
    ("llama_model_load: error loading model: unable to allocate CUDA1 buffer", Family.ALLOC_FAILED, "CUDA1"),
    ("W sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism",
     Family.ALLOC_RECOVERED, "without pipeline parallelism"),
    # faults no restart can fix (binary, driver, card), with the fix in ``limit``
    ("CUDA error: the provided PTX was compiled with an unsupported toolchain.", Family.GPU_INCOMPATIBLE, "PTX"),
    ("CUDA error: no kernel image is available for execution on the device", Family.GPU_INCOMPATIBLE,
     "architecture"),
    ("ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version",
     Family.GPU_UNAVAILABLE, "insufficient"),
    ("CUDA error: CUDA driver version is insufficient for CUDA runtime version", Family.GPU_INCOMPATIBLE,
     "driver"),
    ("cudaGetDeviceCount: system has unsupported display driver / cuda driver combination",
     Family.GPU_INCOMPATIBLE, "display driver"),
    # other error and abort lines (they name why a server exited)
    ("/src/llama-context.cpp:1009: GGML_ASSERT(n_tokens_all <= cparams.n_batch) failed", Family.ERROR,
     "n_tokens_all"),
    ("terminate called after throwing an instance of 'std::runtime_error'", Family.ERROR, "exception"),
    ("decode: failed to find a memory slot for batch of size 1", Family.ERROR, ""),
    # fatal GPU runtime errors
    ("CUDA error: an illegal memory access was encountered", Family.GPU_FATAL, "illegal memory access"),
    ("CUDA error: unspecified launch failure", Family.GPU_FATAL, "unspecified launch failure"),
    ("CUDA error: the launch timed out and was terminated", Family.GPU_WATCHDOG, "launch timed out"),
    ("ROCm error: hipErrorLaunchTimeOut", Family.GPU_WATCHDOG, "launch watchdog"),
    ("ggml_vulkan: vk::Queue::submit: ErrorDeviceLost", Family.DEVICE_LOST, "device was lost"),
    ("  what():  vk::Device::allocateMemory: ErrorOutOfDeviceMemory", Family.OOM, "Vulkan"),
    ("W srv    operator(): got exception: {\"error\":{\"code\":400,\"message\":\"Invalid tool_choice\"}}",
     Family.HANDLED_ERROR, "Invalid tool_choice"),
    ("E srv    send_error: task id = 0, error: Failed to initialize samplers: failed to parse grammar",
     Family.HANDLED_ERROR, "samplers"),
    ("E failed to parse grammar", Family.HANDLED_ERROR, "grammar"),
    ("E srv  process_sing: failed to launch slot with task, id_task = 0", Family.HANDLED_ERROR, "slot"),
    ("terminate called after throwing an instance of 'std::runtime_error'", Family.ERROR, "std::runtime_error"),
    ("  what():  Unexpected empty grammar stack after accepting piece: ]", Family.ERROR, "empty grammar stack"),
    ("terminate called without an active exception", Family.ERROR, "uncaught exception"),
    ("double free or corruption (out)", Family.ERROR, "glibc heap check"),
    ("ggml_vulkan: Device memory allocation of size 4563402752 failed.", Family.ALLOC_FAILED, "4563402752"),
    ("CUDA error: CUDA-capable device(s) is/are busy or unavailable", Family.GPU_FATAL, "busy or unavailable"),
    ("/tmp/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu:96: CUDA error", Family.GPU_ABORT, ""),
    ("ggml_cuda_compute_forward: MUL_MAT failed", Family.GPU_ABORT, "MUL_MAT"),
    # asked to offload, none offloaded: on the CPU
    ("0.00.300.000 I load_tensors: offloaded 0/31 layers to GPU", Family.GPU_UNAVAILABLE, "none of 31 layers"),
    ("0.00.300.000 I load_tensors: offloaded 31/31 layers to GPU", Family.HARMLESS, ""),
    # configuration boot failures
    ("error: invalid argument: --no-flash-attn", Family.BOOT_CONFIG, "--no-flash-attn"),
    ("E llama_init_from_model: quantized V cache requires flash_attn to be enabled", Family.BOOT_CONFIG,
     "flash"),
    ("gguf_init_from_file: failed to open GGUF file '/models/missing.gguf' (No such file or directory)",
     Family.BOOT_CONFIG, "/models/missing.gguf"),
    ("llama_model_load: error loading model: llama_model_loader: failed to load model from /m.gguf",
     Family.BOOT_CONFIG, "/m.gguf"),
    ("couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080", Family.PORT_IN_USE, "bind"),
    ("OSError: [Errno 98] Address already in use", Family.PORT_IN_USE, "port is already in use"),
    ("srv    load_model: failed to create_context with model '/m.gguf'", Family.BOOT_CONFIG, "context"),
    ("E srv  llama_server: exiting due to model loading error", Family.LOAD_FAILED, ""),
    # GPU silently unavailable
    ("E ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected", Family.GPU_UNAVAILABLE,
     "no CUDA-capable device"),
    ("warning: no usable GPU found, --gpu-layers option will be ignored", Family.GPU_UNAVAILABLE, ""),
    # resource limits
    ("warning: failed to mlock 1416867840-byte buffer (after previously locking 0 bytes): Cannot allocate "
     "memory", Family.RESOURCE_LIMIT, "mlock"),
    ("Try increasing RLIMIT_MEMLOCK ('ulimit -l' as root).", Family.RESOURCE_LIMIT, "memlock"),
    ("  what():  Resource temporarily unavailable", Family.RESOURCE_LIMIT, "thread"),
    # harmless
    ("failed to find free space in the KV cache, retrying with smaller batch size", Family.HARMLESS, ""),
    ("srv  send_error: task id = 4, error: request (9000 tokens) exceeds the available context size "
     "(8192 tokens), try increasing it", Family.HARMLESS, ""),
    ("I slot print_timing: id  0 | task 0 |        eval time =     610.78 ms /    64 tokens", Family.HARMLESS, ""),
    ("", Family.HARMLESS, ""),
    ("E   current device: 0, in function stream at /src/common.cuh:1080", Family.HARMLESS, ""),
]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(("text", "family", "cause_part"), CASES)
def test_family(prefix: str, text: str, family: Family, cause_part: str) -> None:
    verdict = classify_line(prefix + text)
    assert verdict.family is family, (prefix + text, verdict)
    assert cause_part.lower() in verdict.cause.lower()


def test_limit_names() -> None:
    assert classify_line("failed to mlock 4096-byte buffer").limit == "RLIMIT_MEMLOCK"
    assert classify_line("what():  Resource temporarily unavailable").limit == "RLIMIT_NPROC"
    assert classify_line("accept: Too many open files").limit == "RLIMIT_NOFILE"


def test_interleaved_abort_and_logger_line() -> None:
    # One physical line holding a logger prefix followed by the abort's own stderr text (seen on the H200).
    verdict = classify_line(
        "0.00.812.004 E /src/ggml/src/ggml-cuda/ggml-cuda.cu:96: CUDA errorCUDA error: out of memory")
    assert verdict.family is Family.OOM


def test_trailing_newline_and_crlf() -> None:
    assert classify_line("CUDA error: unspecified launch failure\r\n").cause == "unspecified launch failure"


def test_every_row_is_reachable() -> None:
    # Each pattern must be hit by at least one case above, or it is dead weight.
    texts = [c[0] for c in CASES] + ["accept: Too many open files", "error while handling argument \"-x\"",
                                     "ErrorOutOfDeviceMemory"]
    for pattern, _family, _cause in TABLE:
        assert any(pattern.search(t) for t in texts), pattern.pattern
