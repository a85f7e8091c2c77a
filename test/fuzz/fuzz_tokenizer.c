/*
 * test/fuzz/fuzz_tokenizer.c - libFuzzer harness for lib/tokenizer.h. Built and run by
 * scripts/fuzz.sh, which fetches the GPT-2 files first (FUZZ_TOKENIZER_DIR, default data/tokenizer).
 *
 * An input whose first byte is even is text: encoding it with GPT-2's tokenizer must give ids of
 * the vocabulary, never the end-of-text token, and decoding them must give the text back, byte for
 * byte. An odd first byte makes the rest a pair of tokenizer files, encoder.json and vocab.bpe,
 * split at the first NUL: loading them must fail with one line or succeed, and a loaded toy
 * tokenizer must round-trip the files' own text.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../lib/tokenizer.h"

static Tokenizer g_gpt2;
static TokenList g_ids;
static ByteBuf g_back;

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    (void)argc;
    (void)argv;
    const char* dir = getenv("FUZZ_TOKENIZER_DIR");
    char err[8192];
    if (tokenizer_load(&g_gpt2, dir ? dir : "data/tokenizer", err, sizeof(err)) < 0) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        exit(1);
    }
    return 0;
}

// A fuzzed vocabulary may well merge its way to <|endoftext|>; GPT-2's never does.
static void round_trip(Tokenizer* tk, const uint8_t* text, size_t n, int eot_forbidden) {
    char err[256];
    g_ids.len = g_back.len = 0;
    tokenizer_encode(tk, text, n, &g_ids);
    for (size_t i = 0; i < g_ids.len; i++)
        if (g_ids.data[i] < 0 || g_ids.data[i] >= tk->vocab_size || (eot_forbidden && g_ids.data[i] == tk->eot))
            __builtin_trap();
    if (tokenizer_decode(tk, g_ids.data, g_ids.len, &g_back, err, sizeof(err)) < 0) __builtin_trap();
    if (g_back.len != n || (n && memcmp(g_back.data, text, n) != 0)) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    if ((data[0] & 1) == 0) {
        round_trip(&g_gpt2, data + 1, size - 1, 1);
        return 0;
    }
    const char* files = (const char*)data + 1;
    size_t len = size - 1;
    const char* nul = (const char*)memchr(files, 0, len);
    size_t json_len = nul ? (size_t)(nul - files) : len;
    const char* bpe = nul ? nul + 1 : files + len;
    size_t bpe_len = nul ? len - json_len - 1 : 0;
    Tokenizer tk;
    char err[1024] = "";
    if (tokenizer_load_from_memory(&tk, "fuzz.json", files, json_len, "fuzz.bpe", bpe, bpe_len, err, sizeof(err)) < 0) {
        if (err[0] == '\0' || strchr(err, '\n')) __builtin_trap();
        return 0;
    }
    round_trip(&tk, (const uint8_t*)files, len, 0);
    tokenizer_free(&tk);
    return 0;
}
