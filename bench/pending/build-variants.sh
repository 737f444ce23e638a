#!/bin/bash
# build-variants.sh NAME=PATCH[,PATCH...] ...: the pack run-round.sh runs: main's CUDA twin and one
# build per NAME with its bench/pending patches applied, each for sm_90a in build-dc/ and stripped,
# with petrel-tests-cuda and cu_trace-NAME of the last one, into build-carry/w.tar.xz (~8 MB).
# ~1.5 minutes a build after the first full one (~5), and ~2 to compress, on the dev box.
#   bash bench/pending/build-variants.sh uv=uv-wave lm=mapped-logits uvlm=uv-wave,mapped-logits
set -e
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: build-variants.sh NAME=PATCH[,PATCH...] ..." >&2; exit 2; }
git diff --quiet -- src cli tests || { echo "build-variants.sh: src/, cli/ or tests/ has changes; commit or stash them first" >&2; exit 1; }
NV="-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -no-compress -Iinclude -Isrc -lineinfo -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter"
P=bench/pending
t=$(mktemp -d)
trap 'git checkout -q src cli tests; rm -rf "$t"' EXIT
mkdir -p "$t/w/lib" build-carry
build() { # NAME [PATCH,...]
    local name=$1 last=$3
    for p in ${2//,/ }; do git apply "$P/$p.patch"; done
    make BUILD=build-dc cuda -j2 NVFLAGS="$NV" > "$t/$name.log" 2>&1 || { tail -20 "$t/$name.log"; exit 1; }
    cp build-dc/petrel-cuda "$t/w/petrel-cuda-$name"
    [ "$name" = main ] && cp build-dc/cu_trace "$t/w/cu_trace"
    [ -n "$last" ] && cp build-dc/petrel-tests-cuda "$t/w/petrel-tests-cuda" && cp build-dc/cu_trace "$t/w/cu_trace-$name"
    git checkout -q src cli tests
    echo "$name built"
}
build main ""
n=0
for v in "$@"; do
    n=$((n + 1))
    build "${v%%=*}" "${v#*=}" $([ $n = $# ] && echo last)
done
strip "$t"/w/petrel-* "$t"/w/cu_trace*
for l in $(ldd "$t/w/petrel-cuda-main" "$t/w/petrel-tests-cuda" "$t/w/cu_trace" | awk '/=>/{print $3}' | sort -u | grep -vE 'libc\.so|libm\.so|ld-linux|libpthread|libdl|librt'); do
    cp -L "$l" "$t/w/lib/"
done
(cd "$t" && XZ_OPT=-9e tar cJf - w) > build-carry/w.tar.xz
echo "build-carry/w.tar.xz: $(du -h build-carry/w.tar.xz | cut -f1), variants of $(git rev-parse --short HEAD): main $*"
