/*
 * test/fuzz/fuzz_manifest.c - libFuzzer harness for a checkpoint's manifest.json (ckpt.h's
 * ckpt_parse_manifest) and the config it stores (lib/config.h's model_config_matches), what --resume
 * reads first. Built and run by scripts/fuzz.sh.
 *
 * The input is a whole manifest. It must be refused with one line naming the file, or accepted
 * with a config object and plain, distinct file names. Matching its config against the default
 * one must give a verdict, and a refusal is one line.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../lib/config.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    CkptReader r;
    memset(&r, 0, sizeof(r));
    char err[1024] = "";
    if (ckpt_parse_manifest(&r, "fuzz/manifest.json", (const char*)data, size, err, sizeof(err)) != 0) {
        if (strncmp(err, "fuzz/manifest.json: ", 20) != 0 || strchr(err, '\n')) __builtin_trap();
        ckpt_close(&r);
        return 0;
    }
    if (!r.config || r.config->type != JSON_OBJECT || r.step < 0) __builtin_trap();
    for (int i = 0; i < r.n_files; i++) {
        if (!ckpt_valid_name(r.files[i].name)) __builtin_trap();
        for (int k = 0; k < i; k++)
            if (strcmp(r.files[i].name, r.files[k].name) == 0) __builtin_trap();
    }
    if (!model_config_matches(&DEFAULT_CONFIG, &r.manifest, r.config, err, sizeof(err)) && (!err[0] || strchr(err, '\n')))
        __builtin_trap();
    ckpt_close(&r);
    return 0;
}
