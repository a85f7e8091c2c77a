/*
 * data.h - the trainer's data: token shards on disk, the writer that makes them (prepro), and the
 * DataLoader that turns them into batches on a background thread. Header-only; C11 (tools/prepro.c,
 * which must define _POSIX_C_SOURCE 200809L before any include) and C++17 (train_gpt.cu). Errors
 * follow lib/util.h's convention, except in loader_next and loader_rewind (see there).
 *
 * Shard format (llm.c's): a header of 256 int32 {20240520 (magic), 1 (version), n_tokens, 0...},
 * then n_tokens uint16 token ids, little-endian. Documents follow one another, each preceded by the
 * end-of-text token (GPT2_EOT, 50256, in lib/tokenizer.h).
 *
 * The loader cuts every shard into windows of T+1 tokens; window w of a shard starts at token w*T,
 * so consecutive windows share one token (the last target of one is the first input of the next).
 * A batch is B windows, row b = window b. An epoch is one pass over all windows in a stream: the
 * shards one after another (in a seeded shuffled order, or in file-name order when shuffle=0), and
 * each shard's windows in a seeded shuffled order (or in order). The stream of epoch after epoch is
 * dealt out in B-window batches, round robin over the ranks: global step k gives rank r windows
 * [(k*world + r)*B, +B) of the stream. So the ranks read disjoint windows, together they read each
 * window once per epoch, no window is ever skipped (a batch can span the end of an epoch), and the
 * whole state is one number, the step, plus the seed: see LoaderState.
 */
#ifndef DATA_H
#define DATA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <pthread.h>
#include <unistd.h>
#include <sys/stat.h>

#include "lib/util.h"

// ----------------------------------------------------------------------------------------------
// Shards

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_INTS 256
#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)
#define SHARD_MAX_TOKENS 0x7FFFFFFF  // the header's count is an int32

// Checks a shard's header (the first header_len bytes of the file, normally all 1024 of them)
// against the file's size. Returns the token count, or -1 with err naming path and the problem.
static inline int64_t shard_check_header(const char* path, const void* header, size_t header_len,
                                         uint64_t file_size, char* err, size_t err_len) {
    if (header_len < SHARD_HEADER_BYTES || file_size < SHARD_HEADER_BYTES)
        return fail(err, err_len, "shard %s: the file is %llu bytes, shorter than the %d-byte header; "
                    "it is truncated or not a shard", path, (unsigned long long)file_size, SHARD_HEADER_BYTES);
    int32_t h[3];
    memcpy(h, header, sizeof(h));
    if (h[0] != SHARD_MAGIC)
        return fail(err, err_len, "shard %s: bad magic number %d (expected %d); not a token shard",
                    path, h[0], SHARD_MAGIC);
    if (h[1] != SHARD_VERSION)
        return fail(err, err_len, "shard %s: version %d, but this build reads version %d", path, h[1], SHARD_VERSION);
    if (h[2] < 0)
        return fail(err, err_len, "shard %s: the header says %d tokens", path, h[2]);
    uint64_t body = file_size - SHARD_HEADER_BYTES;
    if (body != 2 * (uint64_t)h[2])
        return fail(err, err_len, "shard %s: the header says %d tokens but the file holds %llu%s (%llu bytes); "
                    "re-create it (make data, or prepro)", path, h[2], (unsigned long long)(body / 2),
                    body % 2 ? " and a half" : "", (unsigned long long)file_size);
    return h[2];
}

