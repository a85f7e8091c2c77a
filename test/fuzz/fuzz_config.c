/*
 * test/fuzz/fuzz_config.c - libFuzzer harness for lib/config.h's reading of transformers' config.json
 * (--init-from). Built and run by scripts/fuzz.sh.
 *
 * The input is a whole config.json. hf_config_parse must refuse it with one line that names the
 * file, or accept it with every field in its domain: integers from 1 up, floats finite. An accepted
 * config, written as a checkpoint manifest writes it, must read back as the same config.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../lib/config.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    ModelConfig c = DEFAULT_CONFIG;
    char err[1024] = "";
    if (hf_config_parse("fuzz/config.json", (const char*)data, size, &c, err, sizeof(err)) != 0) {
        if (strncmp(err, "fuzz/config.json: ", 18) != 0 || strchr(err, '\n')) __builtin_trap();
        return 0;
    }
    for (int i = 0; i < N_CONFIG_FIELDS; i++) {
        double v = config_get(&c, &CONFIG_FIELDS[i]);
        if (!isfinite(v) || (!CONFIG_FIELDS[i].is_float && v < 1)) __builtin_trap();
    }
    JsonWriter w;
    jw_init(&w, 0);
    jw_object_begin(&w);
    model_config_members(&c, &w);
    jw_object_end(&w);
    JsonDoc doc;
    const char* text = jw_text(&w);
    if (json_parse(&doc, text, strlen(text), err, sizeof(err)) != 0) __builtin_trap();
    if (!model_config_matches(&c, &doc, json_root(&doc), err, sizeof(err))) __builtin_trap();
    json_free(&doc);
    jw_free(&w);
    return 0;
}
