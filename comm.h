/*
 * comm.h - data parallelism over NCCL: who this process is (the launcher's environment), how the
 * processes meet (a TCP bootstrap that hands NCCL's unique id from rank 0 to every other rank,
 * without MPI or a shared file system), who owns which part of the parameters (ZeRO's shard
 * arithmetic and the resharding of checkpoints), the NCCL communicator with its own stream and the
 * collectives train_gpt.cu queues on it, the watchdog that stops a rank whose peer died, and the
 * launcher behind --gpus N.
 *
 * train_gpt runs one process per GPU. A launcher (torchrun, or Slurm's srun) starts them and tells
 * each its rank in environment variables, which comm_env_read turns into a CommEnv. Rank 0 then
 * asks NCCL for a unique id, comm_bootstrap_exchange sends those 128 bytes from rank 0 to every
 * other rank over TCP, and each rank joins the communicator with it (comm_nccl_init). ZeRO splits
 * each bucket (one layer's range) of train_gpt.cu's flat parameter buffer into equal, aligned
 * pieces, one per rank; CommShards does that arithmetic, including the plan that reshards a
 * checkpoint written by W1 ranks for a run of W2. doc/data_parallel.md says how the ZeRO modes use
 * it, and what they cost.
 *
 * The convention: a function that can fail returns 0 (or a file descriptor) on success and -1 on
 * failure, with one line in (err, err_len) naming what failed and what to do about it. Nothing here
 * prints or exits, except the collectives and the watchdog, which stop the process with one line
 * when NCCL fails (NCCL_CHECK, for the calls that cannot fail for a peer's sake, lives beside
 * CUDA_CHECK in lib/cuda_check.h). Every wait has a deadline: a rank that never arrives is an
 * error naming it, never a hang. The bootstrap moves bytes and knows nothing of NCCL, so
 * test/test_comm.h runs it between real processes, no GPU.
 */
#ifndef COMM_H
#define COMM_H

#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdarg.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <poll.h>
#include <netdb.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include "lib/util.h"
#include "lib/cuda_check.h"

// ----------------------------------------------------------------------------------------------
// Errors and clocks

// Puts `prefix` in front of the message already in err (cut at the end if it no longer fits), so
// that a helper's message gains the caller's context ("bootstrap, rank 3 of 8: ..."). Returns -1.
static int comm_prefix(char* err, size_t err_len, const char* prefix) {
    if (!err || !err_len) return -1;
    size_t p = strlen(prefix), e = strnlen(err, err_len - 1);
    if (p > err_len - 1) p = err_len - 1;
    if (p + e > err_len - 1) e = err_len - 1 - p;
    memmove(err + p, err, e);
    memcpy(err, prefix, p);
    err[p + e] = '\0';
    return -1;
}

// Milliseconds until the deadline, rounded up (so that a poll that times out has reached it).
static int comm_ms_left(double deadline) {
    double ms = (deadline - now_seconds()) * 1e3;
    return ms <= 0 ? 0 : ms > 1e9 ? 1000000000 : (int)ms + 1;
}

// ----------------------------------------------------------------------------------------------
// The launch environment: which rank this process is, and where rank 0 listens
//
// torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Its
// agent on the first node serves its own key-value store on MASTER_PORT (workers are told so by
// TORCHELASTIC_USE_AGENT_STORE=True), so our bootstrap listens on the next port, MASTER_PORT + 1.
// Slurm's srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the tasks per node; it names no
// master, so rank 0's address comes from MASTER_ADDR and MASTER_PORT when the job script exports
// them, else from the caller's flag ("host:port"). torchrun's variables win when both are set
// (torchrun started by srun). With neither, this is a single process: rank 0 of 1.

#define COMM_MAX_WORLD 65536
#define COMM_ADDR_MAX 256

typedef const char* (*CommGetenv)(const char* name);  // getenv, or a test's fake environment

typedef struct {
    int rank, world;              // this process among all of them
    int local_rank, local_world;  // ... among those on this node; local_rank is the GPU it uses
    char master_addr[COMM_ADDR_MAX];  // rank 0's host name or address ("" when world is 1)
    int master_port;              // the port the bootstrap listens on (0 when world is 1)
    const char* launcher;         // "torchrun", "slurm" or "single"
} CommEnv;

static const char* comm_getenv(const char* name) { return getenv(name); }

// A whole number in lo..hi written in plain decimal digits: no sign, no spaces, nothing after it.
static int comm_parse_int(const char* name, const char* text, long lo, long hi, int* out, char* err,
                          size_t err_len) {
    if (!text) return fail(err, err_len, "%s is not set", name);
    if (!*text) return fail(err, err_len, "%s is empty; it must be a whole number in %ld..%ld", name, lo, hi);
    long v = 0;
    for (const char* p = text; *p; p++) {
        if (*p < '0' || *p > '9')
            return fail(err, err_len, "%s='%.64s' is not a whole number in %ld..%ld", name, text, lo, hi);
        v = v * 10 + (*p - '0');
        if (v > hi) return fail(err, err_len, "%s=%.64s is outside %ld..%ld", name, text, lo, hi);
    }
    if (v < lo) return fail(err, err_len, "%s=%s is outside %ld..%ld", name, text, lo, hi);
    *out = (int)v;
    return 0;
}

static int comm_set_addr(CommEnv* e, const char* name, const char* addr, size_t len, char* err, size_t err_len) {
    if (len == 0) return fail(err, err_len, "%s is empty; it must name rank 0's host", name);
    if (len >= sizeof(e->master_addr))
        return fail(err, err_len, "%s is %zu characters long; at most %zu fit", name, len, sizeof(e->master_addr) - 1);
    for (size_t i = 0; i < len; i++)
        if (addr[i] == ' ' || addr[i] == '\t' || addr[i] == '\n')
            return fail(err, err_len, "%s='%.*s' has a space in it", name, (int)len, addr);
    memcpy(e->master_addr, addr, len);
    e->master_addr[len] = '\0';
    return 0;
}

// "host:port" as the caller's flag gives it; an IPv6 address goes in brackets: "[fe80::1]:29500".
static int comm_parse_master(CommEnv* e, const char* flag, char* err, size_t err_len) {
    const char* colon = strrchr(flag, ':');
    if (!colon) return fail(err, err_len, "--master '%.64s' is not host:port", flag);
    const char* host = flag;
    size_t len = (size_t)(colon - flag);
    if (len >= 2 && host[0] == '[' && host[len - 1] == ']') host++, len -= 2;
    return comm_set_addr(e, "--master's host", host, len, err, err_len) ||
                   comm_parse_int("--master's port", colon + 1, 1, 65535, &e->master_port, err, err_len)
               ? -1
               : 0;
}