// Opens a shard and checks its header; returns the token count, or -1 with err.
static inline int64_t shard_probe(const char* path, char* err, size_t err_len) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return fail_errno(err, err_len, errno, "shard %s: cannot open", path);
    struct stat st;
    uint8_t header[SHARD_HEADER_BYTES];
    ssize_t got = 0;
    int64_t n;
    if (fstat(fd, &st) != 0) n = fail_errno(err, err_len, errno, "shard %s: cannot stat", path);
    else if (!S_ISREG(st.st_mode)) n = fail(err, err_len, "shard %s: not a regular file", path);
    else if ((got = pread(fd, header, sizeof(header), 0)) < 0)
        n = fail_errno(err, err_len, errno, "shard %s: cannot read", path);
    else n = shard_check_header(path, header, (size_t)got, (uint64_t)st.st_size, err, err_len);
    close(fd);
    return n;
}

// Writes a complete shard to path: to path.tmp first, then renamed, so that path is either absent
// or whole. Returns 0, or -1 with err.
static inline int shard_write(const char* path, const uint16_t* tokens, size_t n, char* err, size_t err_len) {
    if (n > SHARD_MAX_TOKENS)
        return fail(err, err_len, "shard %s: %zu tokens is more than a shard holds (%d)", path, n, SHARD_MAX_TOKENS);
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return fail(err, err_len, "shard %.200s...: path too long", path);
    FILE* f = fopen(tmp, "wb");
    if (!f) return fail_errno(err, err_len, errno, "shard %s: cannot create", tmp);
    int32_t header[SHARD_HEADER_INTS] = {0};
    header[0] = SHARD_MAGIC;
    header[1] = SHARD_VERSION;
    header[2] = (int32_t)n;
    int ok = fwrite(header, sizeof(header), 1, f) == 1 && (n == 0 || fwrite(tokens, 2, n, f) == n);
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return fail_errno(err, err_len, e, "shard %s: write failed", path);
    }
    return 0;
}

// The path of shard `index` of split `name` (train or val) in dir: dir/NAME_000000.bin, ...
static inline void shard_path(const char* dir, const char* name, int index, char* path, size_t len) {
    snprintf(path, len, "%s/%s_%06d.bin", dir, name, index);
}

// Collects the tokens of one split (train or val) and writes them as shards dir/NAME_000000.bin,
// NAME_000001.bin, ... (shard_path) of shard_tokens tokens each, except that the last two share
// what is left evenly, so that no shard is tiny (the loader rejects a shard smaller than one batch).
typedef struct {
    char dir[2048];
    char name[64];
    size_t shard_tokens;
    uint16_t* buf;           // tokens not yet written: fewer than 2 * shard_tokens
    size_t len, cap;
    int n_shards;            // shards written so far
    uint64_t n_tokens;       // tokens added so far
} ShardWriter;

static inline void shard_writer_init(ShardWriter* w, const char* dir, const char* name, size_t shard_tokens) {
    memset(w, 0, sizeof(*w));
    snprintf(w->dir, sizeof(w->dir), "%s", dir);
    snprintf(w->name, sizeof(w->name), "%s", name);
    w->shard_tokens = shard_tokens;
}

static inline int shard_writer_emit(ShardWriter* w, size_t n, char* err, size_t err_len) {
    char path[4096];
    shard_path(w->dir, w->name, w->n_shards, path, sizeof(path));
    if (shard_write(path, w->buf, n, err, err_len) < 0) return -1;
    w->n_shards++;
    memmove(w->buf, w->buf + n, (w->len - n) * sizeof(uint16_t));
    w->len -= n;
    return 0;
}

// Appends ids (each must fit in uint16); writes a shard whenever two shards' worth are waiting.
static inline int shard_writer_add(ShardWriter* w, const int* ids, size_t n, char* err, size_t err_len) {
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] > 0xFFFF)
            return fail(err, err_len, "token id %d does not fit a shard's uint16", ids[i]);
        if (w->len == w->cap) {
            w->cap = w->cap ? 2 * w->cap : 1 << 20;
            w->buf = (uint16_t*)xrealloc(w->buf, w->cap * sizeof(uint16_t));
        }
        w->buf[w->len++] = (uint16_t)ids[i];
        if (w->len == 2 * w->shard_tokens && shard_writer_emit(w, w->shard_tokens, err, err_len) < 0) return -1;
    }
    w->n_tokens += n;
    return 0;
}

