#!/bin/sh
# A failure in the middle of a run on a terminal starts a line of its own, not the end of the
# progress bar's line: the second request of a model with a 60-token context goes over it once
# the first request's reply is known. Runs kvsnap ($1) under script(1), a pseudo-terminal, in
# folder $2.
set -u
kvsnap=$1 folder=$2
mkdir -p "$folder"
printf '{"hidden": 64, "mlp_hidden": 96, "pattern": "RSA", "context_length": 60}\n' \
  > "$folder/context60.json"
printf '%s\n%s\n' \
  '{"id": "a", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}' \
  '{"id": "b", "after": "a", "messages": [{"role": "user", "content": "and now a longer message"}], "max_tokens": 16}' \
  > "$folder/context60.jsonl"
output=$(script -qec "'$kvsnap' replay --chart '' --model-config '$folder/context60.json' '$folder/context60.jsonl'" /dev/null | tr -d '\r')
printf '%s\n' "$output"
printf '%s\n' "$output" | grep -q '^kvsnap: .*line 2: request "b": prompt of' || exit 1
# The bar was drawn (the terminal was one) and its line ended before the message.
printf '%s\n' "$output" | grep -q '1/2$'
