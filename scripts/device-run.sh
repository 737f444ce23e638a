#!/bin/bash
# device-run.sh MODE: run on the accelerator machine from the repository root, with the binaries
# scripts/device-pack.sh packed (carry build-carry); writes its logs under $OUT.
#   tests    PETREL_TEST_VERBOSE runs of the tests named in TESTS, then the whole cuda group of
#            petrel-tests-cuda and of each other test binary in GROUPS_OF, always (25 s on an H100:
#            on 2026-12-07 a broken kernel went unseen for six hours of runs that named tests only)
#   bench    1d4m prefill of 2048 tokens per FORMS entry: EXPERTS[+DENSE[+ATTN]] with EXPERTS
#            int8|bf16|wgmma|tma, DENSE int8|wgmma|tma (int8 when absent), ATTN x (expanded), xw
#            (expanded-wgmma) or f (flash-bf16; absorbed when absent: not the engine's defaults,
#            which are tma+tma+f), by $BIN (default petrel-cuda); TRACE=1 routes by
#            bench/data/glm5-like-2048.txt.gz
#   quality  the exact CPU path's logits of 512 positions (--golden-out), then each QF form's
#            distance from them (spec as in bench; the CPU default's too)
#   cpu      issues 12 / 21 on the host CPU, 2 threads pinned: 1d1m, 1d2m with 8 sessions
#   ab       BINS (default petrel-cuda-base petrel-cuda: device-pack.sh BASE=) alternated ROUNDS
#            times (default 2) on the 1d${MOE:-4}m slice: a 2048-token prefill by part, then decode
#            at context 2048 (DECODE=0: prefill only). MOE=1 and builds that differ only in the
#            routed experts' kernels route the same rows in every build, even where a build's
#            experts compute garbage (timing-only ablations)
#   ncu      Nsight Compute on one launch of KERNEL (a regex over the demangled name as ncu prints it,
#            template arguments included: 'k_gemm_w4g<.int.4>' is the experts' GEMM; default k_gemm_w4g), SKIP
#            launches in (default 4), in a 1d4m prefill: the details page and the per-SASS-line
#            source page (CSV) under $OUT
#   kernels  every kernel of one 1d4m prefill (PROMPT tokens, default 2048) timed alone by ncu and
#            summed by function name (then one decode step's launches): where a prompt's time goes
#   trace    cu_trace (CUPTI) on the 1d${MOE:-4}m slice: one decode step's kernels on the GPU's clock
#            after a PROMPT-token prompt (default 2048), inside the replayed graph: start, duration,
#            its share of the step's span, the idle gap before it, stream; the step's busy / idle
#            time; shares and durations by kernel name
#   goldens  the logits of one PROMPT-token prompt (default 1024) on the 1d${MOE:-1}m slice from each of
#            VARIANTS ("BIN:FLAGS" words, BIN base = petrel-cuda-base, new = petrel-cuda, FLAGS with
#            commas for spaces; any other BIN NAME = petrel-cuda-NAME; default: base, new, new with PDL off, new with each prompt form
#            back on wgmma), each compared bitwise with the first's (cmp) and by bench --golden
#            against it (relative L2 error, top-1, KL): which form changes a prompt's bits
R=$(pwd)
(cd /tmp && tar xJf "$R/build-carry/w.tar.xz")
W=/tmp/w
export LD_LIBRARY_PATH=$W/lib PETREL_TEST_DATA=$R/tests/data PETREL_BIN=$W/petrel-cuda
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; lscpu | grep "Model name"
S=/tmp/s1d4m.pack
slice() { [ -f "$2" ] || $W/petrel-cuda synth --shape glm5.2 --dense-layers 1 --moe-layers "$1" --out "$2" --quiet; }
forms() { # SPEC: the bench flags of EXPERTS[+DENSE[+ATTN]]
    IFS=+ read -r e d x <<< "$1"
    local a=absorbed
    case "$x" in x) a=expanded ;; xw) a=expanded-wgmma ;; f) a=flash-bf16 ;; esac
    echo "--cuda-experts $e --cuda-dense ${d:-int8} --cuda-prompt-attn $a"
}
case "${1:-tests}" in
tests)
    (time PETREL_TEST_VERBOSE=1 timeout 150 $W/${TB:-petrel-tests-cuda} ${TESTS:-cuda.nt_wgmma cuda.attention_expanded cuda.golden_expanded}) > "$OUT/t1.txt" 2>&1
    echo "named tests rc=$?"; grep -E "wgmma|expanded|D\[|FAIL|passed|failed|real" "$OUT/t1.txt" | head -60
    for tb in petrel-tests-cuda $(echo ${GROUPS_OF:-} | tr ' ' '\n' | grep -vx petrel-tests-cuda); do # the whole cuda group of each test binary
        (time PETREL_TEST_VERBOSE=1 timeout 200 $W/$tb cuda) > "$OUT/group-$tb.txt" 2>&1
        echo "$tb cuda group rc=$?"; grep -E "FAIL|passed|failed|real" "$OUT/group-$tb.txt" | head -20
    done ;;