// Writes what is left (as one shard, or two halves when it is more than one shard's worth).
static inline int shard_writer_finish(ShardWriter* w, char* err, size_t err_len) {
    int rc = 0;
    if (w->len > w->shard_tokens) rc = shard_writer_emit(w, w->len / 2, err, err_len);
    if (rc == 0 && w->len > 0) rc = shard_writer_emit(w, w->len, err, err_len);
    free(w->buf);
    w->buf = NULL;
    w->len = w->cap = 0;
    return rc;
}

// ----------------------------------------------------------------------------------------------
// Seeded randomness for the shuffles: splitmix64, so that an order depends on (seed, epoch, shard)
// alone and can be recomputed at any time instead of being stored.

static inline uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// A uniform integer in [0, n), n >= 1, without modulo bias; *state advances.
static inline uint64_t random_below(uint64_t* state, uint64_t n) {
    uint64_t threshold = (0 - n) % n;  // 2^64 mod n: reject the top partial range
    for (;;) {
        uint64_t r = mix64(*state);
        *state += 0x9E3779B97F4A7C15ull;
        if (r >= threshold) return r % n;
    }
}

// Fisher-Yates: order[0..n) becomes a permutation of 0..n-1 drawn from rng_seed.
static inline void shuffled_order(uint32_t* order, uint32_t n, uint64_t rng_seed) {
    for (uint32_t i = 0; i < n; i++) order[i] = i;
    uint64_t state = rng_seed;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)random_below(&state, i);
        uint32_t t = order[i - 1]; order[i - 1] = order[j]; order[j] = t;
    }
}

// ----------------------------------------------------------------------------------------------
// The DataLoader

#define LOADER_PREFETCH 4              // batches the background thread may have ready
#define LOADER_STATE_MAGIC 0x4C445354u  // "LDST"
#define LOADER_STATE_VERSION 1

// The loader's whole state, a plain struct that a checkpoint stores as bytes. Restoring it makes
// the next loader_next() return what it would have returned. The position is that of the next
// global step (all ranks), so a state taken on any rank restores every rank, and also a loader
// with another B or world size when the position is a multiple of its B * world.
typedef struct {
    uint32_t magic, version;     // LOADER_STATE_MAGIC, LOADER_STATE_VERSION
    uint64_t seed;               // the shuffle seed: epoch e's orders are drawn from (seed, e)
    uint64_t epoch;              // the epoch of the next step's first window ...
    uint64_t position;           // ... and its index in that epoch's stream (0 .. windows_per_epoch-1)
    uint64_t windows_per_epoch;  // the data the state belongs to: T, shard sizes and order must match
    uint64_t data_hash;
    int32_t T, shuffle;
} LoaderState;

typedef struct DataLoader {
    // what was opened
    int B, T, rank, world, shuffle;
    uint64_t seed;
    int n_shards;
    char** paths;                // the shards, in file-name order
    uint64_t* shard_windows;     // windows of T+1 tokens in each shard
    uint64_t windows_per_epoch;  // all shards together
    uint64_t data_hash;          // hash of the shards' token counts, to recognise the data in a state
    uint64_t next_step;          // the step of the batch the next loader_next() returns
    // the prefetch ring: LOADER_PREFETCH slots of B*(T+1) tokens in one page-aligned block, which
    // the trainer may pin with cudaHostRegister(ring, ring_bytes, 0) for asynchronous copies
    uint16_t* ring;
    size_t ring_bytes;
    // shared with the thread, under mu: slots filled and slots given back, both counted from the
    // step the thread started at; the caller holds slot (taken % LOADER_PREFETCH) while `holding`
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t filled_cv, freed_cv;
    int sync_made, thread_running, stop, holding;  // sync_made: mu and the conditions exist
    uint64_t start_step, filled, taken;
    char thread_error[512];      // an I/O failure on the thread, reported by loader_next
    // the thread's own: the order of the epoch and shard it read last, recomputed when they change
    uint64_t order_epoch, perm_epoch;
    int perm_shard;
    uint32_t* shard_order;       // shards in stream order for order_epoch
    uint64_t* order_start;       // first stream position of each shard in that order (n_shards+1)
    uint32_t* perm;              // window order within perm_shard for perm_epoch (shuffle only)
    int fd, fd_shard;            // the open shard
} DataLoader;