// Rank 0's address for a Slurm job: MASTER_ADDR and MASTER_PORT if exported, else the flag.
static int comm_env_master(CommEnv* e, CommGetenv get, const char* flag, char* err, size_t err_len) {
    const char* addr = get("MASTER_ADDR");
    const char* port = get("MASTER_PORT");
    if (addr && !port) return fail(err, err_len, "MASTER_ADDR is set but MASTER_PORT is not; set both");
    if (port && !addr) return fail(err, err_len, "MASTER_PORT is set but MASTER_ADDR is not; set both");
    if (addr)
        return comm_set_addr(e, "MASTER_ADDR", addr, strlen(addr), err, err_len) ||
                       comm_parse_int("MASTER_PORT", port, 1, 65535, &e->master_port, err, err_len)
                   ? -1
                   : 0;
    if (flag) return comm_parse_master(e, flag, err, err_len);
    return fail(err, err_len,
                     "Slurm names no rank 0 address: export MASTER_ADDR and MASTER_PORT in the job script "
                     "(MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1), "
                     "MASTER_PORT=29500) or pass --master host:port");
}

// Relations between the numbers, in the launcher's own words: names[] are the variables that
// gave rank, world, local_rank and local_world.
static int comm_env_check(const CommEnv* e, const char* const names[4], char* err, size_t err_len) {
    if (e->rank >= e->world)
        return fail(err, err_len, "%s=%d must be less than %s=%d", names[0], e->rank, names[1], e->world);
    if (e->local_rank >= e->local_world)
        return fail(err, err_len, "%s=%d must be less than %s=%d", names[2], e->local_rank, names[3],
                         e->local_world);
    if (e->local_world > e->world)
        return fail(err, err_len, "%s=%d exceeds %s=%d", names[3], e->local_world, names[1], e->world);
    return 0;
}

static int comm_env_torchrun(CommEnv* e, CommGetenv get, char* err, size_t err_len) {
    e->launcher = "torchrun";
    if (comm_parse_int("WORLD_SIZE", get("WORLD_SIZE"), 1, COMM_MAX_WORLD, &e->world, err, err_len) ||
        comm_parse_int("RANK", get("RANK"), 0, COMM_MAX_WORLD - 1, &e->rank, err, err_len) ||
        comm_parse_int("LOCAL_WORLD_SIZE", get("LOCAL_WORLD_SIZE"), 1, COMM_MAX_WORLD, &e->local_world, err, err_len) ||
        comm_parse_int("LOCAL_RANK", get("LOCAL_RANK"), 0, COMM_MAX_WORLD - 1, &e->local_rank, err, err_len))
        return -1;
    const char* const names[4] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
    if (comm_env_check(e, names, err, err_len)) return -1;
    if (e->world == 1) return 0;  // nobody to meet
    const char* addr = get("MASTER_ADDR");
    if (!addr) return fail(err, err_len, "MASTER_ADDR is not set (torchrun sets it; WORLD_SIZE=%d)", e->world);
    int port = 0;
    if (comm_set_addr(e, "MASTER_ADDR", addr, strlen(addr), err, err_len) ||
        comm_parse_int("MASTER_PORT", get("MASTER_PORT"), 1, 65535, &port, err, err_len))
        return -1;
    if (port == 65535)
        return fail(err, err_len, "MASTER_PORT=65535 leaves no port for the bootstrap, which listens on "
                                       "MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT); pick a lower one");
    e->master_port = port + 1;
    return 0;
}

// The tasks on node `node` (or on every node, when node is -1 and they all agree) from Slurm's
// compressed list: "4(x2),3" is 4 tasks on nodes 0 and 1, then 3 on node 2.
static int comm_slurm_tasks_on_node(const char* text, int node, int* out, char* err, size_t err_len) {
    const char* p = text;
    long n_nodes = 0, tasks = -1;
    for (;;) {
        long count = 0, repeat = 1;
        const char* start = p;
        while (*p >= '0' && *p <= '9' && count <= COMM_MAX_WORLD) count = count * 10 + (*p++ - '0');
        if (p == start || count < 1 || count > COMM_MAX_WORLD) break;
        if (p[0] == '(' && p[1] == 'x') {
            p += 2, repeat = 0, start = p;
            while (*p >= '0' && *p <= '9' && repeat <= COMM_MAX_WORLD) repeat = repeat * 10 + (*p++ - '0');
            if (p == start || *p++ != ')' || repeat < 1 || repeat > COMM_MAX_WORLD) break;
        }
        if (node >= 0 && node >= n_nodes && node < n_nodes + repeat) tasks = count;
        if (node < 0 && tasks >= 0 && tasks != count)
            return fail(err, err_len, "SLURM_TASKS_PER_NODE='%.64s' differs between nodes and SLURM_NODEID "
                                           "is not set, so this node's count is unknown", text);
        if (node < 0) tasks = count;
        n_nodes += repeat;
        if (*p == '\0') {
            if (tasks < 0)
                return fail(err, err_len, "SLURM_NODEID=%d but SLURM_TASKS_PER_NODE='%.64s' lists %ld nodes",
                                 node, text, n_nodes);
            *out = (int)tasks;
            return 0;
        }
        if (*p++ != ',') break;
    }
    return fail(err, err_len, "SLURM_TASKS_PER_NODE='%.64s' is not a list like 4(x2),3", text);
}

static int comm_env_slurm(CommEnv* e, CommGetenv get, const char* master_flag, char* err, size_t err_len) {
    e->launcher = "slurm";
    if (comm_parse_int("SLURM_NTASKS", get("SLURM_NTASKS"), 1, COMM_MAX_WORLD, &e->world, err, err_len) ||
        comm_parse_int("SLURM_PROCID", get("SLURM_PROCID"), 0, COMM_MAX_WORLD - 1, &e->rank, err, err_len) ||
        comm_parse_int("SLURM_LOCALID", get("SLURM_LOCALID"), 0, COMM_MAX_WORLD - 1, &e->local_rank, err, err_len))
        return -1;
    const char* per_node = get("SLURM_NTASKS_PER_NODE");  // set by --ntasks-per-node: the same everywhere
    const char* list = get("SLURM_TASKS_PER_NODE");       // always set, compressed, node by node
    if (per_node) {
        if (comm_parse_int("SLURM_NTASKS_PER_NODE", per_node, 1, COMM_MAX_WORLD, &e->local_world, err, err_len))
            return -1;
    } else if (list) {
        int node = -1;
        if (get("SLURM_NODEID") &&
            comm_parse_int("SLURM_NODEID", get("SLURM_NODEID"), 0, COMM_MAX_WORLD - 1, &node, err, err_len))
            return -1;
        if (comm_slurm_tasks_on_node(list, node, &e->local_world, err, err_len)) return -1;
    } else {
        return fail(err, err_len, "SLURM_PROCID is set but neither SLURM_NTASKS_PER_NODE nor "
                                       "SLURM_TASKS_PER_NODE is: start train_gpt with srun");
    }
    const char* const names[4] = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                  per_node ? "SLURM_NTASKS_PER_NODE" : "this node's SLURM_TASKS_PER_NODE"};
    if (comm_env_check(e, names, err, err_len)) return -1;
    return e->world == 1 ? 0 : comm_env_master(e, get, master_flag, err, err_len);
}

