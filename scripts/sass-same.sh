#!/bin/sh
# sass-same.sh: do two builds of a CUDA object carry the same machine code, kernel by kernel?
# For refactors of src/cuda without a GPU at hand: build the object before and after the change
# with the same flags and -no-compress (so the cubin sits in it uncompressed), e.g.
#   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -no-compress -Iinclude -Isrc \
#        -c src/cuda/kernels.cu -o /tmp/before.o        (then again, after the change)
#   scripts/sass-same.sh /tmp/before.o /tmp/after.o
# It compares the .text section of every kernel both cubins hold, byte for byte, and lists the
# kernels that differ or that only one side has. Exit 0 when every common kernel is identical.
set -e
[ $# -eq 2 ] || { echo "usage: $0 BEFORE.o AFTER.o (nvcc -no-compress objects)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cubin() { # the first ELF image embedded after the host object's own header
    off=$(grep -obUaP '\x7fELF' "$1" | sed -n 2p | cut -d: -f1)
    [ -n "$off" ] || { echo "$0: no embedded cubin in $1 (built with -no-compress?)" >&2; exit 2; }
    tail -c +$((off + 1)) "$1" > "$2"
}
texts() { readelf -S -W "$1" 2>/dev/null | sed -n 's/^ *\[ *[0-9]*\] \(\.text\.[^ ]*\) *[A-Z_]* *[0-9a-f]* \([0-9a-f]*\) \([0-9a-f]*\).*/\1 \2 \3/p'; }
cubin "$1" "$tmp/a" && cubin "$2" "$tmp/b"
texts "$tmp/a" | sort > "$tmp/la"
texts "$tmp/b" | sort > "$tmp/lb"
same=0 differ=0
while read -r name off size; do
    line=$(grep -F "$name " "$tmp/lb" | head -1) || true
    if [ -z "$line" ]; then echo "only before: $name"; continue; fi
    set -- $line
    tail -c +$((0x$off + 1)) "$tmp/a" | head -c $((0x$size)) > "$tmp/sa"
    tail -c +$((0x$2 + 1)) "$tmp/b" | head -c $((0x$3)) > "$tmp/sb"
    if cmp -s "$tmp/sa" "$tmp/sb"; then same=$((same + 1)); else differ=$((differ + 1)); echo "differs: $name"; fi
done < "$tmp/la"
cut -d' ' -f1 "$tmp/la" > "$tmp/na"
cut -d' ' -f1 "$tmp/lb" | grep -vxF -f "$tmp/na" | sed 's/^/only after: /' || true
echo "$same kernels identical, $differ differ"
[ "$differ" -eq 0 ]
