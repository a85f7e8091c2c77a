/*
 * test/fuzz/fuzz_safetensors.c - libFuzzer harness for ckpt.h's safetensors reader (st_open), what
 * --init-from and --resume read their weights with. Built and run by scripts/fuzz.sh.
 *
 * The input is a whole file, written to disk and opened. It must be refused with one line naming
 * the file, or accepted with every tensor inside the data, the tensors tiling it in offset order.
 * An accepted file, written again with st_write, must open to the same tensors, bytes and metadata.
 */
#define _POSIX_C_SOURCE 200809L
#include "../../ckpt.h"

static char g_dir[64];

static int same_tensors(const StFile* a, const StFile* b) {
    if (a->n_tensors != b->n_tensors || a->n_meta != b->n_meta) return 0;
    for (int i = 0; i < a->n_tensors; i++) {
        const StTensor *x = &a->tensors[i], *y = st_find(b, x->name);
        if (!y || y->dtype != x->dtype || y->ndim != x->ndim || st_nbytes(y) != st_nbytes(x) ||
            memcmp(y->shape, x->shape, (size_t)x->ndim * sizeof(x->shape[0])) != 0 ||
            memcmp(y->data, x->data, (size_t)st_nbytes(x)) != 0)
            return 0;
    }
    for (int k = 0; k < a->n_meta; k++) {
        const char* v = st_meta(b, a->meta[2 * k]);
        if (!v || strcmp(v, a->meta[2 * k + 1]) != 0) return 0;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof(g_dir), "/tmp/fuzz_st_XXXXXX");
        if (!mkdtemp(g_dir)) return 0;
    }
    char path[128], again[128], err[1024] = "";
    snprintf(path, sizeof(path), "%s/in.safetensors", g_dir);
    snprintf(again, sizeof(again), "%s/again.safetensors", g_dir);
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    StFile st, back;
    if (st_open(&st, path, err, sizeof(err)) != 0) {
        if (strncmp(err, path, strlen(path)) != 0 || strchr(err, '\n')) __builtin_trap();
        return 0;
    }
    const uint8_t* end = st.map + st.map_len;
    for (int i = 0; i < st.n_tensors; i++) {
        const StTensor* t = &st.tensors[i];
        const uint8_t* p = (const uint8_t*)t->data;
        if (st_nbytes(t) < 0 || p < st.map || p + st_nbytes(t) > end) __builtin_trap();
        if (i && p < (const uint8_t*)st.tensors[i - 1].data + st_nbytes(&st.tensors[i - 1])) __builtin_trap();
    }
    if (st_write(again, st.tensors, st.n_tensors, st.meta, st.n_meta, err, sizeof(err)) == 0) {
        if (st_open(&back, again, err, sizeof(err)) != 0 || !same_tensors(&st, &back)) __builtin_trap();
        st_close(&back);
    }
    st_close(&st);
    return 0;
}
