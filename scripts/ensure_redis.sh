#!/usr/bin/env bash
# Starts a throwaway Redis on 127.0.0.1:6379 (no persistence) unless one already answers.
# Tests use their own key prefixes and delete only their own keys.
set -euo pipefail
answers() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
if answers; then exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is not installed and no Redis answers on 127.0.0.1:6379" >&2
    exit 1
  fi
fi
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --logfile "" >/dev/null
for _ in $(seq 1 50); do answers && exit 0; sleep 0.1; done
echo "redis-server did not start on 127.0.0.1:6379" >&2
exit 1
