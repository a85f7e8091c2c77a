/*
 * test/test_comm.h - CPU tests of comm.h: the launch environment (torchrun, Slurm, a single
 * process, and every malformed value, through a fake environment), ZeRO's shard arithmetic at
 * awkward sizes, resharding W1 -> W2 checked element by element against a brute-force mapping,
 * and the TCP bootstrap between real processes.
 *
 * test_gpt.cu includes testing.h, comm.h, then this file, and runs comm_tests. The bootstrap tests
 * fork one child per rank over loopback, on a port found free just before; each child reports its
 * error line through a pipe and exits 0 or 1, and the parent waits for all of them up to a hard
 * limit, then kills what is left, so no test can hang or leave a process behind. The failure
 * cases (a missing rank, a rank with another world size, a rank twice, a port in use, a name that
 * does not resolve, a connection that drops mid-transfer) use timeouts of 1-2 s, and check that
 * the error names the fault and came within the timeout.
 */
#ifndef TEST_COMM_H
#define TEST_COMM_H

#include "testing.h"
#include "../comm.h"
#include <signal.h>
#include <sys/wait.h>

#define CT_ERR 512

static int ct_has(const char* s, const char* part) { return s && strstr(s, part) != NULL; }

// ----------------------------------------------------------------------------------------------
// A fake environment: "NAME=value" strings, read through comm_env_read's lookup function

static const char* const* ct_env_vars;

static const char* ct_getenv(const char* name) {
    size_t n = strlen(name);
    for (const char* const* v = ct_env_vars; v && *v; v++)
        if (strncmp(*v, name, n) == 0 && (*v)[n] == '=') return *v + n + 1;
    return NULL;
}

static int ct_env(CommEnv* e, const char* const* vars, const char* flag, char* err) {
    ct_env_vars = vars;
    err[0] = '\0';
    return comm_env_read(e, ct_getenv, flag, err, CT_ERR);
}

static int test_comm_env_single(void) {
    int failed = 0;
    char err[CT_ERR];
    CommEnv e;
    const char* none[] = {NULL};
    const char* unrelated[] = {"PATH=/usr/bin", "MASTER_ADDR=somewhere", "MASTER_PORT=1", "SLURM_JOB_ID=7", NULL};
    const char* const* cases[] = {none, unrelated};
    for (int i = 0; i < 2; i++) {
        EXPECT(ct_env(&e, cases[i], "ignored:1", err) == 0, "case %d: %s", i, err);
        EXPECT(e.rank == 0 && e.world == 1 && e.local_rank == 0 && e.local_world == 1, "case %d: rank %d of %d",
               i, e.rank, e.world);
        EXPECT(strcmp(e.launcher, "single") == 0 && e.master_addr[0] == '\0' && e.master_port == 0,
               "case %d: %s %s:%d", i, e.launcher, e.master_addr, e.master_port);
    }
    return TEST_RESULT;
}

static int test_comm_env_torchrun(void) {
    int failed = 0;
    char err[CT_ERR];
    CommEnv e;
    // torchrun under srun: SLURM_* are set too, and torchrun's variables win
    const char* vars[] = {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=node-0.cluster",
                          "MASTER_PORT=29500", "SLURM_PROCID=1", "SLURM_NTASKS=2", NULL};
    EXPECT(ct_env(&e, vars, "ignored:1", err) == 0, "%s", err);
    EXPECT(e.rank == 5 && e.world == 8 && e.local_rank == 1 && e.local_world == 4, "rank %d of %d, local %d of %d",
           e.rank, e.world, e.local_rank, e.local_world);
    EXPECT(strcmp(e.master_addr, "node-0.cluster") == 0, "%s", e.master_addr);
    EXPECT(e.master_port == 29501, "the bootstrap takes MASTER_PORT + 1 (torchrun's store has 29500): %d", e.master_port);
    EXPECT(strcmp(e.launcher, "torchrun") == 0, "%s", e.launcher);
    // one process needs nobody's address
    const char* one[] = {"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1", NULL};
    EXPECT(ct_env(&e, one, NULL, err) == 0 && e.world == 1 && e.master_port == 0, "%s", err);
    const char* zeros[] = {"RANK=007", "WORLD_SIZE=0008", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=8", "MASTER_ADDR=::1",
                           "MASTER_PORT=65534", NULL};
    EXPECT(ct_env(&e, zeros, NULL, err) == 0 && e.rank == 7 && e.world == 8 && e.master_port == 65535, "%s", err);
    return TEST_RESULT;
}