bench)
    slice 4 $S
    for spec in ${FORMS:-int8 wgmma+wgmma+x wgmma+wgmma+xw int8 wgmma+wgmma+x wgmma+wgmma+xw}; do
        echo "== $spec ${TRACE:+trace}"
        timeout 60 $W/${BIN:-petrel-cuda} bench --model $S --device cuda --prompt 2048 --ctx 2048 --steps 2 --prefill-runs 2 --profile $(forms "$spec") \
            ${TRACE:+--route-trace $R/bench/data/glm5-like-2048.txt.gz} 2>&1 | tee -a "$OUT/bench-${spec//+/_}${TRACE:+-trace}.txt" |
            grep -E "^prefill|routed experts|attention|heads|o_proj|dense|rror" | head -12
    done ;;
quality)
    slice 4 $S
    G=/tmp/g.st
    [ -f $G ] || timeout 200 $W/petrel-cuda bench --model $S --act-quant off --relayout off --prompt 512 --golden-out $G 2>&1 | tail -1
    echo "== cpu default"; timeout 200 $W/petrel-cuda bench --model $S --golden $G 2>&1 | tail -1
    for spec in ${QF:-int8 wgmma+wgmma wgmma+wgmma+x}; do
        echo "== cuda $spec"; timeout 60 $W/${BIN:-petrel-cuda} bench --model $S --device cuda --golden $G $(forms "$spec") 2>&1 | tail -1
    done ;;
cpu)
    slice 1 /tmp/s1d1m.pack; slice 2 /tmp/s1d2m.pack
    for round in 1 2; do
        for n in 1 2; do
            echo "== round $round 1d${n}m"
            taskset -c 0,1 $W/petrel-cuda bench --model /tmp/s1d${n}m.pack --prompt 32 --ctx 512 --steps 16 --prefill-runs 1 --threads 2 \
                $([ $n = 2 ] && echo --batch 8) 2>&1 | tee -a "$OUT/cpu-1d${n}m.txt" | grep -E "bandwidth:|decode at|batched decode|paired" | cut -c1-300
        done
    done ;;
ab)
    S=/tmp/s1d${MOE:-4}m.pack
    slice "${MOE:-4}" $S
    for round in $(seq "${ROUNDS:-2}"); do
        for b in ${BINS:-petrel-cuda-base petrel-cuda}; do
            echo "== round $round $b"
            timeout 60 $W/$b bench --model $S --device cuda --prompt ${PROMPT:-2048} --ctx ${PROMPT:-2048} --steps 1 --prefill-runs 2 --profile 2>&1 | tee -a "$OUT/ab-$b.txt" |
                grep -E "^prefill:|routed experts: (gate|down)|attention (core|projections)|head products|router|o_proj|dense mlp" | head -9
            [ "${DECODE:-1}" = 0 ] || timeout 60 $W/$b bench --model $S --device cuda --prompt 64 --ctx 2048 --steps 32 --prefill-runs 1 2>&1 | tee -a "$OUT/ab-$b.txt" | grep -E "^decode at"
        done
    done ;;
ncu)
    # one launch of kernel KERNEL (regex; default the routed experts' wgmma GEMM) in a 1d4m prefill
    # of 2048 tokens, SKIP launches in: the details page's throughputs and stall shares, then the
    # source page (SASS, with the -lineinfo device-pack.sh builds) as CSV, its hottest 60 lines
    command -v ncu > /dev/null || { echo "device-run.sh: no ncu on this machine" >&2; exit 1; }
    slice 4 $S
    timeout 400 ncu --clock-control none --set full --import-source yes --kernel-name-base demangled -k "regex:${KERNEL:-k_gemm_w4g}" --launch-skip ${SKIP:-4} --launch-count 1 \
        -o "$OUT/prof" $W/${BIN:-petrel-cuda} bench --model $S --device cuda --prompt 2048 --ctx 2048 --steps 1 --prefill-runs 1 > "$OUT/ncu-run.txt" 2>&1
    echo "ncu rc=$?"; tail -3 "$OUT/ncu-run.txt"
    ncu --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
    grep -E "Duration|Throughput|Issue Slots|Executed Ipc|Registers|Stall|Warp Cycles|Occupancy" "$OUT/details.txt" | head -40
    ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2>&1
    echo "source page: $(wc -l < "$OUT/source.csv") lines"; head -2 "$OUT/source.csv" | cut -c1-400 ;;