// Fills env from the launcher's variables, read through get (NULL: the real environment).
// master_flag ("host:port", or NULL) gives rank 0's address where the environment does not.
static int comm_env_read(CommEnv* env, CommGetenv get, const char* master_flag, char* err, size_t err_len) {
    if (!get) get = comm_getenv;
    memset(env, 0, sizeof(*env));
    env->world = env->local_world = 1;
    env->launcher = "single";
    int rc = 0;
    if (get("RANK") || get("WORLD_SIZE") || get("LOCAL_RANK") || get("LOCAL_WORLD_SIZE"))
        rc = comm_env_torchrun(env, get, err, err_len);
    else if (get("SLURM_PROCID"))
        rc = comm_env_slurm(env, get, master_flag, err, err_len);
    if (rc) {
        char prefix[64];
        snprintf(prefix, sizeof(prefix), "launch environment (%s): ", env->launcher);
        return comm_prefix(err, err_len, prefix);
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------
// Sockets with deadlines
//
// Every socket here is non-blocking, and every wait is a poll() bounded by the caller's deadline.
// send and recv may move fewer bytes than asked, or be interrupted by a signal (EINTR): both loop.
// MSG_NOSIGNAL: a peer that hung up is an error to report, not a SIGPIPE that kills the process.

// 1 when fd is ready for `events`, 0 when the deadline passed first, -1 (errno set) on error.
static int comm_wait_fd(int fd, short events, double deadline) {
    for (;;) {
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, comm_ms_left(deadline));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r > 0) return 1;  // ready, or an error or hang-up that the next send or recv reports
        if (now_seconds() >= deadline) return 0;
    }
}

static int comm_send_all(int fd, const void* buf, size_t n, double deadline, const char* to, char* err,
                         size_t err_len) {
    const uint8_t* p = (const uint8_t*)buf;
    char text[128];
    for (size_t done = 0; done < n;) {
        ssize_t w = send(fd, p + done, n - done, MSG_NOSIGNAL);
        if (w > 0) { done += (size_t)w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = comm_wait_fd(fd, POLLOUT, deadline);
            if (r > 0) continue;
            if (r == 0) {
                errno = ETIMEDOUT;
                return fail(err, err_len, "sending to %s timed out after %zu of %zu bytes", to, done, n);
            }
        }
        return fail(err, err_len, "sending to %s failed after %zu of %zu bytes: %s", to, done, n,
                         system_error_text(errno, text, sizeof(text)));
    }
    return 0;
}

// Like comm_send_all; the connection closing before n bytes arrived is an error too. On a timeout,
// errno is ETIMEDOUT, so that the caller can say what it was waiting for.
static int comm_recv_all(int fd, void* buf, size_t n, double deadline, const char* from, char* err,
                         size_t err_len) {
    uint8_t* p = (uint8_t*)buf;
    char text[128];
    for (size_t done = 0; done < n;) {
        ssize_t r = recv(fd, p + done, n - done, 0);
        if (r > 0) { done += (size_t)r; continue; }
        if (r == 0)
            return fail(err, err_len, "%s closed the connection after %zu of %zu bytes", from, done, n);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = comm_wait_fd(fd, POLLIN, deadline);
            if (w > 0) continue;
            if (w == 0) {
                errno = ETIMEDOUT;
                return fail(err, err_len, "receiving from %s timed out after %zu of %zu bytes", from, done, n);
            }
        }
        return fail(err, err_len, "receiving from %s failed after %zu of %zu bytes: %s", from, done, n,
                         system_error_text(errno, text, sizeof(text)));
    }
    return 0;
}

// Binds a listening socket to every address of this machine on `port`. IPv6's wildcard with
// IPV6_V6ONLY off takes IPv4 connections too; without IPv6 in the kernel, IPv4's wildcard.
// SO_REUSEADDR lets a new run take the port while the last run's connections sit in TIME_WAIT;
// it does not let two listeners share it, so a port in use is still an error.
static int comm_listen(int port, char* err, size_t err_len) {
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof(addr));
    socklen_t addr_len;
    int zero = 0, one = 1;
    if (fd >= 0) {
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        struct sockaddr_in6* a6 = (struct sockaddr_in6*)&addr;
        a6->sin6_family = AF_INET6;
        a6->sin6_addr = in6addr_any;
        a6->sin6_port = htons((uint16_t)port);
        addr_len = sizeof(*a6);
    } else {
        fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        struct sockaddr_in* a4 = (struct sockaddr_in*)&addr;
        a4->sin_family = AF_INET;
        a4->sin_addr.s_addr = htonl(INADDR_ANY);
        a4->sin_port = htons((uint16_t)port);
        addr_len = sizeof(*a4);
    }
    char text[128];
    if (fd < 0) return fail(err, err_len, "socket: %s", system_error_text(errno, text, sizeof(text)));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr*)&addr, addr_len) != 0 || listen(fd, SOMAXCONN) != 0) {
        int e = errno;
        close(fd);
        if (e == EADDRINUSE)
            return fail(err, err_len, "port %d is already in use on this machine (another job, or a "
                                           "previous run still exiting); choose another port", port);
        return fail(err, err_len, "cannot listen on port %d: %s", port, system_error_text(e, text, sizeof(text)));
    }
    return fd;
}

// ----------------------------------------------------------------------------------------------
// The bootstrap: rank 0 sends a blob (NCCL's unique id) to every other rank
//
// Rank 0 listens on its port and accepts connections until every other rank has said hello. A
// hello is five big-endian 32-bit words: magic, protocol version, the sender's rank, its world
// size and the blob length it expects. Rank 0 checks them (a different world size, blob length or
// version, or a rank that is taken, fails the bootstrap on both sides; a connection without the
// magic is not ours, and is dropped). Once all have arrived, rank 0 answers each with three words
// (magic, COMM_ACCEPTED, 0) and the blob. A refusal is the same three words with the reason and a
// detail (rank 0's own value), so that the refused rank can say what differs; when rank 0 gives
// up, it tells the ranks that did arrive (COMM_GAVE_UP) before closing. The other ranks connect
// with retries until their deadline, since rank 0 may start after them.

#define COMM_MAGIC 0x54475042u  // "TGPB": train_gpt bootstrap
#define COMM_PROTOCOL 1
#define COMM_BLOB_MAX (1u << 20)
enum { COMM_HELLO_BYTES = 20, COMM_REPLY_BYTES = 12 };
enum { COMM_ACCEPTED, COMM_BAD_VERSION, COMM_BAD_WORLD, COMM_BAD_LEN, COMM_BAD_RANK, COMM_DUPLICATE, COMM_GAVE_UP };

