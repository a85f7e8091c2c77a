/*
 * test/test_inputs.h - every class of bad input to ./train_gpt and ./prepro, run as a user would
 * run them; test_gpt.cu includes this file and runs input_tests. None needs a GPU: train_gpt
 * checks what it will read before it looks for one.
 *
 * The contract each case checks: the exit code (2 for a flag outside its domain, 1 for a bad
 * file), and stderr exactly one line that names the flag, the file or the key at fault. For
 * prepro, also that a failure or an interrupt part-way leaves no shards where they were asked for.
 * Each test works in its own mkdtemp directory and removes it.
 */
#ifndef TEST_INPUTS_H
#define TEST_INPUTS_H

#include <signal.h>
#include <unistd.h>

typedef struct {
    const char* args;  // after ./train_gpt or ./prepro; %s is the test's directory (up to 3 times)
    int code;
    const char* says;  // the one line must contain this
} BadInput;

static int ti_write(const char* dir, const char* name, const char* text) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return test_write_file(path, text, strlen(text));
}

// Runs `program` with each case's arguments; returns the number of cases that broke the contract.
static int ti_run_cases(const char* program, const BadInput* cases, size_t n, const char* dir) {
    int failed = 0;
    for (size_t i = 0; i < n; i++) {
        char args[1024], cmd[1200], err[2048];
        snprintf(args, sizeof(args), cases[i].args, dir, dir, dir);
        snprintf(cmd, sizeof(cmd), "%s %s", program, args);
        int code = run_command(cmd, err, sizeof(err));
        size_t len = strlen(err);
        const char* newline = strchr(err, '\n');
        bool one_line = len > 0 && newline == err + len - 1;
        EXPECT(code == cases[i].code && one_line && strstr(err, cases[i].says),
               "'%s': exit %d (want %d), stderr '%s' (want one line containing '%s')", cmd, code, cases[i].code,
               err, cases[i].says);
    }
    return failed;
}

static bool ti_have(const char* program) {
    if (access(program, X_OK) == 0) return true;
    printf("    %s is not built; run make\n", program);
    return false;
}