// Where stream position `pos` of `epoch` is: its shard, and the window within the shard.
static inline void loader_locate(DataLoader* L, uint64_t epoch, uint64_t pos, int* shard, uint64_t* window) {
    if (epoch != L->order_epoch) {
        if (L->shuffle) shuffled_order(L->shard_order, (uint32_t)L->n_shards, mix64(L->seed ^ mix64(epoch)));
        else for (int s = 0; s < L->n_shards; s++) L->shard_order[s] = (uint32_t)s;
        L->order_start[0] = 0;
        for (int k = 0; k < L->n_shards; k++)
            L->order_start[k + 1] = L->order_start[k] + L->shard_windows[L->shard_order[k]];
        L->order_epoch = epoch;
    }
    int lo = 0, hi = L->n_shards - 1;  // the last k with order_start[k] <= pos
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (L->order_start[mid] <= pos) lo = mid; else hi = mid - 1;
    }
    *shard = (int)L->shard_order[lo];
    uint64_t w = pos - L->order_start[lo];
    if (L->shuffle) {
        if (L->perm_epoch != epoch || L->perm_shard != *shard) {
            shuffled_order(L->perm, (uint32_t)L->shard_windows[*shard],
                           mix64(L->seed ^ mix64(epoch) ^ mix64(0x5348415244ull + (uint64_t)*shard)));
            L->perm_epoch = epoch;
            L->perm_shard = *shard;
        }
        w = L->perm[w];
    }
    *window = w;
}

// Reads one step's batch for this rank into dst. Returns 0, or -1 with L->thread_error.
static inline int loader_read_batch(DataLoader* L, uint64_t step, uint16_t* dst) {
    size_t row = (size_t)L->T + 1;
    uint64_t first = (step * (uint64_t)L->world + (uint64_t)L->rank) * (uint64_t)L->B;
    for (int b = 0; b < L->B; b++) {
        uint64_t s = first + (uint64_t)b;
        int shard;
        uint64_t window;
        loader_locate(L, s / L->windows_per_epoch, s % L->windows_per_epoch, &shard, &window);
        if (L->fd_shard != shard) {
            if (L->fd >= 0) close(L->fd);
            L->fd_shard = -1;
            L->fd = open(L->paths[shard], O_RDONLY);
            if (L->fd < 0)
                return fail_errno(L->thread_error, sizeof(L->thread_error), errno, "shard %s: cannot open",
                                  L->paths[shard]);
            L->fd_shard = shard;
        }
        size_t bytes = row * sizeof(uint16_t);
        off_t offset = (off_t)(SHARD_HEADER_BYTES + window * (uint64_t)L->T * sizeof(uint16_t));
        ssize_t got = pread(L->fd, dst + (size_t)b * row, bytes, offset);
        if (got < 0)
            return fail_errno(L->thread_error, sizeof(L->thread_error), errno,
                              "shard %s: reading %zu bytes at offset %lld failed", L->paths[shard], bytes,
                              (long long)offset);
        if (got != (ssize_t)bytes)
            return fail(L->thread_error, sizeof(L->thread_error),
                        "shard %s: reading %zu bytes at offset %lld failed: the file is shorter than when it "
                        "was opened", L->paths[shard], bytes, (long long)offset);
    }
    return 0;
}

