# train_gpt: build, test, benchmark and data targets.
#   make              build everything (train_gpt, test_gpt, prepro, dev kernels)
#   make test         build everything and run the test suite (GPU tests skip without a GPU)
#   make data         fetch and tokenize the default corpus into data/default/
#   make train        prepare the default data if missing, then train on it
#   make bench        train on synthetic tokens and print one JSON line of throughput figures
#   make plot         out/log.jsonl (the last run's log) as out/log.png: loss, tokens/s, lr, grad norm
#   make libsteptrace.so  the kernel timeline recorder that scripts/trace_step.sh loads into a run
NVCC      ?= nvcc
CC        ?= gcc
GPU_ARCH  ?= -gencode=arch=compute_90a,code=sm_90a
NVFLAGS   ?= -O3 -std=c++17 $(GPU_ARCH) --use_fast_math -Xcompiler -Wall,-Wno-unused-function,-Wno-format-truncation
CFLAGS    ?= -O2 -std=c11 -Wall -Wextra -Wno-unused-function -Wno-format-truncation
LIBS      := -lcublasLt -lnccl -lpthread
HEADERS   := lib/cuda_check.h lib/util.h lib/ptx.cuh lib/attention.cuh lib/fp8_codes.cuh lib/fp8.cuh lib/matmul_hopper.cuh kernels.cuh data.h lib/tokenizer.h lib/unicode_classes.h ckpt.h lib/config.h comm.h
TEST_HEADERS := test/testing.h test/reference.h test/test_data.h test/test_ckpt.h test/test_comm.h test/test_fp8.h test/test_inputs.h test/test_optim.h

.PHONY: all test data train bench plot dev clean
all: train_gpt test_gpt prepro dev libsteptrace.so

train_gpt: train_gpt.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) $< -o $@ $(LIBS)

test_gpt: test_gpt.cu train_gpt.cu $(TEST_HEADERS) $(HEADERS)
	$(NVCC) $(NVFLAGS) $< -o $@ $(LIBS)

# the tool's source is in tools/, its binary stays at the top (./prepro, as the scripts call it)
prepro: tools/prepro.c data.h lib/util.h lib/tokenizer.h lib/unicode_classes.h
	$(CC) $(CFLAGS) $< -o $@ -lpthread

# loaded into a CUDA program by the driver (CUDA_INJECTION64_PATH), it records every kernel through CUPTI
libsteptrace.so: tools/steptrace.c
	$(NVCC) -shared -cudart none -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unused-function $< -o $@ -lcupti

dev: dev/attention dev/matmul

dev/attention: dev/attention.cu dev/common.h $(wildcard dev/attention*.cuh) kernels.cuh lib/attention.cuh lib/fp8_codes.cuh lib/ptx.cuh \
               lib/cuda_check.h
	$(NVCC) $(NVFLAGS) -lineinfo $< -o $@ $(LIBS)

# the matmul ladder includes the trainer itself (its parameter table gives the shapes)
dev/matmul: dev/matmul.cu dev/common.h dev/matmul*.cuh dev/attention_fa2.cuh train_gpt.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) -lineinfo $< -o $@ $(LIBS)

test: all
	./test_gpt

data: prepro
	bash scripts/prepare_data.sh

train: train_gpt
	@[ -f data/default/.done ] || $(MAKE) data
	./train_gpt

bench: train_gpt
	./train_gpt --bench

plot:
	python3 scripts/plot_log.py out/log.jsonl out/log.png

clean:
	rm -f train_gpt test_gpt prepro libsteptrace.so dev/attention dev/matmul
