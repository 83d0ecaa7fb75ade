#!/usr/bin/env bash
# `make demo`: llama-guard supervising a real llama-server on SmolLM2-135M, on the CPU, in the foreground.
set -euo pipefail
cd "$(dirname "$0")/.."
. .work/real/env
PORT=${PORT:-18080}              # clients: the front door
SERVER_PORT=${SERVER_PORT:-18081}  # llama-server, private
mkdir -p .work/run
cat > .work/demo.toml <<TOML
# Demo configuration written by scripts/demo.sh: the CPU, a 135M model, fast probes.
[server]
binary = "$LLAMA_SERVER_BIN"
model = "$LLAMA_GUARD_TEST_MODEL"
host = "127.0.0.1"
port = $SERVER_PORT
n_gpu_layers = 0
ctx_size = 2048
threads = $(nproc)
env = {}

[gpu]
enabled = "auto"
require_server_on_gpu = false

[health]
interval_s = 2.0

[schedule]
restart_cron = ""

[runtime]
dir = "$PWD/.work/run"

[front]
listen = "127.0.0.1:$PORT"
TOML
cat <<MSG
llama-guard demo: front door on http://127.0.0.1:$PORT, llama-server privately on 127.0.0.1:$SERVER_PORT
  (config .work/demo.toml)
  try:     curl -s http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
             -d '{"messages":[{"role":"user","content":"Say hello"}],"max_tokens":32}'
  status:  .venv/bin/llama-guard status --config .work/demo.toml
  restart: .venv/bin/llama-guard restart --config .work/demo.toml
  loop:    while :; do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:$PORT/completion \\
             -d '{"prompt":"Hi","n_predict":4}'; done
  crash:   pkill -9 -f 'llama-server.*--port $SERVER_PORT'     (the loop above keeps printing 200)
  ready:   curl -s http://127.0.0.1:$PORT/readyz
  stop:    Ctrl-C
MSG
exec .venv/bin/llama-guard run --config .work/demo.toml