// The prefetch thread: fills free slots in step order until stopped.
static inline void* loader_thread_main(void* arg) {
    DataLoader* L = (DataLoader*)arg;
    size_t slot_tokens = (size_t)L->B * ((size_t)L->T + 1);
    pthread_mutex_lock(&L->mu);
    for (;;) {
        while (!L->stop && L->filled - L->taken == LOADER_PREFETCH) pthread_cond_wait(&L->freed_cv, &L->mu);
        if (L->stop) break;
        uint64_t k = L->filled;
        pthread_mutex_unlock(&L->mu);
        int rc = loader_read_batch(L, L->start_step + k, L->ring + (k % LOADER_PREFETCH) * slot_tokens);
        pthread_mutex_lock(&L->mu);
        if (rc < 0) {
            L->stop = 1;  // keep the error; loader_next reports it
            pthread_cond_broadcast(&L->filled_cv);
            break;
        }
        L->filled++;
        pthread_cond_broadcast(&L->filled_cv);
    }
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

static inline void loader_stop_thread(DataLoader* L) {
    if (!L->thread_running) return;
    pthread_mutex_lock(&L->mu);
    L->stop = 1;
    pthread_cond_broadcast(&L->freed_cv);
    pthread_mutex_unlock(&L->mu);
    pthread_join(L->thread, NULL);
    L->thread_running = 0;
}

// (Re)starts prefetching at step L->next_step with an empty ring.
static inline int loader_start_thread(DataLoader* L, char* err, size_t err_len) {
    loader_stop_thread(L);
    L->stop = 0;
    L->holding = 0;
    L->filled = L->taken = 0;
    L->start_step = L->next_step;
    L->thread_error[0] = '\0';
    int rc = pthread_create(&L->thread, NULL, loader_thread_main, L);
    if (rc != 0) return fail_errno(err, err_len, rc, "loader: cannot start its thread");
    L->thread_running = 1;
    return 0;
}

// Stops the thread and frees everything. Harmless on a zeroed DataLoader that was never opened.
static inline void loader_close(DataLoader* L) {
    loader_stop_thread(L);
    if (L->sync_made) {
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->filled_cv);
        pthread_cond_destroy(&L->freed_cv);
        if (L->fd >= 0) close(L->fd);
    }
    for (int s = 0; s < L->n_shards && L->paths; s++) free(L->paths[s]);
    free(L->paths);
    free(L->shard_windows);
    free(L->shard_order);
    free(L->order_start);
    free(L->perm);
    free(L->ring);
    memset(L, 0, sizeof(*L));
}

// Fills L's shard list from pattern and checks every shard; -1 with err on the first problem.
static inline int loader_scan_shards(DataLoader* L, const char* pattern, char* err, size_t err_len) {
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    if (rc != 0) {
        if (rc != GLOB_NOMATCH) globfree(&g);
        return fail(err, err_len, "loader: no files match %s (run `make data`, or prepro for your own text)", pattern);
    }
    L->n_shards = (int)g.gl_pathc;
    L->paths = (char**)xcalloc(g.gl_pathc, sizeof(char*));
    L->shard_windows = (uint64_t*)xcalloc(g.gl_pathc, sizeof(uint64_t));
    uint64_t batch_tokens = (uint64_t)L->B * (uint64_t)L->T + 1;
    L->data_hash = mix64((uint64_t)L->T);
    for (int s = 0; s < L->n_shards && rc == 0; s++) {
        size_t n = strlen(g.gl_pathv[s]) + 1;
        L->paths[s] = (char*)memcpy(xcalloc(n, 1), g.gl_pathv[s], n);
        int64_t n_tokens = shard_probe(L->paths[s], err, err_len);
        if (n_tokens < 0) {
            rc = -1;
        } else if ((uint64_t)n_tokens < batch_tokens) {
            rc = fail(err, err_len, "shard %s: %lld tokens, fewer than one batch of B=%d windows of T+1=%d "
                      "tokens (%llu tokens); use a smaller batch or more data", L->paths[s], (long long)n_tokens,
                      L->B, L->T + 1, (unsigned long long)batch_tokens);
        } else {
            L->shard_windows[s] = ((uint64_t)n_tokens - 1) / (uint64_t)L->T;
            L->windows_per_epoch += L->shard_windows[s];
            L->data_hash = mix64(L->data_hash ^ (uint64_t)n_tokens);
        }
    }
    globfree(&g);
    if (rc == 0 && L->windows_per_epoch < (uint64_t)L->B * (uint64_t)L->world)
        rc = fail(err, err_len, "loader: %s holds %llu windows of T+1=%d tokens, fewer than one batch of B=%d for "
                  "each of %d ranks", pattern, (unsigned long long)L->windows_per_epoch, L->T + 1, L->B, L->world);
    return rc;
}

