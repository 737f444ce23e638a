#!/bin/bash
# run-next.sh PART: the device calls bench/pending/README.md asks for, on the pack of prebuilt
# variants build-variants.sh makes (w/petrel-cuda-NAME: main, nq = norm-q, sp16 = attn-split16,
# tk = topk-regs, all = the three, b52 = 52c4283; petrel-tests-cuda and cu_trace-all of all; cu_trace of main).
# Part 1 (~5 min): the cuda group of all, the 1d4m synth, the decode logits' bits of nq against
# main, cu_trace of main and all. Part 2 (~6 min, the same warm machine): decode at context 2048
# of main / nq / sp16 / tk / all, two rounds, and a 2048-token prefill of b52 against main, twice.
# PART small: part 1's group and bits and part 2's decode of main / nq / tk on the 1-dense + 1-MoE slice (a quicker
# synth), for a session with little device time. Logs under $OUT (few files: at most 8 come back).
export OUT
W=/tmp/w
(cd /tmp && tar xJf -) < build-carry/w.tar.xz
export LD_LIBRARY_PATH=$W/lib PETREL_TEST_DATA=$(pwd)/tests/data PETREL_BIN=$W/petrel-cuda-all
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
S=/tmp/s1d4m.pack SHAPE="--moe-layers 4"
[ "$1" = small ] && S=/tmp/s1d1m.pack SHAPE="--moe-layers 1"
[ -f $S ] || (time $W/petrel-cuda-main synth --shape glm5.2 --dense-layers 1 $SHAPE --out $S --quiet) 2>&1 | grep real
decode() { # ROUNDS BUILD...
    local rounds=$1
    shift
    for r in $(seq $rounds); do for b in "$@"; do
        echo "== $r $b" >> $OUT/dec.txt
        echo "== $r $b: $(timeout 50 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 64 --ctx 2048 --steps 32 --prefill-runs 1 2>&1 | tee -a $OUT/dec.txt | grep -E '^decode at' | cut -c1-120)"
    done; done
}
if [ "$1" != 2 ]; then
    (time PETREL_TEST_VERBOSE=1 timeout 200 $W/petrel-tests-cuda cuda) > $OUT/group.txt 2>&1
    echo "cuda group rc=$?"; grep -E "FAIL|passed|failed|real" $OUT/group.txt | head -20
    for b in main nq; do
        timeout 60 $W/petrel-cuda-$b logits --model $S --ids $(seq -s, 3 50) --out /tmp/l-$b.bin --decode --device cuda 2>&1 | grep -i rror
    done
    cmp /tmp/l-main.bin /tmp/l-nq.bin && echo "decode logits (48 steps): same bits"
    if [ "$1" = small ]; then decode 2 main nq tk; exit 0; fi
    for b in main all; do
        timeout 100 $W/cu_trace$([ $b = all ] && echo -all) $S 2048 16 > $OUT/trace-$b.txt 2>&1; echo "cu_trace $b rc=$?"
        grep -E "^step span" $OUT/trace-$b.txt
    done
else
    decode 2 main nq sp16 tk all
    for b in b52 main b52 main; do
        echo "== $b" >> $OUT/pf.txt
        echo "== prefill $b: $(timeout 60 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 2048 --ctx 2048 --steps 1 --prefill-runs 5 2>&1 | tee -a $OUT/pf.txt | grep -E '^prefill' | cut -c1-200 | tr '\n' ' ')"
    done
fi
