#!/usr/bin/env bash
# A redbatch request with nothing but redis-cli (protocol v1, docs/protocol.md, JSON payload).
#
#   examples/redis-cli.sh "some text" ["more text" ...]
#   env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (minilm), TIMEOUT_S (30)
# Prints one reply envelope per line; exits 1 if any request failed or timed out.
set -euo pipefail

url=${REDIS_URL:-redis://127.0.0.1:6379/0}
model=${MODEL:-minilm}
timeout_s=${TIMEOUT_S:-30}
[ $# -gt 0 ] || set -- "Redis streams feed the batch worker."

json_string() {  # quote a text as a JSON string (backslashes, quotes, tabs, newlines)
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/\\t}
  s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}

ids=()
for text in "$@"; do
  id="cli-$(date +%s%N)-$RANDOM"
  # 1. Enqueue: one XADD onto the model's stream.
  redis-cli -u "$url" XADD "redbatch:requests:$model" '*' \
    id "$id" content_type application/json payload "{\"text\": $(json_string "$text")}" >/dev/null
  ids+=("$id")
done

status=0
for id in "${ids[@]}"; do
  # 2. Wait: BLPOP the reply key; --raw prints the key, then the envelope (nothing on timeout).
  envelope=$(redis-cli -u "$url" --raw BLPOP "redbatch:reply:$id" "$timeout_s" | sed -n 2p)
  if [ -z "$envelope" ]; then
    envelope="{\"id\": \"$id\", \"ok\": false, \"error\": {\"code\": \"timeout\"}}"
  fi
  echo "$envelope"
  case $envelope in *'"ok":true'*) ;; *) status=1 ;; esac
done
exit $status