static void comm_put32(uint8_t* p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8), p[3] = (uint8_t)v;
}
static uint32_t comm_get32(const uint8_t* p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

typedef struct {
    int fd;                            // -1: no connection
    uint8_t hello[COMM_HELLO_BYTES];   // as much of the hello as has arrived
    size_t got;
    char from[96];                     // the peer's address, for messages
} CommConn;

typedef struct {
    const CommEnv* env;
    size_t blob_len;
    int listen_fd;
    CommConn* pending;  // accepted, hello not complete yet
    int n_pending, max_pending;
    CommConn* ranks;    // [world]: ranks[r].fd >= 0 once rank r's hello is accepted
    int arrived;        // ranks other than 0 that have
} CommRoot;

// Rank 0's answer: three words, sent without waiting (12 bytes fit any fresh socket's buffer).
static void comm_reply(int fd, uint32_t status, uint32_t detail) {
    uint8_t msg[COMM_REPLY_BYTES];
    comm_put32(msg, COMM_MAGIC), comm_put32(msg + 4, status), comm_put32(msg + 8, detail);
    ssize_t w;
    do w = send(fd, msg, sizeof(msg), MSG_NOSIGNAL | MSG_DONTWAIT);
    while (w < 0 && errno == EINTR);
}

static void comm_root_accept(CommRoot* s) {
    for (;;) {
        struct sockaddr_storage addr;
        socklen_t len = sizeof(addr);
        int fd = accept4(s->listen_fd, (struct sockaddr*)&addr, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && errno == EINTR) continue;
        if (fd < 0) return;  // EAGAIN: no more for now; a failed accept is the peer's to retry
        if (s->n_pending == s->max_pending) { close(fd); continue; }
        CommConn* c = &s->pending[s->n_pending++];
        c->fd = fd, c->got = 0;
        char host[64] = "?", port[16] = "?";
        getnameinfo((struct sockaddr*)&addr, len, host, sizeof(host), port, sizeof(port),
                    NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(c->from, sizeof(c->from), "%s port %s", host, port);
    }
}

// A complete hello: 1 when it is accepted (the connection moves to s->ranks), 0 when it is not
// ours (the caller drops it), -1 when it proves the ranks disagree (err says how; the peer is told).
static int comm_root_check(CommRoot* s, CommConn* c, char* err, size_t err_len) {
    uint32_t magic = comm_get32(c->hello), version = comm_get32(c->hello + 4), rank = comm_get32(c->hello + 8);
    uint32_t world = comm_get32(c->hello + 12), len = comm_get32(c->hello + 16);
    uint32_t our_world = (uint32_t)s->env->world, our_len = (uint32_t)s->blob_len;
    if (magic != COMM_MAGIC) return 0;
    if (version != COMM_PROTOCOL) {
        comm_reply(c->fd, COMM_BAD_VERSION, COMM_PROTOCOL);
        return fail(err, err_len, "rank %u (%s) speaks bootstrap protocol %u, rank 0 speaks %d: every rank "
                         "must run the same train_gpt", rank, c->from, version, COMM_PROTOCOL);
    }
    if (world != our_world) {
        comm_reply(c->fd, COMM_BAD_WORLD, our_world);
        return fail(err, err_len, "rank %u (%s) was launched with a world of %u ranks, rank 0 with %u: "
                         "every rank must have the same world size", rank, c->from, world, our_world);
    }
    if (rank == 0 || rank >= our_world) {
        comm_reply(c->fd, COMM_BAD_RANK, our_world);
        return fail(err, err_len, "a process at %s says it is rank %u, outside 1..%u", c->from, rank,
                         our_world - 1);
    }
    if (len != our_len) {
        comm_reply(c->fd, COMM_BAD_LEN, our_len);
        return fail(err, err_len, "rank %u (%s) expects %u bytes, rank 0 sends %u", rank, c->from, len, our_len);
    }
    if (s->ranks[rank].fd >= 0) {
        comm_reply(c->fd, COMM_DUPLICATE, rank);
        return fail(err, err_len, "rank %u connected twice (from %s and from %s): two processes were given "
                         "the same rank", rank, s->ranks[rank].from, c->from);
    }
    s->ranks[rank] = *c;
    s->arrived++;
    return 1;
}

// Reads what has arrived of pending connection i's hello. Returns -1 only when the ranks disagree.
static int comm_root_read(CommRoot* s, int i, char* err, size_t err_len) {
    CommConn* c = &s->pending[i];
    ssize_t r;
    do r = recv(c->fd, c->hello + c->got, sizeof(c->hello) - c->got, 0);
    while (r < 0 && errno == EINTR);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    int verdict = 0;  // 0: drop the connection (closed, failed, or not ours), 1: accepted, -1: fatal
    if (r > 0) {
        c->got += (size_t)r;
        if (c->got < sizeof(c->hello)) return 0;
        verdict = comm_root_check(s, c, err, err_len);
    }
    if (verdict <= 0) close(c->fd);
    s->pending[i] = s->pending[--s->n_pending];  // removed from the pending list either way
    return verdict < 0 ? -1 : 0;
}

// "ranks 2, 5 and 7" (at most 16 named) of the ranks that have not said hello.
static void comm_root_missing(const CommRoot* s, char* out, size_t n) {
    int missing = s->env->world - 1 - s->arrived, named = 0;
    size_t used = (size_t)snprintf(out, n, "%s", missing == 1 ? "rank" : "ranks");
    for (int r = 1; r < s->env->world && used < n; r++) {
        if (s->ranks[r].fd >= 0) continue;
        if (named == 16) { snprintf(out + used, n - used, " and %d more", missing - named); return; }
        const char* sep = named == 0 ? " " : named == missing - 1 ? " and " : ", ";
        used += (size_t)snprintf(out + used, n - used, "%s%d", sep, r);
        named++;
    }
}

// Accepts connections and reads hellos until every rank has arrived or the deadline has passed.
static int comm_root_gather(CommRoot* s, double deadline, double timeout_s, char* err, size_t err_len) {
    struct pollfd* fds = (struct pollfd*)malloc(sizeof(struct pollfd) * (size_t)(s->max_pending + 1));
    if (!fds) return fail(err, err_len, "out of memory");
    int rc = 0;
    while (rc == 0 && s->arrived < s->env->world - 1) {
        int ms = comm_ms_left(deadline);
        if (ms == 0) {
            char missing[256];
            comm_root_missing(s, missing, sizeof(missing));
            rc = fail(err, err_len, "%s did not connect within %.1f s (%d of %d arrived): are they running, "
                           "with rank 0's address (%s) and the same port?", missing, timeout_s, s->arrived,
                           s->env->world - 1, s->env->master_addr);
            break;
        }
        fds[0].fd = s->listen_fd, fds[0].events = POLLIN, fds[0].revents = 0;
        for (int i = 0; i < s->n_pending; i++)
            fds[i + 1].fd = s->pending[i].fd, fds[i + 1].events = POLLIN, fds[i + 1].revents = 0;
        int n_polled = s->n_pending;
        int r = poll(fds, (nfds_t)(n_polled + 1), ms);
        if (r < 0 && errno != EINTR) {
            char text[128];
            rc = fail(err, err_len, "poll: %s", system_error_text(errno, text, sizeof(text)));
        }
        if (r <= 0) continue;
        // Back to front, since comm_root_read moves the last pending connection into a freed slot.
        for (int i = n_polled - 1; i >= 0 && rc == 0; i--)
            if (fds[i + 1].revents) rc = comm_root_read(s, i, err, err_len);
        if (rc == 0 && fds[0].revents) comm_root_accept(s);
    }
    free(fds);
    return rc;
}

// Closes every connection; when the bootstrap failed, first tells the ranks that had arrived.
static void comm_root_close(CommRoot* s, bool failed) {
    for (int i = 0; i < s->n_pending; i++) close(s->pending[i].fd);
    for (int r = 0; s->ranks && r < s->env->world; r++) {
        if (s->ranks[r].fd < 0) continue;
        if (failed) comm_reply(s->ranks[r].fd, COMM_GAVE_UP, 0);
        close(s->ranks[r].fd);
    }
    if (s->listen_fd >= 0) close(s->listen_fd);
    free(s->pending);
    free(s->ranks);
}

static int comm_bootstrap_root(const CommEnv* env, const void* blob, size_t len, double timeout_s, char* err,
                               size_t err_len) {
    double deadline = now_seconds() + timeout_s;
    CommRoot s;
    memset(&s, 0, sizeof(s));
    s.env = env, s.blob_len = len;
    s.listen_fd = comm_listen(env->master_port, err, err_len);
    if (s.listen_fd < 0) return -1;
    s.max_pending = env->world + 16;  // room for strays besides every rank
    s.pending = (CommConn*)calloc((size_t)s.max_pending, sizeof(CommConn));
    s.ranks = (CommConn*)calloc((size_t)env->world, sizeof(CommConn));
    if (!s.pending || !s.ranks) {
        close(s.listen_fd);
        free(s.pending);
        free(s.ranks);
        return fail(err, err_len, "out of memory for %d connections", env->world);
    }
    for (int r = 0; r < env->world; r++) s.ranks[r].fd = -1;
    int rc = comm_root_gather(&s, deadline, timeout_s, err, err_len);
    uint8_t reply[COMM_REPLY_BYTES];
    comm_put32(reply, COMM_MAGIC), comm_put32(reply + 4, COMM_ACCEPTED), comm_put32(reply + 8, 0);
    for (int r = 1; rc == 0 && r < env->world; r++) {
        char to[32];
        snprintf(to, sizeof(to), "rank %d", r);
        rc = comm_send_all(s.ranks[r].fd, reply, sizeof(reply), deadline, to, err, err_len) ||
                     comm_send_all(s.ranks[r].fd, blob, len, deadline, to, err, err_len)
                 ? -1
                 : 0;
    }
    comm_root_close(&s, rc != 0);
    return rc;
}

// Resolves rank 0's name. A name that does not exist fails at once; a resolver that is down for
// the moment (EAI_AGAIN) is asked again until the deadline.
static struct addrinfo* comm_resolve(const CommEnv* env, double deadline, char* err, size_t err_len) {
    struct addrinfo hints, *list = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    char port[16];
    snprintf(port, sizeof(port), "%d", env->master_port);
    for (;;) {
        int rc = getaddrinfo(env->master_addr, port, &hints, &list);
        if (rc == 0) return list;
        if (rc != EAI_AGAIN || now_seconds() >= deadline) {
            fail(err, err_len, "cannot resolve rank 0's address '%s': %s", env->master_addr, gai_strerror(rc));
            return NULL;
        }
        sleep_seconds(0.1);
    }
}

// One connection attempt, bounded by the deadline. Returns the socket, or -1 with errno set.
static int comm_connect_once(const struct addrinfo* ai, double deadline) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && (errno == EINPROGRESS || errno == EINTR)) {  // under way: done when writable
        int ready = comm_wait_fd(fd, POLLOUT, deadline);
        int so_error = 0;
        socklen_t n = sizeof(so_error);
        if (ready == 0) errno = ETIMEDOUT;
        if (ready > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &n) == 0) {
            rc = so_error ? -1 : 0;  // the connection's outcome, e.g. ECONNREFUSED
            errno = so_error;
        }
    }
    if (rc == 0) return fd;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}

