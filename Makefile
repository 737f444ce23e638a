# petrel build. Targets:
#   make            library + CLI (build/petrel)
#   make test       builds and runs every test (no network, no GPU); ends "N passed, N failed"
#   make asan       the same tests under AddressSanitizer + UBSan (build-asan/)
#   make fuzz       libFuzzer targets (clang) in build-fuzz/
#   make bench      the benchmark on a synthetic GLM-5.2 slice
#   make cuda       build/petrel-cuda and build/petrel-tests-cuda: the same programs with the
#                   CUDA backend (src/cuda, nvcc, sm_90a); `make test` builds them when nvcc
#                   is installed and runs their `cuda` group first (the GPU tests skip, counted,
#                   where no GPU is visible), then every test of the CPU build; also
#                   build/cu_gemv_bench (the decode GEMVs at GLM-5.2's shapes against a read probe)
#                   and, where CUPTI is installed, build/cu_trace (a decode step's kernels on the
#                   GPU's clock, its CUDA graph included)
#   make deps       installs missing Debian packages (also run by the targets above)
#   make demo       builds and runs the bundled trained model on a prompt (the README's first
#                   command; `make run-tiny` is the same)
BUILD  ?= build
CC     ?= cc
OPT    ?= -O2
SAN    ?=
CFLAGS_NOSAN = -std=c11 $(OPT) -g -Wall -Wextra -Werror -D_GNU_SOURCE -fno-strict-aliasing \
               -Iinclude -Isrc -pthread
CFLAGS_BASE = $(CFLAGS_NOSAN) $(SAN)
# Sanitizers of the instruction-set kernel files (*_avx2/_avx512/_amx.c): SAN unless told. The
# fuzz build leaves UBSan out of them: clang's UBSan takes over ten minutes on r16_avx512.c alone
# (its always-inline kernels unrolled for every row count and prefetch kind), and no fuzz target
# reaches a kernel; `make asan` runs the kernels' tests under both sanitizers.
KSAN ?= $(SAN)
OSAN = $(SAN)
LDLIBS = -lcjson -lpcre2-8 -lutf8proc -luring -lxxhash -lmicrohttpd -lz -lm -lpthread

# Instruction-set files get their flags by name; the rest of the code stays baseline x86-64 and
# picks kernels at run time from CPUID (src/kernels/dispatch.c).
ISA_avx2   = -mavx2 -mfma -mf16c
ISA_avx512 = -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16
ISA_amx    = $(ISA_avx512) -mamx-tile -mamx-int8 -mamx-bf16

