#!/bin/sh
# device-pack.sh: builds the CUDA twins for sm_90a only (build-dc/) and packs them, stripped,
# with the shared libraries they need, into build-carry/w.tar.xz (~5 MB) for the accelerator
# machine, which has no build tools of ours; run scripts/device-run.sh there. build-carry/ is
# ignored by git: carry it explicitly (and hide tests/data/tokenizers to stay under 64 MiB).
# BASE=FILE (an earlier pack, copied aside first, e.g. main's) puts its petrel-cuda in beside the
# new one as petrel-cuda-base, for `device-run.sh ab` (BASEBIN=NAME: that pack's NAME instead).
set -e
cd "$(dirname "$0")/.."
make BUILD=build-dc cuda -j2 NVFLAGS="-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -no-compress -Iinclude -Isrc -lineinfo -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/w/lib" build-carry
cp build-dc/petrel-cuda build-dc/petrel-tests-cuda "$t/w/"
strip "$t/w/petrel-cuda" "$t/w/petrel-tests-cuda"
if [ -x build-dc/cu_trace ]; then cp build-dc/cu_trace "$t/w/" && strip "$t/w/cu_trace"; fi # (and its libcupti, below)
if [ -n "$BASE" ]; then
    tar xJf "$BASE" -C "$t" "w/${BASEBIN:-petrel-cuda}" --transform "s,w/${BASEBIN:-petrel-cuda},w/petrel-cuda-base,"
fi
for l in $(ldd "$t/w/petrel-cuda" "$t/w/petrel-tests-cuda" $(ls "$t/w/cu_trace" 2>/dev/null) | awk '/=>/{print $3}' | sort -u | grep -vE 'libc\.so|libm\.so|ld-linux|libpthread|libdl|librt'); do
    cp -L "$l" "$t/w/lib/"
done
(cd "$t" && XZ_OPT=-9e tar cJf - w) > "$t/w.tar.xz" # a failed pack leaves the last good one in place
mv "$t/w.tar.xz" build-carry/w.tar.xz
git rev-parse --short HEAD > build-carry/BUILT_AT
echo "build-carry/w.tar.xz: $(du -h build-carry/w.tar.xz | cut -f1), built at $(cat build-carry/BUILT_AT)$(git diff --quiet || echo ' (tree modified)')"