// Connects to rank 0, trying each of its addresses, again and again until the deadline: rank 0
// may not be listening yet. Each attempt gets at most 2 s, so that an address that swallows
// packets does not hide the next one.
static int comm_peer_connect(const CommEnv* env, double deadline, double timeout_s, char* err, size_t err_len) {
    struct addrinfo* list = comm_resolve(env, deadline, err, err_len);
    if (!list) return -1;
    int last_errno = ETIMEDOUT;
    for (;;) {
        for (const struct addrinfo* ai = list; ai; ai = ai->ai_next) {
            double attempt = now_seconds() + 2.0;
            int fd = comm_connect_once(ai, attempt < deadline ? attempt : deadline);
            if (fd >= 0) {
                freeaddrinfo(list);
                return fd;
            }
            last_errno = errno;
        }
        double left = deadline - now_seconds();
        if (left <= 0) break;
        sleep_seconds(left < 0.05 ? left : 0.05);
    }
    freeaddrinfo(list);
    char text[128];
    return fail(err, err_len, "could not connect to rank 0 at %s port %d within %.1f s (last error: %s): is "
                     "rank 0 running, and is its address right?", env->master_addr, env->master_port, timeout_s,
                     system_error_text(last_errno, text, sizeof(text)));
}

// Rank 0's refusal, in this rank's words.
static int comm_peer_refused(const CommEnv* env, uint32_t status, uint32_t detail, size_t len, char* err,
                             size_t err_len) {
    switch (status) {
    case COMM_BAD_VERSION:
        return fail(err, err_len, "rank 0 speaks bootstrap protocol %u, this rank %d: every rank must run "
                         "the same train_gpt", detail, COMM_PROTOCOL);
    case COMM_BAD_WORLD:
        return fail(err, err_len, "rank 0 was launched with a world of %u ranks, this rank with %d: every "
                         "rank must have the same world size", detail, env->world);
    case COMM_BAD_LEN:
        return fail(err, err_len, "rank 0 sends %u bytes, this rank expects %zu", detail, len);
    case COMM_BAD_RANK:
        return fail(err, err_len, "rank 0 expects ranks 1..%u, not %d", detail - 1, env->rank);
    case COMM_DUPLICATE:
        return fail(err, err_len, "rank 0 already has a rank %u: two processes were given the same rank",
                         detail);
    case COMM_GAVE_UP:
        return fail(err, err_len, "rank 0 gave up before every rank had arrived (its error says why)");
    default:
        return fail(err, err_len, "rank 0 refused this rank for a reason unknown here (%u)", status);
    }
}