static int test_comm_env_slurm(void) {
    int failed = 0;
    char err[CT_ERR];
    CommEnv e;
    const char* fixed[] = {"SLURM_PROCID=6", "SLURM_NTASKS=8", "SLURM_LOCALID=2", "SLURM_NTASKS_PER_NODE=4",
                           "SLURM_TASKS_PER_NODE=4(x2)", "MASTER_ADDR=head", "MASTER_PORT=1234", NULL};
    EXPECT(ct_env(&e, fixed, "flag-loses:99", err) == 0, "%s", err);
    EXPECT(e.rank == 6 && e.world == 8 && e.local_rank == 2 && e.local_world == 4, "rank %d of %d, local %d of %d",
           e.rank, e.world, e.local_rank, e.local_world);
    EXPECT(strcmp(e.master_addr, "head") == 0 && e.master_port == 1234, "the environment wins: %s:%d",
           e.master_addr, e.master_port);
    EXPECT(strcmp(e.launcher, "slurm") == 0, "%s", e.launcher);
    // an uneven job: 4 tasks on nodes 0 and 1, 3 on node 2; this is node 2's second task
    const char* uneven[] = {"SLURM_PROCID=9", "SLURM_NTASKS=11", "SLURM_LOCALID=1", "SLURM_NODEID=2",
                            "SLURM_TASKS_PER_NODE=4(x2),3", NULL};
    EXPECT(ct_env(&e, uneven, "head.cluster:29500", err) == 0, "%s", err);
    EXPECT(e.local_world == 3 && strcmp(e.master_addr, "head.cluster") == 0 && e.master_port == 29500,
           "local world %d, master %s:%d", e.local_world, e.master_addr, e.master_port);
    const char* even[] = {"SLURM_PROCID=3", "SLURM_NTASKS=6", "SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE=2(x3)", NULL};
    EXPECT(ct_env(&e, even, "[fe80::1]:7000", err) == 0, "%s", err);
    EXPECT(e.local_world == 2 && strcmp(e.master_addr, "fe80::1") == 0 && e.master_port == 7000,
           "local world %d, master %s:%d", e.local_world, e.master_addr, e.master_port);
    // one task needs no master; several without one are told how to give it
    const char* alone[] = {"SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0", "SLURM_TASKS_PER_NODE=1", NULL};
    EXPECT(ct_env(&e, alone, NULL, err) == 0 && e.world == 1, "%s", err);
    EXPECT(ct_env(&e, even, NULL, err) == -1 && ct_has(err, "MASTER_ADDR") && ct_has(err, "--master host:port"),
           "%s", err);
    return TEST_RESULT;
}

typedef struct {
    const char* vars[10];  // NULL-terminated
    const char* flag;
    const char* expect;    // a part of the error
} CtBadEnv;

#define CT_TORCHRUN(rank, world, lrank, lworld, addr, port) \
    {"RANK=" rank, "WORLD_SIZE=" world, "LOCAL_RANK=" lrank, "LOCAL_WORLD_SIZE=" lworld, addr, port, NULL}
#define CT_SLURM(rank, world, lrank, tasks) \
    {"SLURM_PROCID=" rank, "SLURM_NTASKS=" world, "SLURM_LOCALID=" lrank, tasks, "MASTER_ADDR=h", "MASTER_PORT=9", NULL}

