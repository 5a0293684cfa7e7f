#!/usr/bin/env bash
# Build, then route sample-event.json through the relay's sandbox: the first
# event must become a message to orders.order-created, the second (payload
# not an object) an `invalid` rejection.
set -euo pipefail
cd "$(dirname "$0")"
./build.sh >/dev/null
# Exit status 3: some event was rejected (the second one must be).
status=0
out="$("${OUTROUTE:-outroute}" plugin test {{crate}}.wasm --event sample-event.json)" || status=$?
[ "$status" -eq 3 ] || { echo "plugin test exited $status, expected 3 (one rejection)"; exit 1; }
echo "$out"
grep -q '"topic": "orders.order-created"' <<<"$out"
grep -q '"kind": "invalid"' <<<"$out"
echo "ok"
