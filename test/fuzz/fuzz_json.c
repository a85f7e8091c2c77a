/*
 * test/fuzz/fuzz_json.c - libFuzzer harness for lib/util.h's JSON string decoder, the one that
 * encoder.json, prepro's JSONL and ckpt.h's JSON reader all go through. Built and run by
 * scripts/fuzz.sh.
 *
 * The input is the text from a string literal's opening quote on. Decoding it into a buffer of its
 * own, decoding it over itself (as ckpt.h does) and appending it to a ByteBuf (as lib/tokenizer.h
 * does) must agree: the same verdict, the same bytes, the same end. Accepted: the end is the one
 * json_string_end finds, and the bytes are no more than the literal held. Refused: one line, and a
 * fault position inside the text.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../lib/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    char* text = (char*)xmalloc(size);
    char* over = (char*)xmalloc(size);  // decoded in place
    char* out = (char*)xmalloc(size);
    if (size) {
        memcpy(text, data, size);
        memcpy(over, data, size);
    }
    const char *end = text + size, *after, *after_over;
    size_t n = 0, n_over = 0;
    char err[128] = "", err_over[128] = "", err_buf[128] = "";
    int rc = json_string_decode(text, end, out, &n, &after, err, sizeof(err));
    int rc_over = json_string_decode(over, over + size, over + 1, &n_over, &after_over, err_over, sizeof(err_over));
    if (rc != rc_over || after - text != after_over - over) __builtin_trap();
    if (rc == 0) {
        const char* close = json_string_end(text, end);
        if (after != close || n + 2 > (size_t)(close - text)) __builtin_trap();
        if (n != n_over || (n && memcmp(out, over + 1, n) != 0)) __builtin_trap();
    } else {
        if (after < text || after > end || !err[0] || strchr(err, '\n') || strcmp(err, err_over) != 0) __builtin_trap();
    }
    ByteBuf buf = {NULL, 0, 0};
    const char* p = text;
    int rc_buf = json_read_string(&p, end, &buf, err_buf, sizeof(err_buf));
    if (rc_buf != rc || (rc == 0 && (p != after || buf.len != n || (n && memcmp(buf.data, out, n) != 0))))
        __builtin_trap();
    free(buf.data);
    free(text);
    free(over);
    free(out);
    return 0;
}