// A flag's value outside its domain: exit 2, the flag named.
static int test_train_flag_domains(void) {
    if (!ti_have("./train_gpt")) return TEST_FAIL;
    const BadInput cases[] = {
        {"--recompute 2", 2, "bad value '2' for --recompute: it takes '0', '1' or 'auto'"},
        {"--recompute Auto", 2, "bad value 'Auto' for --recompute"},
        {"--deterministic yes", 2, "--deterministic"},
        {"--wsd -1", 2, "--wsd"},
        {"--ckpt-keep-going 3", 2, "--ckpt-keep-going"},
        {"--fp8 2", 2, "--fp8"},
        {"--fp8-scaling fast", 2, "--fp8-scaling"},
        {"--fp8-scaling delay", 2, "bad value 'delay' for --fp8-scaling: it takes 'delayed' or 'current'"},
        {"--fp8 1 --fp8-head 2", 2, "--fp8-head"},
        {"--fp8-head 1", 2, "need --fp8 1"},
        {"--fp8-fast-accum 1", 2, "need --fp8 1"},
        {"--fp8-log-scales 1 --fp8 0", 2, "need --fp8 1"},
        {"--fp8 1 --fp8-fast-accum yes", 2, "--fp8-fast-accum"},
        {"--cuda-graph 2", 2, "--cuda-graph"},
        {"--cuda-graph on", 2, "--cuda-graph"},
        {"--fp8 1 --fp8-head 1 --loss-chunk 1000", 2, "--loss-chunk to be multiples of 16"},
        {"--fp8 1 --ffn 2040", 2, "--fp8 needs B x T and every matrix side a multiple of 16 (down is 768 x 2040"},
        {"--fp8 1 --batch 3 --seq 100", 2, "--fp8 needs B x T and every matrix side a multiple of 16 (B x T is 300)"},
        {"--fp8 0 --ffn 2040 --batch 3 --seq 100 --zero 3", 2, "--zero"},  // BF16 takes any sides
        {"--fp8 1 --fp8-head 1 --vocab 50264", 2, "--fp8-head 1 needs the vocabulary size"},
        {"--seed -1", 2, "--seed"},
        {"--sample-seed 18446744073709551616", 2, "--sample-seed"},
        {"--steps -5", 2, "--steps"},
        {"--batch 99999999999", 2, "--batch"},
        {"--stop-at 400 --steps 300", 2, "--stop-at"},
        {"--val-every -1", 2, "--val-every"},
        {"--keep-last 0", 2, "--keep-last"},
        {"--zero 3", 2, "--zero"},
        {"--gpus -1", 2, "--gpus"},
        {"--gpus 0 --zero 3", 2, "--zero"},  // --gpus 0 counts GPUs only after the checks that need none
        {"--gpus 0 --fp8-head 1", 2, "need --fp8 1"},
        {"--timeout nan", 2, "--timeout"},
        {"--max-memory -1", 2, "--max-memory must be >= 0 GiB"},
        {"--max-memory nan", 2, "--max-memory"},
        {"--lr inf", 2, "--lr"},
        {"--peak-tflops 0", 2, "--peak-tflops"},
        {"--heads 4 --init-from %s", 2, "--heads"},
        {"--lr '1\n2'", 2, "bad value '1\\x0a2' for --lr"},
    };
    char dir[64];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = ti_run_cases("./train_gpt", cases, sizeof(cases) / sizeof(cases[0]), dir);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// A shard of n tokens, as prepro writes it.
static int ti_shard(const char* dir, const char* name, int n) {
    char path[1024], err[512];
    uint16_t* tokens = (uint16_t*)xmalloc((size_t)n * sizeof(uint16_t));
    for (int i = 0; i < n; i++) tokens[i] = (uint16_t)(i * 7 % 50257);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int rc = shard_write(path, tokens, (size_t)n, err, sizeof(err));
    free(tokens);
    return rc;
}

#define TI_TOK "--tokenizer %s/tok "  // the test's own (ti_byte_tokenizer): the first %s
#define TI_RUN "--batch 1 --seq 64 --val-data '' --sample-every 0 --train-data %s/train_*.bin "

// Paths that lead nowhere, a shard that is not one, a missing tokenizer, a resume with nothing to
// resume: exit 1, the file named, before any GPU is looked for. Then, with every input good, the
// plain no-GPU line.
static int test_train_missing_inputs(void) {
    if (!ti_have("./train_gpt")) return TEST_FAIL;
    char dir[64];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = 0;
    EXPECT(ti_shard(dir, "train_000000.bin", 1000) == 0 && ti_write(dir, "val_000000.bin", "not a shard") == 0,
           "making the shards");
    const BadInput cases[] = {
        {"--batch 1 --seq 64 --train-data %s/nope_*.bin", 1, "nope_*.bin"},
        {"--batch 1 --seq 64 --train-data %s/train_*.bin --val-data %s/val_*.bin", 1,
         "val_000000.bin: the file is 11 bytes, shorter than the 1024-byte header"},
        {"--batch 1 --seq 64 --train-data %s/train_*.bin --val-data %s/none_*.bin", 1, "none_*.bin"},
        {"--batch 1 --seq 64 --val-data '' --train-data %s/train_*.bin --tokenizer %s/no_tokenizer", 1, "no_tokenizer"},
        {TI_RUN "--resume %s/no_checkpoint", 1, "no_checkpoint/manifest.json"},
        {TI_RUN "--gpus 0 --resume %s/no_checkpoint", 1, "no_checkpoint/manifest.json"},
        {TI_RUN "--resume latest --out %s/no_out", 1, "no_out"},
        {"--init-from %s/no_model", 1, "no_model/config.json"},
        {"--train-data '%s/a\nb'", 1, "a\\x0ab"},
    };
    failed |= ti_run_cases("./train_gpt", cases, sizeof(cases) / sizeof(cases[0]), dir);
    if (!g_have_gpu) {
        const BadInput no_gpu[] = {{TI_RUN "--out %s/out", 1, "no CUDA GPU found (no NVIDIA driver is loaded"},
                                   {TI_RUN "--recompute auto --out %s/out", 1, "no CUDA GPU found"},
                                   {TI_RUN "--out %s/out --gpus 0", 1, "--gpus 0 (every GPU): this machine has no CUDA GPU"}};
        failed |= ti_run_cases("./train_gpt", no_gpu, sizeof(no_gpu) / sizeof(no_gpu[0]), dir);
    } else {  // a plan over --max-memory, with auto's choice too: refused before anything is allocated
        const BadInput over[] = {
            {TI_RUN "--max-memory 0.05 --out %s/out", 1, "--max-memory 0.05 GiB: this config plans"},
            {TI_RUN "--recompute auto --max-memory 0.05 --out %s/out", 1, "with 12 of 12 layers recomputed); lower --batch"}};
        failed |= ti_run_cases("./train_gpt", over, sizeof(over) / sizeof(over[0]), dir);
    }
    remove_test_dir(dir);
    return TEST_RESULT;
}

// config.json, read strictly: each malformed one is exit 1 naming the file and the key. The good
// one gets past config.json to the weights, whose safetensors header is read before the GPU too.
static int test_train_bad_config_json(void) {
    if (!ti_have("./train_gpt")) return TEST_FAIL;
    const char* good =
        "{\"model_type\": \"qwen3\", \"vocab_size\": 512, \"hidden_size\": 128, \"intermediate_size\": 256, "
        "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 64, "
        "\"rms_norm_eps\": 1e-06, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}";
    struct {
        const char *from, *to;  // the good config with `from` replaced by `to`
        const char* says;
    } cases[] = {
        {"\"hidden_size\": 128", "\"hidden_size\": \"128\"", "\"hidden_size\" is not a number"},
        {"\"hidden_size\": 128, ", "", "no \"hidden_size\""},
        {"\"num_attention_heads\": 4", "\"num_attention_heads\": 4294967296", "\"num_attention_heads\" is 4294967296"},
        {"\"num_hidden_layers\": 2", "\"num_hidden_layers\": -2", "\"num_hidden_layers\" is -2"},
        {"\"intermediate_size\": 256", "\"intermediate_size\": 256.5", "\"intermediate_size\" is 256.5"},
        {"10000.0", "1e999", "\"rope_theta\" is inf"},
        {"10000.0", "NaN", "\"rope_theta\" is nan"},
        {"1e-06", "1e300", "\"rms_norm_eps\" is 1e+300"},
        {"\"head_dim\": 64", "\"head_dim\": 64, \"head_dim\": 128", "key \"head_dim\" appears twice"},
        {"true}", "true,}", "config.json: bad JSON at byte"},
        {"\"qwen3\"", "\"llama\"", "\"model_type\" is not \"qwen3\""},
        {"true}", "0}", "\"tie_word_embeddings\" is not true"},
        {"", "", "model.safetensors"},  // the good one: on to the weights, which are not there
    };
    char dir[64];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char text[1024];
        const char* at = strstr(good, cases[i].from);
        snprintf(text, sizeof(text), "%.*s%s%s", (int)(at - good), good, cases[i].to, at + strlen(cases[i].from));
        EXPECT(ti_write(dir, "config.json", text) == 0, "writing config.json");
        const BadInput c = {"--init-from %s", 1, cases[i].says};
        failed |= ti_run_cases("./train_gpt", &c, 1, dir);
    }
    char path[128];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    EXPECT(test_write_file(path, "\x10\0\0\0\0\0\0\0{\"a\": 1}        ", 24) == 0, "writing the weights");
    const BadInput weights = {"--init-from %s", 1, "model.safetensors: tensor 'a'"};
    failed |= ti_run_cases("./train_gpt", &weights, 1, dir);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// A checkpoint's manifest, read before the GPU: malformed, a config that is not this run's, a
// listed file missing or of the wrong size. Exit 1, the file and the key or file named.
static int test_train_bad_checkpoint(void) {
    if (!ti_have("./train_gpt")) return TEST_FAIL;
    char dir[64], ckpt[128];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = 0;
    snprintf(ckpt, sizeof(ckpt), "%s/ckpt_6", dir);
    EXPECT(ti_shard(dir, "train_000000.bin", 1000) == 0 && mkdir(ckpt, 0755) == 0 && ti_write(ckpt, "x.bin", "abc") == 0,
           "making a shard and a checkpoint directory");
    const char* head = "{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 6, \"config\": "
                       "{\"vocab_size\": 50304, \"d_model\": 768, \"n_layer\": 12, \"n_head\": 6, \"n_kv_head\": 2, "
                       "\"head_dim\": 128, \"ffn_dim\": 2048, \"seq_len\": 64, \"rope_theta\": 10000, ";
    struct {
        const char* tail;  // of the manifest, after head
        const char* flags;
        const char* says;
    } cases[] = {
        {"\"norm_eps\": 1e-06}, \"files\": {}", "", "manifest.json: bad JSON at byte"},
        {"\"norm_eps\": 1e-06, \"n_layer\": 2}, \"files\": {}}", "", "key \"n_layer\" appears twice"},
        {"\"eps\": 1e-06}, \"files\": {}}", "", "the checkpoint's config: no \"norm_eps\""},
        {"\"norm_eps\": 1e-06}, \"files\": {}}", "--layers 4", "n_layer is 12, this run's (--layers) is 4"},
        {"\"norm_eps\": 1e-05}, \"files\": {}}", "", "norm_eps is 9.99999975e-06, this run's (--norm-eps)"},
        {"\"norm_eps\": 1e-06}, \"files\": {\"model.safetensors\": {\"bytes\": 8, \"crc32c\": \"00000000\"}}}", "",
         "ckpt_6/model.safetensors: listed in the manifest but cannot be opened"},
        {"\"norm_eps\": 1e-06}, \"files\": {\"x.bin\": {\"bytes\": 8, \"crc32c\": \"00000000\"}}}", "",
         "x.bin: 3 bytes, but the manifest says 8"},
        {"\"norm_eps\": 1e-06}, \"files\": {}}", "", "no CUDA GPU found"},  // good (checked without a GPU)
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char text[1024], args[256];
        snprintf(text, sizeof(text), "%s%s", head, cases[i].tail);
        EXPECT(ti_write(ckpt, "manifest.json", text) == 0, "writing the manifest");
        snprintf(args, sizeof(args), "%s%s --resume %%s/ckpt_6", TI_RUN, cases[i].flags);
        const BadInput c = {args, 1, cases[i].says};
        if (strcmp(cases[i].says, "no CUDA GPU found") || !g_have_gpu) failed |= ti_run_cases("./train_gpt", &c, 1, dir);
    }
    // --resume latest, with no `latest` file: the newest ckpt_<step>, whose manifest is then read
    const BadInput latest = {TI_RUN "--layers 4 --resume latest --out %s", 1,
                             "ckpt_6/manifest.json: the checkpoint's n_layer is 12, this run's (--layers) is 4"};
    failed |= ti_run_cases("./train_gpt", &latest, 1, dir);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// The smallest tokenizer prepro takes: the 256 bytes and <|endoftext|>, no merges, as
// encoder.json (also left in json) and vocab.bpe in dir/tok; so these tests need no download.
static int ti_byte_tokenizer(const char* dir, ByteBuf* json) {
    json->len = 0;
    byte_buf_append(json, "{", 1);
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        td_json_entry(json, b, &c, 1);
    }
    td_json_entry(json, 256, EOT_TEXT, strlen(EOT_TEXT));
    byte_buf_append(json, "}", 1);
    char path[128];
    snprintf(path, sizeof(path), "%s/tok", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/tok/encoder.json", dir);
    int rc = test_write_file(path, json->data, json->len);
    snprintf(path, sizeof(path), "%s/tok/vocab.bpe", dir);
    return rc || test_write_file(path, "#version: 0.2\n", 14);
}

// Whether dir holds an entry whose name starts with prefix.
static bool ti_any(const char* dir, const char* prefix) {
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "ls -a '%s' | grep -q '^%s'", dir, prefix);
    return system(cmd) == 0;
}

// prepro's inputs: empty, not text, no documents, a malformed JSONL line, a count that would wrap.
// After each, no output directory, and no staging directory beside it.
static int test_prepro_bad_inputs(void) {
    if (!ti_have("./prepro")) return TEST_FAIL;
    char dir[64];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = 0;
    ByteBuf json = {NULL, 0, 0};
    EXPECT(ti_byte_tokenizer(dir, &json) == 0, "writing a tokenizer");
    free(json.data);
    EXPECT(ti_write(dir, "empty.txt", "") == 0 && ti_write(dir, "blank.jsonl", "\n  \n") == 0 &&
               ti_write(dir, "good.txt", "Some text.\n") == 0 &&
               ti_write(dir, "bad.jsonl", "{\"text\": \"one\"}\n{\"text\": \"two\"} x\n") == 0 &&
               ti_write(dir, "out_file", "not a directory") == 0,
           "writing the inputs");
    char path[128];
    snprintf(path, sizeof(path), "%s/binary.txt", dir);
    EXPECT(test_write_file(path, "GIF89a\0\0\x01", 9) == 0, "writing %s", path);
    const BadInput cases[] = {
        {TI_TOK "-o %s/out %s/empty.txt", 1, "empty.txt: empty file"},
        {TI_TOK "-o %s/out %s/binary.txt", 1, "binary.txt: not a text file: byte 6 is NUL"},
        {TI_TOK "-o %s/out %s/blank.jsonl", 1, "blank.jsonl: no documents"},
        {TI_TOK "-o %s/out %s/bad.jsonl", 1, "bad.jsonl:2: characters after the object"},
        {TI_TOK "-o %s/out %s/nothing.txt", 1, "nothing.txt: No such file or directory"},
        {TI_TOK "-o %s/out_file %s/good.txt", 1, "out_file: exists and is not a directory"},
        {TI_TOK "-o %s/out --val-every 99999999999 %s/good.txt", 2,
         "--val-every needs a whole number from 0 to 2147483647"},
        {TI_TOK "-o %s/out --shard-tokens -1 %s/good.txt", 2, "--shard-tokens"},
        {"-o %s/out --tokenizer %s/none good.txt", 1, "none"},
        {"--bogus", 2, "unknown option --bogus"},
    };
    failed |= ti_run_cases("./prepro", cases, sizeof(cases) / sizeof(cases[0]), dir);
    EXPECT(!ti_any(dir, "out\\."), "a staging directory was left in %s", dir);
    snprintf(path, sizeof(path), "%s/out", dir);
    EXPECT(access(path, F_OK) != 0, "%s was made by a run that failed", path);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// prepro stopped part-way, by an error after shards were written or by SIGTERM and SIGINT: OUT
// holds no shard (nor exists), and no staging directory is left beside it.
static int test_prepro_stops_leave_nothing(void) {
    if (!ti_have("./prepro")) return TEST_FAIL;
    char dir[64], path[128], cmd[1024], err[1024];
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    int failed = 0;
    ByteBuf json = {NULL, 0, 0};
    EXPECT(ti_byte_tokenizer(dir, &json) == 0, "writing a tokenizer");
    free(json.data);
    // 10000 documents of ~2 KB, then a bad line: shards (of 100000 byte tokens) are written before it
    snprintf(path, sizeof(path), "%s/docs.jsonl", dir);
    FILE* f = fopen(path, "w");
    for (int i = 0; f && i < 10000; i++) {
        fprintf(f, "{\"text\": \"");
        for (int k = 0; k < 40; k++) fprintf(f, "document %d, sentence %d of a few words. ", i, k);
        fprintf(f, "\"}\n");
    }
    if (f) fprintf(f, "{\"txt\": 1}\n");
    EXPECT(f && fclose(f) == 0, "writing %s", path);
    snprintf(cmd, sizeof(cmd), "./prepro --tokenizer %s/tok -o %s/out --shard-tokens 100000 %s/docs.jsonl", dir, dir, dir);
    int code = run_command(cmd, err, sizeof(err));
    EXPECT(code == 1 && strstr(err, "docs.jsonl:10001: no \"text\" field"), "exit %d, '%s'", code, err);
    const char* signals[] = {"TERM", "INT"};
    const int numbers[] = {SIGTERM, SIGINT};
    for (int k = 0; k < 2; k++) {
        // signalled once its staging directory is there (the input takes about a second); the
        // shell's `wait` gives 128 + the signal
        snprintf(cmd, sizeof(cmd), "./prepro --tokenizer %s/tok -o %s/out --shard-tokens 100000 %s/docs.jsonl & for i in $(seq 200); do "
                 "ls -d %s/out.partial-* >/dev/null 2>&1 && break; sleep 0.02; done; kill -%s $!; wait $!; echo $? >&2",
                 dir, dir, dir, dir, signals[k]);
        code = run_command(cmd, err, sizeof(err));
        char want[64], status[16];
        snprintf(want, sizeof(want), "interrupted (signal %d); no shards were written", numbers[k]);
        snprintf(status, sizeof(status), "\n%d\n", 128 + numbers[k]);
        EXPECT(code == 0 && strstr(err, want) && strstr(err, status), "SIG%s: '%s'", signals[k], err);
    }
    snprintf(path, sizeof(path), "%s/out", dir);
    EXPECT(access(path, F_OK) != 0, "%s exists after runs that did not finish", path);
    EXPECT(!ti_any(dir, "out\\."), "a staging directory was left in %s", dir);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// Messages are one line whatever bytes the input brought: a control character in a vocabulary
// line or a file name comes out as \xNN, also where err is too short for the whole message.
static int test_messages_one_line(void) {
    int failed = 0;
    char err[256], tiny[8];
    fail(err, sizeof(err), "%s", "a\nb\tc\x7f");
    EXPECT(strcmp(err, "a\\x0ab\\x09c\\x7f") == 0, "'%s'", err);
    fail(tiny, sizeof(tiny), "%s", "ab\ncdef");
    EXPECT(strcmp(tiny, "ab\\x0ac") == 0, "'%s'", tiny);
    fail(tiny, sizeof(tiny), "%s", "abcd\nef");
    EXPECT(strcmp(tiny, "abcd") == 0, "'%s'", tiny);
    char dir[64];  // a byte vocabulary, with a merge line that holds an escape sequence
    if (make_test_dir(dir, sizeof(dir), "test_inputs")) return TEST_FAIL;
    ByteBuf vocab = {NULL, 0, 0};
    EXPECT(ti_byte_tokenizer(dir, &vocab) == 0, "writing a tokenizer");
    remove_test_dir(dir);
    const char merges[] = "#version: 0.2\n\x1b[2J a\n";
    Tokenizer tk;
    EXPECT(tokenizer_load_from_memory(&tk, "encoder.json", vocab.data, vocab.len, "vocab.bpe", merges,
                                      sizeof(merges) - 1, err, sizeof(err)) < 0 &&
               !strchr(err, '\n') && !strchr(err, '\x1b') && strstr(err, "vocab.bpe line 2: '\\x1b[2J' is not spelled"),
           "'%s'", err);
    free(vocab.data);
    return TEST_RESULT;
}

// What train_gpt writes, read back as strictly as anything else: the export's config.json through
// hf_config_parse, and a manifest's config object (with the members the checkpointer adds) through
// model_config_matches, for the default model and an odd one.
static int test_written_configs_read_back(void) {
    int failed = 0;
    ModelConfig odd = {512, 136, 3, 6, 3, 64, 344, 96, 500000.0f, 1e-5f};
    const ModelConfig* configs[] = {&DEFAULT_CONFIG, &odd};
    for (const ModelConfig* c : configs) {
        char json[4096], err[512];
        hf_config_text(c, json, sizeof(json));
        ModelConfig back = {};
        back.seq_len = c->seq_len;  // not in config.json
        EXPECT(hf_config_parse("config.json", json, strlen(json), &back, err, sizeof(err)) == 0, "%s", err);
        EXPECT(memcmp(&back, c, sizeof(back)) == 0, "config.json did not read back as it was written:\n%s", json);
        JsonWriter w;
        jw_init(&w, 1);
        jw_object_begin(&w);
        model_config_members(c, &w);
        jw_key(&w, "gpus");
        jw_int(&w, 2);
        jw_object_end(&w);
        JsonDoc doc;
        EXPECT(json_parse(&doc, jw_text(&w), strlen(jw_text(&w)), err, sizeof(err)) == 0, "%s", err);
        EXPECT(model_config_matches(c, &doc, json_root(&doc), err, sizeof(err)), "%s", err);
        json_free(&doc);
        jw_free(&w);
    }
    return TEST_RESULT;
}

// A filter that matches no test is an error, not "0 passed, 0 failed".
static int test_filter_matching_nothing(void) {
    int failed = 0;
    const BadInput none = {"no_such_test_%s", 2, "no test name contains 'no_such_test_"};
    failed |= ti_run_cases("./test_gpt", &none, 1, "x");
    return TEST_RESULT;
}

static const TestCase input_tests[] = {
    {"bad_input_train_flag_domains", test_train_flag_domains},
    {"bad_input_train_missing_inputs", test_train_missing_inputs},
    {"bad_input_train_config_json", test_train_bad_config_json},
    {"bad_input_train_checkpoint", test_train_bad_checkpoint},
    {"bad_input_prepro", test_prepro_bad_inputs},
    {"bad_input_prepro_stops_leave_nothing", test_prepro_stops_leave_nothing},
    {"bad_input_test_filter", test_filter_matching_nothing},
    {"bad_input_messages_one_line", test_messages_one_line},
    {"bad_input_written_configs_read_back", test_written_configs_read_back},
};
static const int n_input_tests = sizeof(input_tests) / sizeof(input_tests[0]);

#endif