static int comm_bootstrap_peer(const CommEnv* env, void* blob, size_t len, double timeout_s, char* err,
                               size_t err_len) {
    double deadline = now_seconds() + timeout_s;
    int fd = comm_peer_connect(env, deadline, timeout_s, err, err_len);
    if (fd < 0) return -1;
    uint8_t hello[COMM_HELLO_BYTES], reply[COMM_REPLY_BYTES];
    comm_put32(hello, COMM_MAGIC), comm_put32(hello + 4, COMM_PROTOCOL), comm_put32(hello + 8, (uint32_t)env->rank);
    comm_put32(hello + 12, (uint32_t)env->world), comm_put32(hello + 16, (uint32_t)len);
    int rc = comm_send_all(fd, hello, sizeof(hello), deadline, "rank 0", err, err_len);
    if (rc == 0 && comm_recv_all(fd, reply, sizeof(reply), deadline, "rank 0", err, err_len) != 0) {
        rc = -1;
        if (errno == ETIMEDOUT)
            fail(err, err_len, "rank 0 did not answer within %.1f s; it answers once all %d ranks have "
                      "connected, so some are missing (rank 0's error names them)", timeout_s, env->world);
    }
    if (rc == 0 && comm_get32(reply) != COMM_MAGIC)
        rc = fail(err, err_len, "what answers at %s port %d is not train_gpt's rank 0 (another service?)",
                       env->master_addr, env->master_port);
    if (rc == 0 && comm_get32(reply + 4) != COMM_ACCEPTED)
        rc = comm_peer_refused(env, comm_get32(reply + 4), comm_get32(reply + 8), len, err, err_len);
    if (rc == 0) rc = comm_recv_all(fd, blob, len, deadline, "rank 0", err, err_len);
    close(fd);
    return rc;
}

// Rank 0 sends `len` bytes at `blob` to every other rank, which receive them into their `blob`.
// Every rank calls it; it returns once this rank's part is done (rank 0: all sent), or fails
// within timeout_s seconds. A single process (world 1) has nothing to do.
static int comm_bootstrap_exchange(const CommEnv* env, void* blob, size_t len, double timeout_s, char* err,
                                   size_t err_len) {
    if (env->world == 1) return 0;
    char prefix[96];
    snprintf(prefix, sizeof(prefix), "bootstrap, rank %d of %d: ", env->rank, env->world);
    if (len == 0 || len > COMM_BLOB_MAX) {
        fail(err, err_len, "%zu bytes to send; 1..%u can be", len, COMM_BLOB_MAX);
        return comm_prefix(err, err_len, prefix);
    }
    int rc = env->rank == 0 ? comm_bootstrap_root(env, blob, len, timeout_s, err, err_len)
                            : comm_bootstrap_peer(env, blob, len, timeout_s, err, err_len);
    return rc ? comm_prefix(err, err_len, prefix) : 0;
}

// ----------------------------------------------------------------------------------------------
// ZeRO's shards: which elements of the flat buffers each rank owns
//
// The flat buffer has n elements (train_gpt pads every tensor to a multiple of PARAM_ALIGN = 128,
// so n is a multiple of 128) and is cut into `world` contiguous shards of EQUAL size: NCCL's
// reduce-scatter and all-gather give every rank the same count. The shard size is ceil(n / world)
// rounded up to `align` (so that every boundary is a multiple of it: AdamW reads one decay flag per
// 128 elements, and cuBLASLt likes 256-byte boundaries). The collective buffers are then padded
// to world * shard elements, zero past n; rank r's real data is [r * shard, (r + 1) * shard)
// clamped to n, which leaves the last ranks short, or empty when world > n / align.

typedef struct {
    size_t n;      // elements of real data
    int world;     // ranks
    size_t align;  // every shard boundary is a multiple of it
    size_t shard;  // elements per rank, padding included: the count of the collectives
} CommShards;

typedef struct {
    size_t begin, end;  // [begin, end), in elements
} CommRange;

static int comm_shards_init(CommShards* s, size_t n, int world, size_t align, char* err, size_t err_len) {
    memset(s, 0, sizeof(*s));
    if (world < 1) return fail(err, err_len, "shards: world %d must be at least 1", world);
    if (align < 1) return fail(err, err_len, "shards: alignment %zu must be at least 1", align);
    size_t per_rank = n / (size_t)world + (n % (size_t)world != 0);
    size_t shard = (per_rank / align + (per_rank % align != 0)) * align;
    if (shard / align < per_rank / align || shard > SIZE_MAX / (size_t)world)
        return fail(err, err_len, "shards: %zu elements in %d shards of %zu overflow", n, world, align);
    s->n = n, s->world = world, s->align = align, s->shard = shard;
    return 0;
}

// The length of the collectives' buffers: every rank's shard, padding included.
static size_t comm_padded_len(const CommShards* s) { return s->shard * (size_t)s->world; }

static CommRange comm_clamp(size_t begin, size_t end, size_t n) {
    CommRange r = {begin < n ? begin : n, end < n ? end : n};
    return r;
}

// The elements of real data that rank `rank` owns (empty for a rank past the end).
static CommRange comm_shard_range(const CommShards* s, int rank) {
    return comm_clamp((size_t)rank * s->shard, ((size_t)rank + 1) * s->shard, s->n);
}

// The overlap of two ranges; when there is none, the empty range at a's beginning.
static CommRange comm_range_intersect(CommRange a, CommRange b) {
    CommRange r = {a.begin > b.begin ? a.begin : b.begin, a.end < b.end ? a.end : b.end};
    if (r.end <= r.begin) r.begin = r.end = a.begin;
    return r;
}

// One piece of a resharding: `count` elements from offset old_offset of old rank old_rank's shard
// go to offset new_offset of the new rank's shard.
typedef struct {
    int old_rank;
    size_t old_offset, new_offset, count;
} CommCopy;