static const CtBadEnv CT_BAD_ENVS[] = {
    {CT_TORCHRUN("abc", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK='abc' is not a whole number"},
    {CT_TORCHRUN("-1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK='-1'"},
    {CT_TORCHRUN("+1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK='+1'"},
    {CT_TORCHRUN(" 1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK=' 1'"},
    {CT_TORCHRUN("1x", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK='1x'"},
    {CT_TORCHRUN("", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK is empty"},
    {CT_TORCHRUN("99999999999999999999", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK=9999"},
    {CT_TORCHRUN("8", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "RANK=8 must be less than WORLD_SIZE=8"},
    {CT_TORCHRUN("0", "0", "0", "1", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "WORLD_SIZE=0 is outside 1.."},
    {CT_TORCHRUN("0", "2.5", "0", "1", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "WORLD_SIZE='2.5'"},
    {CT_TORCHRUN("1", "8", "4", "4", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL,
     "LOCAL_RANK=4 must be less than LOCAL_WORLD_SIZE=4"},
    {CT_TORCHRUN("1", "8", "0", "0", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "LOCAL_WORLD_SIZE=0 is outside"},
    {CT_TORCHRUN("1", "8", "0", "16", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "LOCAL_WORLD_SIZE=16 exceeds WORLD_SIZE=8"},
    {CT_TORCHRUN("1", "8", "x", "8", "MASTER_ADDR=h", "MASTER_PORT=9"), NULL, "LOCAL_RANK='x'"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=0"), NULL, "MASTER_PORT=0 is outside 1..65535"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=65536"), NULL, "MASTER_PORT=65536 is outside"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=65535"), NULL, "MASTER_PORT + 1"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=h", "MASTER_PORT=http"), NULL, "MASTER_PORT='http'"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=h", NULL), NULL, "MASTER_PORT is not set"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_PORT=9", NULL), NULL, "MASTER_ADDR is not set"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=", "MASTER_PORT=9"), NULL, "MASTER_ADDR is empty"},
    {CT_TORCHRUN("1", "8", "0", "8", "MASTER_ADDR=a b", "MASTER_PORT=9"), NULL, "MASTER_ADDR='a b' has a space"},
    {{"RANK=1", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=8", NULL}, NULL, "LOCAL_RANK is not set"},
    {{"LOCAL_RANK=0", NULL}, NULL, "WORLD_SIZE is not set"},
    {CT_SLURM("x", "8", "0", "SLURM_NTASKS_PER_NODE=8"), NULL, "SLURM_PROCID='x'"},
    {CT_SLURM("0", "0", "0", "SLURM_NTASKS_PER_NODE=8"), NULL, "SLURM_NTASKS=0 is outside"},
    {CT_SLURM("0", "8", "-2", "SLURM_NTASKS_PER_NODE=8"), NULL, "SLURM_LOCALID='-2'"},
    {CT_SLURM("8", "8", "0", "SLURM_NTASKS_PER_NODE=8"), NULL, "SLURM_PROCID=8 must be less than SLURM_NTASKS=8"},
    {CT_SLURM("1", "8", "4", "SLURM_NTASKS_PER_NODE=4"), NULL, "SLURM_LOCALID=4 must be less than SLURM_NTASKS_PER_NODE=4"},
    {CT_SLURM("1", "8", "0", "SLURM_NTASKS_PER_NODE=four"), NULL, "SLURM_NTASKS_PER_NODE='four'"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=4(x2"), NULL, "SLURM_TASKS_PER_NODE='4(x2' is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=4(x2),,3"), NULL, "is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=4x2"), NULL, "is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=0"), NULL, "is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=4(x0)"), NULL, "is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE="), NULL, "is not a list"},
    {CT_SLURM("1", "8", "0", "SLURM_TASKS_PER_NODE=4,3"), NULL, "differs between nodes"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=11", "SLURM_LOCALID=0", "SLURM_NODEID=3", "SLURM_TASKS_PER_NODE=4(x2),3",
      NULL}, "h:1", "SLURM_NODEID=3 but SLURM_TASKS_PER_NODE='4(x2),3' lists 3 nodes"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", NULL}, "h:1", "neither SLURM_NTASKS_PER_NODE"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", "MASTER_ADDR=h", NULL},
     "h:1", "MASTER_ADDR is set but MASTER_PORT is not"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", "MASTER_PORT=5", NULL},
     "h:1", "MASTER_PORT is set but MASTER_ADDR is not"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", NULL}, "nohostport",
     "--master 'nohostport' is not host:port"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", NULL}, "h:0",
     "--master's port=0 is outside 1..65535"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", NULL}, "h:",
     "--master's port is empty"},
    {{"SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_NTASKS_PER_NODE=8", NULL}, ":29500",
     "--master's host is empty"},
};

static int test_comm_env_rejects_bad_values(void) {
    int failed = 0;
    char err[CT_ERR];
    CommEnv e;
    int n = (int)(sizeof(CT_BAD_ENVS) / sizeof(CT_BAD_ENVS[0]));
    for (int i = 0; i < n; i++) {
        const CtBadEnv* c = &CT_BAD_ENVS[i];
        int rc = ct_env(&e, c->vars, c->flag, err);
        EXPECT(rc == -1 && ct_has(err, c->expect) && ct_has(err, "launch environment ("),
               "case %d (%s): rc %d, error '%s'", i, c->expect, rc, err);
    }
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// Shards

// The shard size by brute force: the smallest multiple of align that world shards cover n with.
static size_t ct_shard_size(size_t n, int world, size_t align) {
    size_t s = 0;
    while (s * (size_t)world < n) s += align;
    return s;
}

static int test_comm_shard_ranges(void) {
    int failed = 0;
    char err[CT_ERR];
    const size_t sizes[] = {0, 1, 127, 128, 256, 384, 1000, 128 * 5, 128 * 7, 128 * 1001, 128 * 123457};
    const int worlds[] = {1, 2, 3, 7, 8, 13};
    const size_t aligns[] = {1, 128, 256};
    for (size_t ni = 0; ni < sizeof(sizes) / sizeof(sizes[0]); ni++)
        for (int wi = 0; wi < 6; wi++)
            for (int ai = 0; ai < 3; ai++) {
                size_t n = sizes[ni], align = aligns[ai];
                int W = worlds[wi];
                CommShards s = {0, 0, 0, 0};
                EXPECT(comm_shards_init(&s, n, W, align, err, sizeof(err)) == 0, "%s", err);
                size_t want = ct_shard_size(n, W, align);
                EXPECT(s.shard == want && comm_padded_len(&s) == want * (size_t)W, "n %zu world %d align %zu: shard "
                       "%zu, brute force %zu", n, W, align, s.shard, want);
                size_t next = 0;  // the ranges tile [0, n) in rank order, every boundary aligned
                for (int r = 0; r < W; r++) {
                    CommRange g = comm_shard_range(&s, r);
                    EXPECT(g.begin == next && g.end >= g.begin && g.end - g.begin <= s.shard,
                           "n %zu world %d align %zu rank %d: [%zu, %zu) after %zu", n, W, align, r, g.begin, g.end, next);
                    EXPECT(g.begin % align == 0 || g.begin == n, "rank %d begins at %zu", r, g.begin);
                    EXPECT(g.end - g.begin == s.shard || g.end == n, "rank %d is short before the end", r);
                    next = g.end;
                }
                EXPECT(next == n, "n %zu world %d: the ranges end at %zu", n, W, next);
            }
    // known answers: 1000 elements in 3 ranks of 128-aligned shards; 256 elements in 8 ranks
    CommShards s;
    comm_shards_init(&s, 1000, 3, 128, err, sizeof(err));
    CommRange r2 = comm_shard_range(&s, 2);
    EXPECT(s.shard == 384 && comm_padded_len(&s) == 1152 && r2.begin == 768 && r2.end == 1000,
           "shard %zu, rank 2 [%zu, %zu)", s.shard, r2.begin, r2.end);
    comm_shards_init(&s, 256, 8, 128, err, sizeof(err));
    CommRange r1 = comm_shard_range(&s, 1), r5 = comm_shard_range(&s, 5);
    EXPECT(s.shard == 128 && r1.begin == 128 && r1.end == 256 && r5.begin == 256 && r5.end == 256,
           "world > n / 128: shard %zu, rank 1 [%zu, %zu), rank 5 [%zu, %zu)", s.shard, r1.begin, r1.end, r5.begin,
           r5.end);
    EXPECT(comm_shards_init(&s, 128, 0, 128, err, sizeof(err)) == -1 && ct_has(err, "world 0"), "%s", err);
    EXPECT(comm_shards_init(&s, 128, 2, 0, err, sizeof(err)) == -1 && ct_has(err, "alignment 0"), "%s", err);
    EXPECT(comm_shards_init(&s, SIZE_MAX - 5, 1, 128, err, sizeof(err)) == -1 && ct_has(err, "overflow"), "%s", err);
    EXPECT(comm_shards_init(&s, SIZE_MAX - 5, 3, 1 << 20, err, sizeof(err)) == -1 && ct_has(err, "overflow"), "%s", err);
    return TEST_RESULT;
}

static uint32_t ct_value(size_t i) { return (uint32_t)(i * 2654435761u + 12345u); }  // element i's value

// Builds new rank r's shard from W1 old shard "files" with the plan, and checks every element of
// it against the element found by scanning the old ranks for the one that held it.
static int ct_check_reshard(size_t n, int W1, int W2, int r, uint32_t** old_files, size_t S1, size_t S2) {
    int failed = 0;
    char err[CT_ERR];
    CommShards from, to;
    comm_shards_init(&from, n, W1, 128, err, sizeof(err));
    comm_shards_init(&to, n, W2, 128, err, sizeof(err));
    CommCopy copies[8];
    int n_copies = -1;
    EXPECT(comm_reshard_plan(&from, &to, r, copies, W1, &n_copies, err, sizeof(err)) == 0, "%s", err);
    uint32_t* shard = (uint32_t*)calloc(S2, 4);
    uint8_t* writes = (uint8_t*)calloc(S2, 1);
    for (int c = 0; c < n_copies; c++) {
        const CommCopy* k = &copies[c];
        bool inside = k->old_rank >= 0 && k->old_rank < W1 && k->old_offset + k->count <= S1 &&
                      k->new_offset + k->count <= S2 && k->count > 0;
        EXPECT(inside, "W %d -> %d rank %d copy %d: old rank %d [%zu +%zu) -> %zu", W1, W2, r, c, k->old_rank,
               k->old_offset, k->count, k->new_offset);
        if (!inside) continue;
        memcpy(shard + k->new_offset, old_files[k->old_rank] + k->old_offset, k->count * 4);
        for (size_t j = 0; j < k->count; j++) writes[k->new_offset + j]++;
    }
    int bad = 0;
    for (size_t j = 0; j < S2 && bad < 3; j++) {
        size_t g = (size_t)r * S2 + j;  // the global element at offset j of new rank r's shard
        uint32_t want = 0;              // padding stays as it was
        int owners = 0;
        for (int q = 0; q < W1 && g < n; q++)
            if (g >= (size_t)q * S1 && g < (size_t)(q + 1) * S1) want = old_files[q][g - (size_t)q * S1], owners++;
        bool ok = shard[j] == want && writes[j] == (g < n ? 1 : 0) && (g >= n || (owners == 1 && want == ct_value(g)));
        if (!ok) bad++;
        EXPECT(ok, "n %zu W %d -> %d rank %d offset %zu: %u, want %u (written %d times)", n, W1, W2, r, j, shard[j],
               want, writes[j]);
    }
    free(shard);
    free(writes);
    return failed;
}

static int test_comm_reshard_plan(void) {
    int failed = 0;
    const int worlds[] = {1, 2, 3, 4, 8};
    const size_t sizes[] = {128, 384, 128 * 5, 128 * 37, 128 * 1000 + 128 * 3};
    for (size_t ni = 0; ni < sizeof(sizes) / sizeof(sizes[0]); ni++)
        for (int a = 0; a < 5; a++) {
            size_t n = sizes[ni];
            int W1 = worlds[a];
            size_t S1 = ct_shard_size(n, W1, 128);
            uint32_t* old_files[8];  // old rank q's file: its shard, padding past n marked
            for (int q = 0; q < W1; q++) {
                old_files[q] = (uint32_t*)malloc(S1 * 4);
                for (size_t j = 0; j < S1; j++) {
                    size_t g = (size_t)q * S1 + j;
                    old_files[q][j] = g < n ? ct_value(g) : 0xDEADBEEFu;
                }
            }
            for (int b = 0; b < 5; b++)
                for (int r = 0; r < worlds[b]; r++)
                    failed |= ct_check_reshard(n, W1, worlds[b], r, old_files, S1, ct_shard_size(n, worlds[b], 128));
            for (int q = 0; q < W1; q++) free(old_files[q]);
        }
    char err[CT_ERR];
    CommShards from, to, other;
    CommCopy copies[8];
    int n_copies;
    comm_shards_init(&from, 128 * 8, 8, 128, err, sizeof(err));
    comm_shards_init(&to, 128 * 8, 1, 128, err, sizeof(err));
    comm_shards_init(&other, 128 * 9, 1, 128, err, sizeof(err));
    EXPECT(comm_reshard_plan(&from, &to, 0, copies, 7, &n_copies, err, sizeof(err)) == -1 && ct_has(err, "room for 7"),
           "%s", err);
    EXPECT(comm_reshard_plan(&from, &other, 0, copies, 8, &n_copies, err, sizeof(err)) == -1 &&
           ct_has(err, "1024 elements, this run's 1152"), "%s", err);
    EXPECT(comm_reshard_plan(&from, &to, 1, copies, 8, &n_copies, err, sizeof(err)) == -1 && ct_has(err, "rank 1"),
           "%s", err);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// The bootstrap, between processes

// A port that was free a moment ago (the kernel picks it; the race with other programs is slim).
static int ct_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr*)&a, sizeof(a)) == 0 && getsockname(fd, (struct sockaddr*)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static CommEnv ct_rank_env(int rank, int world, const char* addr, int port) {
    CommEnv e;
    memset(&e, 0, sizeof(e));
    e.rank = rank, e.world = world, e.local_rank = rank, e.local_world = world, e.launcher = "test";
    snprintf(e.master_addr, sizeof(e.master_addr), "%s", addr);
    e.master_port = port;
    return e;
}

// What one child process does: a rank of the bootstrap, or a fake rank 0 or a stray client.
typedef struct {
    int kind;              // CT_RANK, or one of the fakes below
    CommEnv env;
    double timeout, delay; // the bootstrap's timeout; seconds to wait before starting
    const uint8_t* blob;   // what every rank must end up with
    size_t len;
} CtJob;
enum { CT_RANK, CT_ROOT_DROPS, CT_ROOT_ALIEN, CT_STRAY_GARBAGE, CT_STRAY_HALF_HELLO };

// A fake rank 0 (listening on env.master_port): it reads a hello, then answers with the start of
// the blob and hangs up (CT_ROOT_DROPS), or with something else than our protocol (CT_ROOT_ALIEN).
static int ct_fake_root(const CtJob* j, char* msg, size_t n) {
    int lfd = comm_listen(j->env.master_port, msg, n);
    if (lfd < 0) return -1;
    int rc = comm_wait_fd(lfd, POLLIN, now_seconds() + 5) == 1 ? 0 : fail(msg, n, "fake root: nobody came");
    int fd = rc == 0 ? accept4(lfd, NULL, NULL, SOCK_NONBLOCK) : -1;
    uint8_t hello[COMM_HELLO_BYTES], reply[COMM_REPLY_BYTES];
    if (fd >= 0) rc = comm_recv_all(fd, hello, sizeof(hello), now_seconds() + 5, "the peer", msg, n);
    if (fd >= 0 && rc == 0 && j->kind == CT_ROOT_DROPS) {
        comm_put32(reply, COMM_MAGIC), comm_put32(reply + 4, COMM_ACCEPTED), comm_put32(reply + 8, 0);
        rc = comm_send_all(fd, reply, sizeof(reply), now_seconds() + 5, "the peer", msg, n) ||
             comm_send_all(fd, j->blob, j->len / 2, now_seconds() + 5, "the peer", msg, n);
    } else if (fd >= 0 && rc == 0) {
        const char* http = "HTTP/1.1 400 Bad Request\r\n\r\n";
        rc = comm_send_all(fd, http, strlen(http), now_seconds() + 5, "the peer", msg, n);
    }
    if (fd >= 0) close(fd);
    close(lfd);
    return rc;
}

// A client that is no rank: it connects to rank 0, sends garbage or half a hello, and hangs up.
static int ct_stray(const CtJob* j, char* msg, size_t n) {
    int fd = -1;
    for (double end = now_seconds() + 5; fd < 0 && now_seconds() < end; sleep_seconds(0.02)) {
        struct addrinfo hints, *ai = NULL;
        memset(&hints, 0, sizeof(hints));
        hints.ai_family = AF_INET, hints.ai_socktype = SOCK_STREAM;
        char port[16];
        snprintf(port, sizeof(port), "%d", j->env.master_port);
        if (getaddrinfo("127.0.0.1", port, &hints, &ai) == 0) fd = comm_connect_once(ai, now_seconds() + 1);
        if (ai) freeaddrinfo(ai);
    }
    if (fd < 0) return fail(msg, n, "stray: could not connect");
    uint8_t bytes[COMM_HELLO_BYTES] = "GET / HTTP/1.1\r\n\r\n";
    if (j->kind == CT_STRAY_HALF_HELLO) comm_put32(bytes, COMM_MAGIC), comm_put32(bytes + 4, COMM_PROTOCOL);
    int rc = comm_send_all(fd, bytes, j->kind == CT_STRAY_HALF_HELLO ? 10 : sizeof(bytes), now_seconds() + 5, "rank 0",
                           msg, n);
    sleep_seconds(0.2);  // rank 0 reads it before the hang-up
    close(fd);
    return rc;
}

static void ct_child(const CtJob* j, int fd) {
    char msg[CT_ERR] = "";
    sleep_seconds(j->delay);
    int rc;
    if (j->kind == CT_ROOT_DROPS || j->kind == CT_ROOT_ALIEN) rc = ct_fake_root(j, msg, sizeof(msg));
    else if (j->kind != CT_RANK) rc = ct_stray(j, msg, sizeof(msg));
    else {
        uint8_t* blob = (uint8_t*)calloc(j->len, 1);
        if (j->env.rank == 0) memcpy(blob, j->blob, j->len);
        rc = comm_bootstrap_exchange(&j->env, blob, j->len, j->timeout, msg, sizeof(msg));
        if (rc == 0 && memcmp(blob, j->blob, j->len) != 0) rc = fail(msg, sizeof(msg), "the blob differs");
        free(blob);
    }
    ssize_t w = write(fd, msg, strlen(msg));
    (void)w;
    _exit(rc == 0 ? 0 : 1);
}

typedef struct {
    int status;     // 0: exited 0, 1: exited otherwise, -1: killed at the limit
    double seconds; // from the start of the run until it was seen to end
    char msg[CT_ERR];
} CtResult;

// Runs every job in its own process, waits at most `limit` seconds for all, kills what is left.
static void ct_run(const CtJob* jobs, int n, double limit, CtResult* out) {
    pid_t pids[16];
    int fds[16];
    double start = now_seconds();
    for (int i = 0; i < n; i++) {
        int p[2] = {-1, -1};
        if (pipe(p) != 0) p[0] = p[1] = -1;
        fflush(stdout), fflush(stderr);
        pids[i] = fork();
        if (pids[i] == 0) { close(p[0]); ct_child(&jobs[i], p[1]); }
        close(p[1]);
        fds[i] = p[0];
        out[i].status = -2;
        out[i].msg[0] = '\0';
    }
    for (int left = n; left > 0;) {
        bool late = now_seconds() > start + limit;
        for (int i = 0; i < n; i++) {
            if (out[i].status != -2) continue;
            int st = 0;
            if (pids[i] > 0 && late) kill(pids[i], SIGKILL);
            pid_t r = pids[i] > 0 ? waitpid(pids[i], &st, late ? 0 : WNOHANG) : -1;
            if (r == 0) continue;
            out[i].status = late ? -1 : (r > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0) ? 0 : 1;
            out[i].seconds = now_seconds() - start;
            ssize_t got = fds[i] >= 0 ? read(fds[i], out[i].msg, sizeof(out[i].msg) - 1) : 0;
            out[i].msg[got > 0 ? got : 0] = '\0';
            if (fds[i] >= 0) close(fds[i]);
            left--;
        }
        if (left) sleep_seconds(0.005);
    }
}

static void ct_random_blob(uint8_t* p, size_t n) {
    uint64_t x = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid();
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[i] = (uint8_t)x;
    }
}

static int test_comm_bootstrap_exchanges_blob(void) {
    int failed = 0;
    // (world, blob bytes, rank 0's address for the others, rank 0's delay): rank 0 starting last
    // makes the others retry; 1 MiB takes many partial sends; "localhost" may resolve to ::1 first
    struct { int world; size_t len; const char* addr; double delay; } cases[] = {
        {2, 128, "127.0.0.1", 0.3}, {4, 128, "localhost", 0.0}, {3, COMM_BLOB_MAX, "127.0.0.1", 0.1},
    };
    for (int c = 0; c < 3; c++) {
        int W = cases[c].world, port = ct_free_port();
        uint8_t* blob = (uint8_t*)malloc(cases[c].len);
        ct_random_blob(blob, cases[c].len);
        CtJob jobs[4];
        CtResult res[4];
        for (int r = 0; r < W; r++) {
            CtJob j = {CT_RANK, ct_rank_env(r, W, cases[c].addr, port), 10.0, r == 0 ? cases[c].delay : 0.0,
                       blob, cases[c].len};
            jobs[r] = j;
        }
        ct_run(jobs, W, 15.0, res);
        for (int r = 0; r < W; r++)
            EXPECT(res[r].status == 0 && res[r].seconds < 5, "world %d, %zu bytes: rank %d: status %d after %.1f s: %s",
                   W, cases[c].len, r, res[r].status, res[r].seconds, res[r].msg);
        free(blob);
    }
    return TEST_RESULT;
}

// Connections that are no rank (garbage; half a hello, then gone) do not disturb the bootstrap.
static int test_comm_bootstrap_ignores_strays(void) {
    int failed = 0;
    int port = ct_free_port();
    uint8_t blob[128];
    ct_random_blob(blob, sizeof(blob));
    CtJob jobs[4] = {
        {CT_RANK, ct_rank_env(0, 2, "127.0.0.1", port), 10.0, 0.0, blob, sizeof(blob)},
        {CT_STRAY_GARBAGE, ct_rank_env(0, 2, "127.0.0.1", port), 0, 0.0, blob, sizeof(blob)},
        {CT_STRAY_HALF_HELLO, ct_rank_env(0, 2, "127.0.0.1", port), 0, 0.0, blob, sizeof(blob)},
        {CT_RANK, ct_rank_env(1, 2, "127.0.0.1", port), 10.0, 0.5, blob, sizeof(blob)},
    };
    CtResult res[4];
    ct_run(jobs, 4, 15.0, res);
    for (int i = 0; i < 4; i++)
        EXPECT(res[i].status == 0 && res[i].seconds < 5, "process %d: status %d after %.1f s: %s", i, res[i].status,
               res[i].seconds, res[i].msg);
    return TEST_RESULT;
}

// World 3, but rank 2 never starts: rank 0 gives up at its 2 s timeout, naming rank 2.
static int test_comm_bootstrap_missing_rank(void) {
    int failed = 0;
    int port = ct_free_port();
    uint8_t blob[128];
    ct_random_blob(blob, sizeof(blob));
    CtJob jobs[2] = {
        {CT_RANK, ct_rank_env(0, 3, "127.0.0.1", port), 2.0, 0.0, blob, sizeof(blob)},
        {CT_RANK, ct_rank_env(1, 3, "127.0.0.1", port), 2.0, 0.0, blob, sizeof(blob)},
    };
    CtResult res[2];
    ct_run(jobs, 2, 8.0, res);
    EXPECT(res[0].status == 1 && ct_has(res[0].msg, "rank 2 did not connect within 2.0 s") &&
           ct_has(res[0].msg, "bootstrap, rank 0 of 3: "), "rank 0: status %d: %s", res[0].status, res[0].msg);
    EXPECT(res[0].seconds > 1.9 && res[0].seconds < 3.5, "rank 0 gave up after %.2f s, its timeout is 2 s", res[0].seconds);
    EXPECT(res[1].status == 1 && (ct_has(res[1].msg, "gave up") || ct_has(res[1].msg, "did not answer")),
           "rank 1: status %d: %s", res[1].status, res[1].msg);
    EXPECT(res[1].seconds < 3.5, "rank 1 ended after %.2f s", res[1].seconds);
    // and a rank whose rank 0 never starts gives up at its own timeout
    CtJob alone = {CT_RANK, ct_rank_env(1, 2, "127.0.0.1", ct_free_port()), 1.0, 0.0, blob, sizeof(blob)};
    ct_run(&alone, 1, 6.0, res);
    EXPECT(res[0].status == 1 && ct_has(res[0].msg, "could not connect to rank 0 at 127.0.0.1") &&
           ct_has(res[0].msg, "within 1.0 s"), "status %d: %s", res[0].status, res[0].msg);
    EXPECT(res[0].seconds > 0.9 && res[0].seconds < 2.5, "gave up after %.2f s, its timeout is 1 s", res[0].seconds);
    return TEST_RESULT;
}

// A rank launched with another world size, and two processes with the same rank, fail at once
// on both sides, each side saying what differs.
static int test_comm_bootstrap_disagreements(void) {
    int failed = 0;
    uint8_t blob[128];
    ct_random_blob(blob, sizeof(blob));
    int port = ct_free_port();
    CtJob world[2] = {
        {CT_RANK, ct_rank_env(0, 3, "127.0.0.1", port), 10.0, 0.0, blob, sizeof(blob)},
        {CT_RANK, ct_rank_env(1, 4, "127.0.0.1", port), 10.0, 0.0, blob, sizeof(blob)},
    };
    CtResult res[3];
    ct_run(world, 2, 15.0, res);
    EXPECT(res[0].status == 1 && ct_has(res[0].msg, "rank 1 (") && ct_has(res[0].msg, "world of 4 ranks, rank 0 with 3"),
           "rank 0: %s", res[0].msg);
    EXPECT(res[1].status == 1 && ct_has(res[1].msg, "rank 0 was launched with a world of 3 ranks, this rank with 4"),
           "rank 1: %s", res[1].msg);
    EXPECT(res[0].seconds < 3 && res[1].seconds < 3, "took %.1f and %.1f s of a 10 s timeout", res[0].seconds,
           res[1].seconds);
    port = ct_free_port();
    CtJob twice[3] = {
        {CT_RANK, ct_rank_env(0, 3, "127.0.0.1", port), 10.0, 0.0, blob, sizeof(blob)},
        {CT_RANK, ct_rank_env(1, 3, "127.0.0.1", port), 10.0, 0.0, blob, sizeof(blob)},
        {CT_RANK, ct_rank_env(1, 3, "127.0.0.1", port), 10.0, 0.2, blob, sizeof(blob)},
    };
    ct_run(twice, 3, 15.0, res);
    EXPECT(res[0].status == 1 && ct_has(res[0].msg, "rank 1 connected twice"), "rank 0: %s", res[0].msg);
    bool told = ct_has(res[1].msg, "already has a rank 1") || ct_has(res[2].msg, "already has a rank 1");
    EXPECT(res[1].status == 1 && res[2].status == 1 && told, "the ranks 1: '%s', '%s'", res[1].msg, res[2].msg);
    EXPECT(res[0].seconds < 3 && res[1].seconds < 3 && res[2].seconds < 3, "took %.1f, %.1f, %.1f s", res[0].seconds,
           res[1].seconds, res[2].seconds);
    return TEST_RESULT;
}

// Rank 0's port taken by another program; rank 0's name that does not resolve.
static int test_comm_bootstrap_port_and_name(void) {
    int failed = 0;
    char err[CT_ERR], want[64];
    uint8_t blob[128] = {0};
    int port = ct_free_port();
    int holder = comm_listen(port, err, sizeof(err));  // someone else's listener
    EXPECT(holder >= 0, "%s", err);
    CommEnv root = ct_rank_env(0, 2, "127.0.0.1", port);
    double t0 = now_seconds();
    int rc = comm_bootstrap_exchange(&root, blob, sizeof(blob), 1.0, err, sizeof(err));
    snprintf(want, sizeof(want), "port %d is already in use", port);
    EXPECT(rc == -1 && ct_has(err, want) && now_seconds() - t0 < 0.5, "%s", err);
    if (holder >= 0) close(holder);
    CtJob lost = {CT_RANK, ct_rank_env(1, 2, "no-such-host.invalid", port), 2.0, 0.0, blob, sizeof(blob)};
    CtResult res;
    ct_run(&lost, 1, 8.0, &res);
    EXPECT(res.status == 1 && ct_has(res.msg, "cannot resolve rank 0's address 'no-such-host.invalid'"),
           "status %d: %s", res.status, res.msg);
    return TEST_RESULT;
}

// Rank 0 hangs up halfway through the blob; rank 0's port answers in another protocol.
static int test_comm_bootstrap_broken_root(void) {
    int failed = 0;
    uint8_t blob[128];
    ct_random_blob(blob, sizeof(blob));
    for (int alien = 0; alien <= 1; alien++) {
        int port = ct_free_port();
        CtJob jobs[2] = {
            {alien ? CT_ROOT_ALIEN : CT_ROOT_DROPS, ct_rank_env(0, 2, "127.0.0.1", port), 5.0, 0.0, blob, sizeof(blob)},
            {CT_RANK, ct_rank_env(1, 2, "127.0.0.1", port), 5.0, 0.0, blob, sizeof(blob)},
        };
        CtResult res[2];
        ct_run(jobs, 2, 10.0, res);
        EXPECT(res[0].status == 0, "the fake rank 0: %s", res[0].msg);
        const char* want = alien ? "is not train_gpt's rank 0" : "rank 0 closed the connection after 64 of 128 bytes";
        EXPECT(res[1].status == 1 && ct_has(res[1].msg, want) && res[1].seconds < 3, "rank 1 after %.1f s: %s",
               res[1].seconds, res[1].msg);
    }
    return TEST_RESULT;
}

static const TestCase comm_tests[] = {
    {"comm_env_single", test_comm_env_single},
    {"comm_env_torchrun", test_comm_env_torchrun},
    {"comm_env_slurm", test_comm_env_slurm},
    {"comm_env_rejects_bad_values", test_comm_env_rejects_bad_values},
    {"comm_shard_ranges", test_comm_shard_ranges},
    {"comm_reshard_plan", test_comm_reshard_plan},
    {"comm_bootstrap_exchanges_blob", test_comm_bootstrap_exchanges_blob},
    {"comm_bootstrap_ignores_strays", test_comm_bootstrap_ignores_strays},
    {"comm_bootstrap_missing_rank", test_comm_bootstrap_missing_rank},
    {"comm_bootstrap_disagreements", test_comm_bootstrap_disagreements},
    {"comm_bootstrap_port_and_name", test_comm_bootstrap_port_and_name},
    {"comm_bootstrap_broken_root", test_comm_bootstrap_broken_root},
};
static const int n_comm_tests = sizeof(comm_tests) / sizeof(comm_tests[0]);

#endif