LIB_SRC   := $(sort $(shell find src -name '*.c'))
CLI_SRC   := $(sort $(wildcard cli/*.c))
TEST_SRC  := $(sort $(wildcard tests/*.c))
LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CLI_OBJ   := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TEST_OBJ  := $(TEST_SRC:%.c=$(BUILD)/obj/%.o)

# The CUDA backend: src/cuda/*.cu with nvcc into the -cuda twins (libpetrel.a keeps the stub
# src/cuda/none.c, so the default build needs no CUDA). The runtime is linked statically.
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || (test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc))
NVFLAGS    = -std=c++17 -O3 -gencode arch=compute_90a,code=[sm_90a,compute_90a] -Iinclude -Isrc -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter
CUDA_LIBS  = -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
CU_SRC    := $(sort $(wildcard src/cuda/*.cu))
CU_OBJ    := $(CU_SRC:%.cu=$(BUILD)/obj/%.o)
LIB_OBJ_CUDA := $(filter-out $(BUILD)/obj/src/cuda/none.o,$(LIB_OBJ)) $(CU_OBJ)
# what `make test` adds: the CUDA twins where nvcc is installed (not in sanitizer builds)
CUPTI_H := $(wildcard $(CUDA_HOME)/include/cupti.h)
TEST_CUDA := $(if $(and $(NVCC),$(if $(SAN),,yes)),$(BUILD)/petrel-cuda $(BUILD)/petrel-tests-cuda $(if $(CUPTI_H),$(BUILD)/cu_trace))

.PHONY: all deps test asan fuzz bench demo run-tiny clean cuda
all: deps $(BUILD)/petrel

deps:
	@sh scripts/install-deps.sh

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_NOSAN) $(OSAN) $(ISA) -MMD -MP -c $< -o $@

$(BUILD)/obj/%_avx2.o:   ISA = $(ISA_avx2)
$(BUILD)/obj/%_avx512.o: ISA = $(ISA_avx512)
$(BUILD)/obj/%_amx.o:    ISA = $(ISA_amx)
$(BUILD)/obj/%_avx2.o $(BUILD)/obj/%_avx512.o $(BUILD)/obj/%_amx.o: OSAN = $(KSAN)

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libpetrel-cuda.a: $(LIB_OBJ_CUDA)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/petrel-cuda: $(CLI_OBJ) $(BUILD)/libpetrel-cuda.a
	$(CC) $(CFLAGS_BASE) -o $@ $(CLI_OBJ) $(BUILD)/libpetrel-cuda.a $(LDLIBS) $(CUDA_LIBS)

$(BUILD)/petrel-tests-cuda: $(TEST_OBJ) $(BUILD)/libpetrel-cuda.a
	$(CC) $(CFLAGS_BASE) -o $@ $(TEST_OBJ) $(BUILD)/libpetrel-cuda.a $(LDLIBS) $(CUDA_LIBS)

$(BUILD)/cu_gemv_bench: bench/cu_gemv_bench.cu $(BUILD)/libpetrel-cuda.a
	$(NVCC) $(NVFLAGS) -o $@ $< $(BUILD)/libpetrel-cuda.a

# the decode step's kernels on the GPU's clock (CUPTI, part of the CUDA toolkit: built where it is)
$(BUILD)/cu_trace: bench/cu_trace.c $(BUILD)/libpetrel-cuda.a
	$(CC) $(CFLAGS_BASE) -I$(CUDA_HOME)/include -o $@ $< $(BUILD)/libpetrel-cuda.a $(LDLIBS) $(CUDA_LIBS) -lcupti

cuda: deps
	@test -n "$(NVCC)" || { echo "make cuda: nvcc not found (install CUDA 13 at $(CUDA_HOME) or put nvcc on PATH)"; exit 1; }
	$(MAKE) $(BUILD)/petrel-cuda $(BUILD)/petrel-tests-cuda $(BUILD)/cu_gemv_bench $(if $(CUPTI_H),$(BUILD)/cu_trace)

$(BUILD)/libpetrel.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/petrel: $(CLI_OBJ) $(BUILD)/libpetrel.a
	$(CC) $(CFLAGS_BASE) -o $@ $(CLI_OBJ) $(BUILD)/libpetrel.a $(LDLIBS)

$(BUILD)/petrel-tests: $(TEST_OBJ) $(BUILD)/libpetrel.a
	$(CC) $(CFLAGS_BASE) -o $@ $(TEST_OBJ) $(BUILD)/libpetrel.a $(LDLIBS)

test: deps $(BUILD)/petrel $(BUILD)/petrel-tests $(TEST_CUDA)
	$(if $(TEST_CUDA),PETREL_BIN=./$(BUILD)/petrel-cuda ./$(BUILD)/petrel-tests-cuda cuda)
	PETREL_BIN=./$(BUILD)/petrel ./$(BUILD)/petrel-tests $(TESTS)

asan:
	$(MAKE) BUILD=build-asan OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

FUZZ_SRC := $(sort $(wildcard fuzz/*.c))
fuzz: deps
	@mkdir -p build-fuzz
	$(MAKE) BUILD=build-fuzz CC=clang OPT=-O1 SAN="-fsanitize=fuzzer-no-link,address,undefined" \
	  KSAN="-fsanitize=fuzzer-no-link,address" build-fuzz/libpetrel.a
	for f in $(FUZZ_SRC); do \
	  n=$$(basename $$f .c); \
	  clang $(CFLAGS_BASE) -O1 -fsanitize=fuzzer,address,undefined -o build-fuzz/$$n $$f build-fuzz/libpetrel.a $(LDLIBS) || exit 1; \
	done
	@echo "fuzz targets in build-fuzz/; run e.g. build-fuzz/fuzz_safetensors -max_total_time=60 fuzz/corpus/safetensors"

bench: all
	./$(BUILD)/petrel synth --shape glm5.2 --dense-layers 1 --moe-layers 1 --out $(BUILD)/glm52-slice.pack
	./$(BUILD)/petrel bench --model $(BUILD)/glm52-slice.pack

# The bundled model (tests/data/trained) was trained on the Python documentation: it writes
# documentation-like text (reStructuredText), streamed token by token as it is produced.
demo: all
	@echo "--- tests/data/trained: a small GLM-5-architecture model trained on the Python docs ---"
	@echo "--- greedy (--temp 0), prompt: The os module provides"
	./$(BUILD)/petrel run --model tests/data/trained -p 'The os module provides' -n 64 --temp 0
	@echo
	@echo "--- sampled (--temp 0.7 --seed 1: the same text every run), prompt: To read a file line by line,"
	./$(BUILD)/petrel run --model tests/data/trained -p 'To read a file line by line,' -n 96 --temp 0.7 --seed 1 -v
	@echo
run-tiny: demo

clean:
	rm -rf build build-asan build-fuzz

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
