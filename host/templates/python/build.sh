#!/usr/bin/env bash
# Build {{name}}.wasm with componentize-py (pip install componentize-py==0.25.1).
set -euo pipefail
cd "$(dirname "$0")"
componentize-py -d wit -w router componentize app -o {{crate}}.wasm
echo "built {{crate}}.wasm"
