#!/bin/bash
# run-next.sh PART: the device calls bench/pending/README.md asks for, on the pack of prebuilt
# variants build-variants.sh makes (w/petrel-cuda-NAME: main, probe = bench-probe-ends, gc = graph-copies,
# kp1 = expert-kp1, uv = uv-preload, route = route-redux, same = probe + gc + uv + route (the
# patches that keep the bits), all = same + kp1; petrel-tests-cuda of all; cu_trace of main).
# Part 1 (~5 min): the cuda group, the 1d4m synth, cu_trace, the logits' bits of same against main.
# Part 2 (~8 min, the same warm machine): decode at context 2048 of each variant, two rounds,
# and a 2048-token prefill of main and all. Logs under $OUT.
export OUT
W=/tmp/w
(cd /tmp && tar xJf -) < build-carry/w.tar.xz
export LD_LIBRARY_PATH=$W/lib PETREL_TEST_DATA=$(pwd)/tests/data PETREL_BIN=$W/petrel-cuda-all
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
S=/tmp/s1d4m.pack
if [ "${1:-1}" = 1 ]; then
    (time PETREL_TEST_VERBOSE=1 timeout 200 $W/petrel-tests-cuda cuda) > $OUT/group.txt 2>&1
    echo "cuda group rc=$?"; grep -E "FAIL|passed|failed|real" $OUT/group.txt | head -20
    [ -f $S ] || (time $W/petrel-cuda-main synth --shape glm5.2 --dense-layers 1 --moe-layers 4 --out $S --quiet) 2>&1 | grep real
    timeout 120 $W/cu_trace $S 2048 16 > $OUT/trace.txt 2>&1; echo "cu_trace rc=$?"
    grep -E "^decode step|^step span|copy |last step|decode calls" $OUT/trace.txt
    for b in main same; do
        timeout 60 $W/petrel-cuda-$b logits --model $S --ids $(seq -s, 3 50) --out /tmp/l-$b.bin --decode --device cuda 2>&1 | grep -i rror
        timeout 60 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 2200 --golden-out /tmp/g-$b.st 2>&1 | grep -i rror
    done
    cmp /tmp/l-main.bin /tmp/l-same.bin && echo "decode logits (48 steps): same bits"
    cmp /tmp/g-main.st /tmp/g-same.st && echo "2200-token prompt logits: same bits"
else
    for r in 1 2; do for b in main probe gc kp1 uv route same all; do
        echo "== $r $b: $(timeout 50 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 64 --ctx 2048 --steps 32 --prefill-runs 1 2>&1 | tee -a $OUT/dec-$b.txt | grep -E '^decode at' | cut -c1-120)"
    done; done
    for b in main all main all; do
        echo "== prefill $b: $(timeout 60 $W/petrel-cuda-$b bench --model $S --device cuda --prompt 2048 --ctx 2048 --steps 1 --prefill-runs 2 2>&1 | tee -a $OUT/pf-$b.txt | grep -E '^prefill:' | cut -c1-120)"
    done
fi