// Opens every file matching pattern (a glob, e.g. "data/default/train_*.bin"), checks each header
// and size, and starts prefetching. Batches are B windows of T+1 tokens; this rank of world reads
// its share; shuffle=1 shuffles shards and windows every epoch, drawn from seed; shuffle=0 reads
// in order (validation). Returns 0, or -1 with a one-line message in err (nothing to close then).
// Do not copy a DataLoader after opening it: its thread holds its address.
static inline int loader_open(DataLoader* L, const char* pattern, int B, int T, int rank, int world,
                              int shuffle, uint64_t seed, char* err, size_t err_len) {
    memset(L, 0, sizeof(*L));
    if (B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world)
        return fail(err, err_len, "loader: bad batch shape or rank (B=%d T=%d rank=%d world=%d)", B, T, rank, world);
    L->B = B;
    L->T = T;
    L->rank = rank;
    L->world = world;
    L->shuffle = shuffle != 0;
    L->seed = seed;
    L->fd = -1;
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->filled_cv, NULL);
    pthread_cond_init(&L->freed_cv, NULL);
    L->sync_made = 1;
    if (loader_scan_shards(L, pattern, err, err_len) < 0) {
        loader_close(L);
        return -1;
    }
    uint64_t max_windows = 0;
    for (int s = 0; s < L->n_shards; s++)
        if (L->shard_windows[s] > max_windows) max_windows = L->shard_windows[s];
    L->shard_order = (uint32_t*)xcalloc((size_t)L->n_shards, sizeof(uint32_t));
    L->order_start = (uint64_t*)xcalloc((size_t)L->n_shards + 1, sizeof(uint64_t));
    L->perm = L->shuffle ? (uint32_t*)xcalloc(max_windows, sizeof(uint32_t)) : NULL;
    L->order_epoch = L->perm_epoch = UINT64_MAX;
    L->perm_shard = L->fd_shard = -1;
    L->ring_bytes = (size_t)LOADER_PREFETCH * (size_t)B * ((size_t)T + 1) * sizeof(uint16_t);
    L->ring_bytes = (L->ring_bytes + 4095) / 4096 * 4096;
    L->ring = (uint16_t*)xaligned_alloc(4096, L->ring_bytes);
    if (loader_start_thread(L, err, err_len) < 0) {
        loader_close(L);
        return -1;
    }
    return 0;
}

// The next batch: B rows of T+1 tokens, row b = window b. Valid until the next call (or rewind, or
// set_state); a caller that copies it asynchronously must finish the copy before calling again.
// Normally ready at once: the thread stays up to LOADER_PREFETCH batches ahead. A read error (a
// shard changed under a running loader) is printed on stderr and exits: with loader_rewind, the
// exception to lib/util.h's error convention, as neither returns a status for the trainer to act on.
static inline const uint16_t* loader_next(DataLoader* L) {
    pthread_mutex_lock(&L->mu);
    if (L->holding) {  // the previous batch's slot is free again
        L->taken++;
        L->holding = 0;
        pthread_cond_broadcast(&L->freed_cv);
    }
    while (L->filled == L->taken && !L->stop) pthread_cond_wait(&L->filled_cv, &L->mu);
    if (L->filled == L->taken) {
        fprintf(stderr, "loader: %s\n", L->thread_error);
        exit(1);
    }
    L->holding = 1;
    uint16_t* batch = L->ring + (L->taken % LOADER_PREFETCH) * (size_t)L->B * ((size_t)L->T + 1);
    pthread_mutex_unlock(&L->mu);
    L->next_step++;
    return batch;
}

