#!/bin/bash
# build-variants.sh: the pack run-next.sh runs: main's CUDA twin and one per pending patch (and
# their stacks), each built for sm_90a in build-dc/ and stripped, with petrel-tests-cuda and
# cu_trace of "all", cu_trace of main, and b52 (52c4283, the build before the early grid-dependency
# trigger, built in a worktree: its prefill against main's is owed), into build-carry/w.tar.xz
# (~10 MB). ~15 minutes on the dev box.
set -e
cd "$(dirname "$0")/../.."
git diff --quiet -- src cli tests || { echo "build-variants.sh: src/, cli/ or tests/ has changes; commit or stash them first" >&2; exit 1; }
NV="-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -no-compress -Iinclude -Isrc -lineinfo -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter"
P=bench/pending
t=$(mktemp -d)
trap 'git checkout -q src cli tests; rm -rf "$t"' EXIT
mkdir -p "$t/w/lib" build-carry
build() { # NAME PATCH...
    local name=$1
    shift
    for p in "$@"; do git apply "$P/$p.patch"; done
    make BUILD=build-dc cuda -j2 NVFLAGS="$NV" > "$t/$name.log" 2>&1 || { tail -20 "$t/$name.log"; exit 1; }
    cp build-dc/petrel-cuda "$t/w/petrel-cuda-$name"
    [ "$name" = main ] && cp build-dc/cu_trace "$t/w/cu_trace"
    [ "$name" = all ] && cp build-dc/petrel-tests-cuda "$t/w/petrel-tests-cuda" && cp build-dc/cu_trace "$t/w/cu_trace-all"
    git checkout -q src cli tests
    echo "$name built"
}
build main
build nq norm-q
build sp16 attn-split16
build tk topk-regs
build all norm-q attn-split16 topk-regs
git worktree add -f "$t/b52" 52c4283 > /dev/null 2>&1
make -C "$t/b52" BUILD=build-dc cuda -j2 NVFLAGS="$NV" > "$t/b52.log" 2>&1 || { tail -20 "$t/b52.log"; exit 1; }
cp "$t/b52/build-dc/petrel-cuda" "$t/w/petrel-cuda-b52"
git worktree remove --force "$t/b52"
echo "b52 built"
strip "$t"/w/petrel-* "$t"/w/cu_trace*
for l in $(ldd "$t/w/petrel-cuda-main" "$t/w/petrel-tests-cuda" "$t/w/cu_trace" | awk '/=>/{print $3}' | sort -u | grep -vE 'libc\.so|libm\.so|ld-linux|libpthread|libdl|librt'); do
    cp -L "$l" "$t/w/lib/"
done
(cd "$t" && XZ_OPT=-9e tar cJf - w) > build-carry/w.tar.xz
echo "build-carry/w.tar.xz: $(du -h build-carry/w.tar.xz | cut -f1), variants of $(git rev-parse --short HEAD)"