kernels)
    # every kernel launch of one 1d4m prefill of PROMPT tokens (default 2048; then one decode
    # step, whose launches come last), each timed alone by ncu (serialized: no overlap, PDL or
    # side stream), summed by function name: the whole prompt's map in one call
    command -v ncu > /dev/null || { echo "device-run.sh: no ncu on this machine" >&2; exit 1; }
    slice 4 $S
    timeout 500 ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name-base function \
        $W/${BIN:-petrel-cuda} bench --model $S --device cuda --prompt ${PROMPT:-2048} --ctx ${PROMPT:-2048} --steps 1 --prefill-runs 1 > "$OUT/kernels.csv" 2> "$OUT/kernels-err.txt"
    echo "ncu rc=$?"
    # launches before the first k_embed (the open's unpacking) and the peak and bandwidth probes are left out; the
    # prompt is the launches from the first k_embed to the second, one decode step the last k_embed on
    for part in prompt decode; do
        echo "== $part (each launch alone, summed by name)"
        awk -F'","' -v part=$part '{ sub(/^"/, ""); sub(/"$/, "") }
            /Kernel Name/ && !k { for (i = 1; i <= NF; i++) { if ($i == "Kernel Name") k = i; if ($i == "Metric Value") v = i; if ($i == "Metric Unit") u = i }; next }
            k && v && NF >= v && $k !~ /^k_(wgmma_|mma_)?peak|^k_read/ { if ($k ~ /^k_embed/) seg++; nm[NR] = $k; sg[NR] = seg; gsub(/,/, "", $v); t = $v + 0
                 if ($u ~ /usecond/) t *= 1000; if ($u ~ /msecond/) t *= 1e6; tt[NR] = t }
            END { for (r in nm) if ((part == "prompt" && sg[r] == 1) || (part == "decode" && sg[r] == seg && seg > 1)) { ns[nm[r]] += tt[r]; n[nm[r]]++; all += tt[r] }
                  for (x in ns) printf "%10.1f us %6.1f %%  %5d launches  %s\n", ns[x] / 1000, 100 * ns[x] / all, n[x], x
                  printf "%10.1f us total\n", all / 1000 }' "$OUT/kernels.csv" | sort -rn | head -30
    done ;;
goldens)
    S=/tmp/s1d${MOE:-1}m.pack
    slice "${MOE:-1}" $S
    first=
    for v in ${VARIANTS:-base: new: new:--cuda-pdl,off new:--cuda-experts,wgmma new:--cuda-dense,wgmma new:--cuda-experts,wgmma,--cuda-dense,wgmma}; do
        b=${v%%:*}; a=${v#*:}; a=${a//,/ }; bin=petrel-cuda; [ "$b" = new ] || bin=petrel-cuda-$b
        g=/tmp/golden-$(echo "$v" | tr -c 'a-zA-Z0-9' _).st
        timeout 60 $W/$bin bench --model $S --device cuda --prompt ${PROMPT:-1024} --golden-out $g $a 2>&1 | grep -E "rror" | head -3
        if [ -z "$first" ]; then first=$g; echo "== $v: the reference"; continue; fi
        cmp -s $first $g && echo "== $v: the same bits" || {
            echo "== $v: differs ($(cmp $first $g | head -1))"
            timeout 60 $W/$bin bench --model $S --device cuda --golden $first $a 2>&1 | tail -1
        }
    done ;;
trace)
    S=/tmp/s1d${MOE:-4}m.pack
    slice "${MOE:-4}" $S
    timeout 200 $W/cu_trace $S ${PROMPT:-2048} ${STEPS:-8} > "$OUT/trace.txt" 2>&1
    echo "cu_trace rc=$?"; grep -E "^decode step" "$OUT/trace.txt"; sed -n '/^step span/,$p' "$OUT/trace.txt" | head -26 ;;
*) echo "device-run.sh: unknown mode $1 (tests, bench, quality, cpu, ab, ncu, kernels, goldens, trace)" >&2; exit 2 ;;
esac
