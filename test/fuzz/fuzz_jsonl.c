/*
 * test/fuzz/fuzz_jsonl.c - libFuzzer harness for prepro's JSONL reader (tools/prepro.c's
 * jsonl_text, which the harness includes without its main). Built and run by scripts/fuzz.sh.
 *
 * The input is one line of a .jsonl file. jsonl_text must accept it or refuse it with one line.
 * ckpt.h's strict JSON reader is the oracle: a line it reads as an object whose "text" member is a
 * string (with no NUL) must be accepted, with exactly that string's bytes.
 */
#define _POSIX_C_SOURCE 200809L
#define PREPRO_NO_MAIN
#include "../../tools/prepro.c"
#include "../../ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    char* line = (char*)xmalloc(size);
    if (size) memcpy(line, data, size);
    ByteBuf text = {NULL, 0, 0};
    char err[256] = "";
    int rc = jsonl_text(line, size, &text, err, sizeof(err));
    if (rc < 0 && (!err[0] || strchr(err, '\n'))) __builtin_trap();
    JsonDoc doc;
    const char* want;
    if (json_parse(&doc, line, size, NULL, 0) == 0) {
        if (json_get_string(&doc, json_root(&doc), "text", &want) == 0 &&
            (rc < 0 || text.len != strlen(want) || memcmp(text.data, want, text.len) != 0))
            __builtin_trap();
        json_free(&doc);
    }
    free(text.data);
    free(line);
    return 0;
}
