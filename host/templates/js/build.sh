#!/usr/bin/env bash
# Build {{crate}}.wasm: TypeScript → JavaScript (tsc) → a WebAssembly
# component (componentize-js) against wit/, the relay's contract.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules/@bytecodealliance/componentize-js ] ||
  npm install --no-audit --no-fund --loglevel=error >/dev/null
npm run --silent build >/dev/null
echo "built {{crate}}.wasm"
