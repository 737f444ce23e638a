#!/bin/sh
# build_bench.sh: builds bench/kernels_bench (and the kernel/quant tests) from the kernel sources
# alone, without the rest of petrel or its library dependencies: for timing on another machine.
#   sh bench/build_bench.sh OUTDIR
set -e
O=${1:-build-kbench}
mkdir -p "$O"
CF="-std=c11 -O2 -g -Wall -Wextra -D_GNU_SOURCE -fno-strict-aliasing -Iinclude -Isrc -pthread"
A512="-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16"
for f in src/base/pool.c src/base/err.c src/base/mem.c src/kernels/dispatch.c src/kernels/ref.c src/kernels/r16.c src/quant/qtypes.c src/quant/quant.c; do
  ${CC:-gcc} $CF -c $f -o "$O/$(basename $f .c).o"
done
for f in src/kernels/*_avx2.c; do ${CC:-gcc} $CF -mavx2 -mfma -mf16c -c $f -o "$O/$(basename $f .c).o"; done
for f in src/kernels/*_avx512.c; do ${CC:-gcc} $CF $A512 -c $f -o "$O/$(basename $f .c).o"; done
for f in src/kernels/*_amx.c; do ${CC:-gcc} $CF $A512 -mamx-tile -mamx-int8 -mamx-bf16 -c $f -o "$O/$(basename $f .c).o"; done
ar rcs "$O/libk.a" "$O"/*.o
${CC:-gcc} $CF -mavx512f bench/kernels_bench.c "$O/libk.a" -lm -o "$O/kernels_bench"
${CC:-gcc} $CF tests/runner.c tests/test_kernels.c tests/test_quant.c "$O/libk.a" -lm -o "$O/ktests"