// The copies that build new rank `rank`'s shard (of layout `to`) from the shards of a checkpoint
// written with layout `from`; offsets are relative to each shard's start, in elements. Elements
// past n are in no copy: the new shard's padding stays as the caller filled it (zero). At most
// from->world copies, in order of old rank; max_copies is the room at copies.
static int comm_reshard_plan(const CommShards* from, const CommShards* to, int rank, CommCopy* copies,
                             int max_copies, int* n_copies, char* err, size_t err_len) {
    *n_copies = 0;
    if (from->n != to->n)
        return fail(err, err_len, "reshard: the checkpoint's shards hold %zu elements, this run's %zu",
                         from->n, to->n);
    if (rank < 0 || rank >= to->world)
        return fail(err, err_len, "reshard: rank %d is outside 0..%d", rank, to->world - 1);
    CommRange mine = comm_shard_range(to, rank);
    for (int q = 0; q < from->world; q++) {
        CommRange theirs = comm_shard_range(from, q);
        CommRange both = comm_range_intersect(mine, theirs);
        if (both.begin == both.end) continue;
        if (*n_copies == max_copies)
            return fail(err, err_len, "reshard: more than %d copies (room for %d)", max_copies, max_copies);
        CommCopy* c = &copies[(*n_copies)++];
        c->old_rank = q;
        c->old_offset = both.begin - theirs.begin;
        c->new_offset = both.begin - mine.begin;
        c->count = both.end - both.begin;
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------
// NCCL: the communicator
//
// NCCL_CHECK is CUDA_CHECK's twin (lib/cuda_check.h): one line naming the call, its file and line
// and NCCL's error string, then exit(1). It is for calls that complete before they return. The
// communicator comm_nccl_init makes is non-blocking (config.blocking = 0), so that a missing or
// dead peer cannot hang init: NCCL's calls on it may return ncclInProgress, and the caller then
// polls ncclCommGetAsyncError until the state leaves ncclInProgress (comm_nccl_wait) before making
// another call; on an error or a timeout, ncclCommAbort frees the communicator without waiting.


// Waits until the communicator's pending operation has finished: 0 when it succeeded, -1 when it
// failed or the deadline passed (the caller then aborts the communicator).
static int comm_nccl_wait(ncclComm_t comm, double deadline, double timeout_s, char* err, size_t err_len) {
    ncclResult_t state = ncclInProgress;
    for (;;) {
        ncclResult_t r = ncclCommGetAsyncError(comm, &state);
        if (r != ncclSuccess) return fail(err, err_len, "ncclCommGetAsyncError: %s", ncclGetErrorString(r));
        if (state != ncclInProgress) break;
        if (now_seconds() >= deadline)
            return fail(err, err_len, "NCCL did not finish within %.1f s: a rank is missing or stuck", timeout_s);
        sleep_seconds(0.001);
    }
    if (state != ncclSuccess)
        return fail(err, err_len, "NCCL: %s (%s)", ncclGetErrorString(state), ncclGetLastError(comm));
    return 0;
}

// The communicator of all env->world ranks, this one on GPU env->local_rank: rank 0 makes NCCL's
// unique id, the bootstrap hands it to the others, and each joins. Both steps fail within
// timeout_s seconds each when a rank is missing, rather than hang.
static int comm_nccl_init(ncclComm_t* out, const CommEnv* env, double timeout_s, char* err, size_t err_len) {
    *out = NULL;
    char prefix[96];
    snprintf(prefix, sizeof(prefix), "NCCL init, rank %d of %d: ", env->rank, env->world);
    int n_gpus = 0;
    cudaError_t ce = cudaGetDeviceCount(&n_gpus);
    if (ce == cudaSuccess && env->local_rank >= n_gpus) {
        fail(err, err_len, "local rank %d needs GPU %d, but this node has %d; start at most %d ranks per node",
                  env->local_rank, env->local_rank, n_gpus, n_gpus);
        return comm_prefix(err, err_len, prefix);
    }
    if (ce == cudaSuccess) ce = cudaSetDevice(env->local_rank);
    if (ce != cudaSuccess) {
        fail(err, err_len, "GPU %d: %s", env->local_rank, cudaGetErrorString(ce));
        return comm_prefix(err, err_len, prefix);
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    ncclResult_t r = env->rank == 0 ? ncclGetUniqueId(&id) : ncclSuccess;
    if (r != ncclSuccess) {
        fail(err, err_len, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        return comm_prefix(err, err_len, prefix);
    }
    if (comm_bootstrap_exchange(env, &id, sizeof(id), timeout_s, err, err_len)) return -1;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = NULL;
    double deadline = now_seconds() + timeout_s;
    r = ncclCommInitRankConfig(&comm, env->world, id, env->rank, &config);
    int rc = 0;
    if (r != ncclSuccess && r != ncclInProgress)
        rc = fail(err, err_len, "ncclCommInitRankConfig: %s (%s)", ncclGetErrorString(r), ncclGetLastError(comm));
    else
        rc = comm_nccl_wait(comm, deadline, timeout_s, err, err_len);
    if (rc) {
        if (comm) ncclCommAbort(comm);
        return comm_prefix(err, err_len, prefix);
    }
    *out = comm;
    return 0;
}

// ----------------------------------------------------------------------------------------------
// Collectives for training: one communicator, one stream
//
// Every collective runs on the Comm's own stream, in the same order on every rank (NCCL's rule),
// so that it overlaps the compute stream's work: comm_follow makes the comm stream wait for what
// the compute stream has queued so far (a bucket's gradients, say), comm_join the other way round.
// The communicator is non-blocking (see comm_nccl_init): each call may return ncclInProgress while
// NCCL enqueues it, and comm_call waits for that (with the deadline) before the next call. A
// failure here is not an input error: it prints one line naming the rank and exits, like
// CUDA_CHECK.

typedef struct {
    CommEnv env;
    int rank, world;
    ncclComm_t nccl;
    cudaStream_t stream;
    cudaEvent_t to_comm, from_comm;  // reused: a wait takes the event's latest record
    double timeout_s;
    volatile double last_progress;   // now_seconds() of the trainer's last finished step (watchdog)
    pthread_t watchdog;
    bool watching;
} Comm;

static void comm_die(const Comm* c, const char* what) {
    fprintf(stderr, "%s: %s\n", program_name, what);  // with several ranks, program_name names this one (read_launch_env)
    if (c->nccl) ncclCommAbort(c->nccl);
    _exit(1);
}

static void comm_call(Comm* c, ncclResult_t r, const char* what) {
    char err[512], line[768];
    if (r != ncclSuccess && r != ncclInProgress) {
        snprintf(line, sizeof(line), "%s: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(c->nccl));
        comm_die(c, line);
    }
    if (r == ncclInProgress && comm_nccl_wait(c->nccl, now_seconds() + c->timeout_s, c->timeout_s, err, sizeof(err))) {
        snprintf(line, sizeof(line), "%s: %s", what, err);
        comm_die(c, line);
    }
}

// Joins the run described by env: sets this process's GPU, meets the other ranks and builds the
// communicator (failing within timeout_s when a rank does not come), and makes the stream. A run
// of one rank needs no NCCL: its collectives are copies (so the ZeRO modes also run on one GPU).
static int comm_open(Comm* c, const CommEnv* env, double timeout_s, char* err, size_t err_len) {
    memset(c, 0, sizeof(*c));
    c->env = *env;
    c->rank = env->rank;
    c->world = env->world;
    c->timeout_s = timeout_s;
    if (c->world > 1 && comm_nccl_init(&c->nccl, env, timeout_s, err, err_len)) return -1;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->to_comm, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->from_comm, cudaEventDisableTiming));
    return 0;
}

static void comm_follow(Comm* c, cudaStream_t compute) {  // comm stream waits for compute's work so far
    CUDA_CHECK(cudaEventRecord(c->to_comm, compute));
    CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->to_comm, 0));
}

static void comm_join(Comm* c, cudaStream_t compute) {  // compute waits for the collectives so far
    CUDA_CHECK(cudaEventRecord(c->from_comm, c->stream));
    CUDA_CHECK(cudaStreamWaitEvent(compute, c->from_comm, 0));
}

// Sums (ncclSum) or maxima (ncclMax: FP8's amaxes, so that every rank derives the same scales; a
// max is exact and does not depend on the order) of fp32 across ranks, in place over n elements.
static void comm_all_reduce(Comm* c, float* x, size_t n, ncclRedOp_t op) {
    if (c->world == 1) return;
    const char* what = op == ncclMax ? "all-reduce (max)" : "all-reduce";
    comm_call(c, ncclAllReduce(x, x, n, ncclFloat, op, c->nccl, c->stream), what);
}

// The largest of every rank's x, on the host: for a choice every rank must make alike, once, at
// start (through the GPU, as NCCL's collectives are; a float holds these small ints exactly).
static int comm_max_int(Comm* c, int x) {
    if (c->world == 1) return x;
    float value = (float)x, *device;
    CUDA_CHECK(cudaMalloc(&device, sizeof(float)));
    CUDA_CHECK(cudaMemcpy(device, &value, sizeof(float), cudaMemcpyHostToDevice));
    comm_all_reduce(c, device, 1, ncclMax);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaMemcpy(&value, device, sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(device));
    return (int)value;
}

static void comm_copy(Comm* c, void* dst, const void* src, size_t bytes) {  // a collective of one rank
    if (dst != src) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
}

// Rank r receives the sum over ranks of send[r * piece, (r + 1) * piece).
static void comm_reduce_scatter(Comm* c, const float* send, float* recv, size_t piece) {
    if (c->world == 1) return comm_copy(c, recv, send, piece * sizeof(float));
    comm_call(c, ncclReduceScatter(send, recv, piece, ncclFloat, ncclSum, c->nccl, c->stream), "reduce-scatter");
}

// Every rank receives recv[r * piece, (r + 1) * piece) = rank r's send, for bf16 (2 bytes) or
// fp32 (4 bytes) elements.
static void comm_all_gather(Comm* c, const void* send, void* recv, size_t piece, size_t element_bytes) {
    if (c->world == 1) return comm_copy(c, recv, send, piece * element_bytes);
    ncclDataType_t type = element_bytes == 2 ? ncclBfloat16 : ncclFloat;
    comm_call(c, ncclAllGather(send, recv, piece, type, c->nccl, c->stream), "all-gather");
}

// A rank that dies mid-step leaves the others waiting in a collective that never completes. The
// watchdog thread turns that into one line and an exit: it stops the run when NCCL reports an
// error, or when no step has finished for timeout_s seconds (the trainer sets last_progress).
static void* comm_watchdog_main(void* arg) {
    Comm* c = (Comm*)arg;
    char line[512];
    for (;;) {
        sleep_seconds(1.0);
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(c->nccl, &state);
        if (state != ncclSuccess && state != ncclInProgress) {
            snprintf(line, sizeof(line), "NCCL reports '%s' (%s): a peer has failed; stopping",
                     ncclGetErrorString(state), ncclGetLastError(c->nccl));
            comm_die(c, line);
        }
        if (now_seconds() - c->last_progress > c->timeout_s) {
            snprintf(line, sizeof(line), "no training step finished in %.0f s: another rank has stopped or hangs; "
                     "stopping (resume with --resume latest)", c->timeout_s);
            comm_die(c, line);
        }
    }
    return NULL;
}

static void comm_watchdog_start(Comm* c) {
    c->last_progress = now_seconds();
    if (pthread_create(&c->watchdog, NULL, comm_watchdog_main, c) != 0) comm_die(c, "cannot start the watchdog");
    pthread_detach(c->watchdog);
    c->watching = true;
}

static void comm_close(Comm* c) {
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (c->nccl) ncclCommDestroy(c->nccl);
    c->nccl = NULL;
    CUDA_CHECK(cudaEventDestroy(c->to_comm));
    CUDA_CHECK(cudaEventDestroy(c->from_comm));
    CUDA_CHECK(cudaStreamDestroy(c->stream));
}

// ----------------------------------------------------------------------------------------------
// One machine without a launcher: `train_gpt --gpus N` starts N copies of itself

// Sets the environment torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, MASTER_PORT), starts the n ranks with the same arguments, and waits.
// When a rank fails, the others get SIGTERM (their watchdogs would stop them anyway). Returns the
// exit status to leave with: 0 when every rank succeeded, else the first failure's.
static int comm_launch_local(int n, char** argv, char* err, size_t err_len) {
    int probe = comm_listen(0, err, err_len);  // a free port for the bootstrap, which uses MASTER_PORT + 1
    if (probe < 0) return -1;
    struct sockaddr_storage addr;
    socklen_t len = sizeof(addr);
    getsockname(probe, (struct sockaddr*)&addr, &len);
    int port = ntohs(addr.ss_family == AF_INET6 ? ((struct sockaddr_in6*)&addr)->sin6_port
                                                : ((struct sockaddr_in*)&addr)->sin_port);
    close(probe);
    pid_t* pids = (pid_t*)xcalloc(n, sizeof(pid_t));
    char text[16];
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] < 0) return fail_errno(err, err_len, errno, "fork");
        if (pids[r] > 0) continue;
        const char* names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"};
        int values[] = {r, r, n, n, port - 1};
        for (int i = 0; i < 5; i++) {
            snprintf(text, sizeof(text), "%d", values[i]);
            setenv(names[i], text, 1);
        }
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    int status = 0, first_failure = 0;
    for (int done = 0; done < n; done++) {
        int st;
        pid_t pid = wait(&st);
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (code != 0 && !first_failure) {
            int rank = 0;
            while (rank < n && pids[rank] != pid) rank++;
            if (WIFSIGNALED(st))
                fprintf(stderr, "train_gpt: rank %d was killed by signal %d; stopping the other ranks\n", rank,
                        WTERMSIG(st));
            else
                fprintf(stderr, "train_gpt: rank %d exited with status %d; stopping the other ranks\n", rank, code);
            first_failure = 1;
            status = code;
            for (int r = 0; r < n; r++)
                if (pids[r] != pid) kill(pids[r], SIGTERM);
        }
    }
    free(pids);
    return status;
}

#endif
