/*
 * test/fuzz/fuzz_shard.c - libFuzzer harness for the shard side of data.h: the header check, and the loader
 * on any shard the check accepts. Built and run by scripts/fuzz.sh.
 *
 * The input is a whole shard file. The header check must never crash, must refuse with one line,
 * and may accept only a file whose size is exactly the header's token count. An accepted file is
 * then written to disk and read through the loader, with B and T taken from the header's spare ints:
 * it must open (when it holds one batch) or refuse, every batch must come from the file, and a
 * saved state must restore to the same next batch.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../data.h"

static char g_dir[64];

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    char err[1024] = "";
    int64_t n = shard_check_header("fuzz.bin", data, size, size, err, sizeof(err));
    if (n < 0) {
        if (err[0] == '\0' || strchr(err, '\n')) __builtin_trap();  // one line, always
        return 0;
    }
    if ((uint64_t)SHARD_HEADER_BYTES + 2 * (uint64_t)n != size) __builtin_trap();

    if (!g_dir[0]) {
        snprintf(g_dir, sizeof(g_dir), "/tmp/fuzz_shard_XXXXXX");
        if (!mkdtemp(g_dir)) return 0;
    }
    char path[128];
    snprintf(path, sizeof(path), "%s/shard.bin", g_dir);
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    int32_t spare[2];
    memcpy(spare, (const uint8_t*)data + 12, sizeof(spare));
    int B = 1 + (int)((uint32_t)spare[0] % 4), T = 1 + (int)((uint32_t)spare[1] % 64);
    DataLoader L;
    if (loader_open(&L, path, B, T, 0, 1, spare[0] & 16, (uint64_t)spare[1], err, sizeof(err)) < 0) {
        if ((uint64_t)n >= (uint64_t)B * (uint64_t)T + 1 || strchr(err, '\n')) __builtin_trap();
        return 0;
    }
    const uint16_t* tokens = (const uint16_t*)(data + SHARD_HEADER_BYTES);
    for (int k = 0; k < 3; k++) {
        const uint16_t* batch = loader_next(&L);
        for (int b = 0; b < B; b++) {  // each row is some window of the file
            const uint16_t* row = batch + (size_t)b * (size_t)(T + 1);
            int found = 0;
            for (int64_t w = 0; !found && w * T + T + 1 <= n; w++)
                found = memcmp(row, tokens + w * T, (size_t)(T + 1) * 2) == 0;
            if (!found) __builtin_trap();
        }
    }
    LoaderState st;
    loader_get_state(&L, &st);
    uint16_t* want = (uint16_t*)malloc((size_t)B * (size_t)(T + 1) * 2);
    memcpy(want, loader_next(&L), (size_t)B * (size_t)(T + 1) * 2);
    if (loader_set_state(&L, &st, err, sizeof(err)) < 0) __builtin_trap();
    if (memcmp(want, loader_next(&L), (size_t)B * (size_t)(T + 1) * 2) != 0) __builtin_trap();
    free(want);
    loader_close(&L);
    return 0;
}