// Whole batches per epoch for each rank. An epoch's windows rarely divide evenly: the rest, fewer
// than B * world windows, begin the next step, which then runs on into the next epoch.
static inline size_t loader_batches_per_epoch(const DataLoader* L) {
    return (size_t)(L->windows_per_epoch / ((uint64_t)L->B * (uint64_t)L->world));
}

// The epoch of the next batch's first window.
static inline uint64_t loader_epoch(const DataLoader* L) {
    return L->next_step * (uint64_t)L->B * (uint64_t)L->world / L->windows_per_epoch;
}

// Back to the start of epoch 0; the validation loop calls this before each evaluation. When the
// thread cannot be restarted, the reason is printed on stderr and it exits (see loader_next).
static inline void loader_rewind(DataLoader* L) {
    L->next_step = 0;
    char err[256];
    if (loader_start_thread(L, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
}

static inline void loader_get_state(const DataLoader* L, LoaderState* s) {
    memset(s, 0, sizeof(*s));
    uint64_t global = L->next_step * (uint64_t)L->B * (uint64_t)L->world;
    s->magic = LOADER_STATE_MAGIC;
    s->version = LOADER_STATE_VERSION;
    s->seed = L->seed;
    s->epoch = global / L->windows_per_epoch;
    s->position = global % L->windows_per_epoch;
    s->windows_per_epoch = L->windows_per_epoch;
    s->data_hash = L->data_hash;
    s->T = L->T;
    s->shuffle = L->shuffle;
}

// Restores a state from loader_get_state (and its seed). Returns 0, or -1 with err when the state
// belongs to other data or another T, or its position does not fall on a step of this loader.
static inline int loader_set_state(DataLoader* L, const LoaderState* s, char* err, size_t err_len) {
    if (s->magic != LOADER_STATE_MAGIC || s->version != LOADER_STATE_VERSION)
        return fail(err, err_len, "loader state: not a loader state of this version (magic 0x%08x, version %u)",
                    s->magic, s->version);
    if (s->T != L->T || s->shuffle != L->shuffle || s->windows_per_epoch != L->windows_per_epoch ||
        s->data_hash != L->data_hash)
        return fail(err, err_len, "loader state: saved for other data or settings (T=%d, shuffle=%d, %llu windows "
                    "per epoch) than this loader's (T=%d, shuffle=%d, %llu windows)", s->T, s->shuffle,
                    (unsigned long long)s->windows_per_epoch, L->T, L->shuffle,
                    (unsigned long long)L->windows_per_epoch);
    uint64_t per_step = (uint64_t)L->B * (uint64_t)L->world;
    if (s->position >= s->windows_per_epoch || (s->epoch * s->windows_per_epoch + s->position) % per_step != 0)
        return fail(err, err_len, "loader state: position %llu of epoch %llu is not the start of a step of "
                    "B*world = %llu windows", (unsigned long long)s->position, (unsigned long long)s->epoch,
                    (unsigned long long)per_step);
    loader_stop_thread(L);  // the thread reads the seed and the cached orders
    L->seed = s->seed;
    L->order_epoch = L->perm_epoch = UINT64_MAX;  // orders drawn from the old seed are void
    L->next_step = (s->epoch * s->windows_per_epoch + s->position) / per_step;
    return loader_start_thread(L, err, err_len);
}

#endif
