#!/bin/bash
# run-round.sh: one device call for a round of pending decode patches on prebuilt binaries
# (build-carry/w.tar.xz: w/petrel-cuda-NAME for main and each variant, w/petrel-tests-cuda and
# w/cu_trace-LAST of the last variant named, w/lib): the cuda group of the last variant, the 1d4m
# synth, its 48 decode steps' logits against main's (bits), decode at context 2048 of every build
# alternated in two rounds, and cu_trace of the last variant. ~5 minutes on an H100 for four
# builds; QUICK=1 leaves out the logits' bits and cu_trace (the group's bitwise checks remain).
#   bash bench/pending/run-round.sh main uv lm uvlm
export OUT
W=/tmp/w
(cd /tmp && tar xJf -) < build-carry/w.tar.xz
last=${@: -1}
export LD_LIBRARY_PATH=$W/lib PETREL_TEST_DATA=$(pwd)/tests/data PETREL_BIN=$W/petrel-cuda-$last
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
(time PETREL_TEST_VERBOSE=1 timeout 200 $W/petrel-tests-cuda cuda) > $OUT/group.txt 2>&1
echo "cuda group ($last) rc=$?"; grep -E "FAIL|passed|failed|real" $OUT/group.txt | head -20
S=/tmp/s1d4m.pack
[ -f $S ] || (time $W/petrel-cuda-main synth --shape glm5.2 --dense-layers 1 --moe-layers 4 --out $S --quiet) 2>&1 | grep real
for r in 1 2; do for b in "$@"; do
    echo "== $r $b" >> $OUT/dec.txt
    echo "== $r $b: $(timeout 50 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 64 --ctx 2048 --steps 32 --prefill-runs 1 2>&1 | tee -a $OUT/dec.txt | grep -E '^decode at' | cut -c1-120)"
done; done
[ -n "$QUICK" ] && exit 0
for b in main $last; do
    timeout 60 $W/petrel-cuda-$b logits --model $S --ids $(seq -s, 3 50) --out /tmp/l-$b.bin --decode --device cuda 2>&1 | grep -i rror
done
cmp /tmp/l-main.bin /tmp/l-$last.bin && echo "decode logits (48 steps) of $last: same bits as main"
[ -x $W/cu_trace-$last ] && { timeout 100 $W/cu_trace-$last $S 2048 16 > $OUT/trace-$last.txt 2>&1; echo "cu_trace $last rc=$?"; grep -E "^step span|last step's call" $OUT/trace-$last.txt; }
