#!/usr/bin/env bash
# A streamed answer from a generative model with nothing but bash and redis-cli
# (protocol v1, docs/protocol.md, "Generative models"; JSON payload).
#
#   examples/stream-redis-cli.sh "What is the capital of France?"
#   env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (smollm2), MAX_NEW_TOKENS (48),
#        TIMEOUT_S (60)
# Prints the answer's text as it streams, then a newline; exits 1 on an error `done` entry
# or when no `done` entry came within TIMEOUT_S.
set -euo pipefail

url=${REDIS_URL:-redis://127.0.0.1:6379/0}
model=${MODEL:-smollm2}
max_new_tokens=${MAX_NEW_TOKENS:-48}
timeout_s=${TIMEOUT_S:-60}
question=${1:-What is the capital of France?}

json_string() {  # quote a text as a JSON string (backslashes, quotes, tabs, newlines)
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/\\t}
  s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}

json_text() {  # the "text" field of one envelope, unescaped (the worker writes raw UTF-8)
  local s
  s=$(sed -E 's/^.*"text":"((\\.|[^"\\])*)".*$/\1/' <<<"$1")
  s=${s//\\\"/\"}     # \" -> "; printf %b below does \\ \n \t \r \b \f \uXXXX
  printf '%b' "$s"
}

id="cli-$(date +%s%N)-$RANDOM"
key="redbatch:stream:$id"
payload="{\"messages\": [{\"role\": \"user\", \"content\": $(json_string "$question")}],"
payload+=" \"max_new_tokens\": $max_new_tokens}"
# 1. Enqueue: one XADD onto the model's stream; the answer streams to redbatch:stream:<id>.
redis-cli -u "$url" XADD "redbatch:requests:$model" '*' \
  id "$id" content_type application/json payload "$payload" >/dev/null

# 2. Read: XREAD BLOCK from 0-0, then from the last id seen, until the `done` entry. With
#    --raw the reply is the key, then three lines per entry: its id, "data", the envelope.
last=0-0
deadline=$((SECONDS + timeout_s))
while [ "$SECONDS" -lt "$deadline" ]; do
  mapfile -t lines < <(redis-cli -u "$url" --raw XREAD COUNT 100 BLOCK 1000 \
    STREAMS "$key" "$last")
  for ((i = 1; i + 2 < ${#lines[@]}; i += 3)); do
    last=${lines[i]}
    envelope=${lines[i + 2]}
    case $envelope in
      *'"type":"delta"'*) json_text "$envelope" ;;
      *'"ok":true'*) echo; exit 0 ;;
      *) echo; echo "error: $envelope" >&2; exit 1 ;;
    esac
  done
done
echo
echo "error: no answer on $key within $timeout_s s" >&2
exit 1
