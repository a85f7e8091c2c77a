/*
 * tools/prepro.c - turns text into the token shards that train_gpt reads (data.h's format), and shows
 * how the GPT-2 tokenizer cuts a text.
 *
 *   prepro [options] INPUT...        text files, directories of them, or JSONL files -> shards
 *   prepro --encode FILE             the ids of FILE's whole content (one document, no EOT)
 *   prepro --decode                  ids on standard input -> their text on standard output
 *   prepro --info SHARD...           check shards and print their token counts
 *
 * A document is a whole text file, or one line of a .jsonl file (its "text" field). Documents are
 * read in the order given, a directory's files in sorted path order (recursively, hidden ones
 * skipped), so the output is the same bytes on every run. Each document is tokenized with the
 * end-of-text token in front of it; every Nth document (--val-every) goes to the val split, the
 * others to train: the split holds out whole documents. `make data` runs this on the default corpus
 * (scripts/prepare_data.sh). The shards are written into a directory beside OUT and appear in OUT
 * only when every one of them is complete: a failure, Ctrl-C or SIGTERM part-way leaves no shard
 * where the user asked for them.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <limits.h>
#include <signal.h>
#include <time.h>

#include "../data.h"
#include "../lib/tokenizer.h"

#define DEFAULT_TOKENIZER_DIR "data/tokenizer"
#define DEFAULT_VAL_EVERY 10
#define DEFAULT_SHARD_TOKENS 100000000

static void usage(FILE* f) {
    fprintf(f,
        "usage: prepro [options] INPUT...    make shards from text\n"
        "       prepro --encode FILE          print the token ids of FILE (- for stdin) as one document\n"
        "       prepro --decode               read token ids on stdin, write their text to stdout\n"
        "       prepro --info SHARD...        check shards, print their token counts\n"
        "\n"
        "INPUT is a text file (one document), a directory (each file in it, recursively, one document;\n"
        "*.jsonl files in it as below) or a .jsonl file (one document per line: its \"text\" field).\n"
        "Shards go to OUT/train_000000.bin ... and OUT/val_000000.bin ...\n"
        "\n"
        "options:\n"
        "  -o, --out DIR          output directory (required for making shards; must hold no shards yet)\n"
        "  --tokenizer DIR        holds encoder.json and vocab.bpe (default %s; `make data` fetches them)\n"
        "  --val-every N          every Nth document goes to val (default %d; 0: no val split)\n"
        "  --shard-tokens N       tokens per shard (default %d)\n"
        "  -h, --help             this text\n",
        DEFAULT_TOKENIZER_DIR, DEFAULT_VAL_EVERY, DEFAULT_SHARD_TOKENS);
}

static int ends_with(const char* s, const char* suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

// ----------------------------------------------------------------------------------------------
// Making shards

typedef struct {
    Tokenizer tk;
    int val_every;
    ShardWriter split[2];      // train, val
    uint64_t docs[2];
    uint64_t text_bytes;
    double encode_seconds;
    TokenList ids;
} Prepro;

enum { TRAIN = 0, VAL = 1 };

// ----------------------------------------------------------------------------------------------
// The staging directory: OUT.partial-XXXXXX beside OUT (so on the same file system, for rename),
// removed by an exit before the end (die's, or an interrupt's) through atexit.

static char g_staging[4096 + 32];  // while it exists
static const char* g_out;          // where the shards go in the end
static ShardWriter* g_writers;     // the shards in it: train's and val's
static volatile sig_atomic_t g_signal;

static void on_signal(int sig) { g_signal = sig; }

static void staging_remove(void) {
    if (!g_staging[0]) return;
    char path[8192];
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < g_writers[s].n_shards; i++) {
            shard_path(g_staging, g_writers[s].name, i, path, sizeof(path));
            unlink(path);
        }
    rmdir(g_staging);
    g_staging[0] = '\0';
}

static void staging_create(const char* out, ShardWriter* writers) {
    g_out = out;
    snprintf(g_staging, sizeof(g_staging), "%s.partial-XXXXXX", out);
    if (!mkdtemp(g_staging)) {
        int e = errno;
        g_staging[0] = '\0';
        die("%s: cannot create a directory beside it to write the shards in: %s", out, strerror(e));
    }
    g_writers = writers;
    atexit(staging_remove);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

// Between documents: an interrupt removes what was written and ends the process by its signal.
static void stop_if_interrupted(void) {
    if (!g_signal) return;
    int sig = g_signal;
    staging_remove();
    fprintf(stderr, "prepro: interrupted (signal %d); no shards were written to %s\n", sig, g_out);
    sigset_t only;
    sigemptyset(&only);
    sigaddset(&only, sig);
    signal(sig, SIG_DFL);
    sigprocmask(SIG_UNBLOCK, &only, NULL);
    raise(sig);
}

// Moves the first n shards (train's, then val's) from one directory to another. Returns the
// index of the one that could not be moved (errno says why), or -1.
static int shards_move(const char* from_dir, const char* to_dir, int n) {
    char from[8192], to[8192];
    int k = 0;
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < g_writers[s].n_shards && k < n; i++, k++) {
            shard_path(from_dir, g_writers[s].name, i, from, sizeof(from));
            shard_path(to_dir, g_writers[s].name, i, to, sizeof(to));
            if (rename(from, to) != 0) return k;
        }
    return -1;
}

// Moves the finished shards into out: the whole directory in one rename when out does not exist
// (or is empty), else shard by shard with the signals held off, so that out ends with all of them
// or, if a rename fails, none.
static void staging_publish(const char* out) {
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGHUP);
    sigprocmask(SIG_BLOCK, &block, &old);
    stop_if_interrupted();
    if (rename(g_staging, out) != 0) {
        int failed = shards_move(g_staging, out, INT_MAX);
        if (failed >= 0) {
            int e = errno;
            shards_move(out, g_staging, failed);
            die("%s: cannot move the shards into it: %s", out, strerror(e));
        }
        rmdir(g_staging);
    }
    g_staging[0] = '\0';
    sigprocmask(SIG_SETMASK, &old, NULL);
}

static void add_document(Prepro* p, const char* text, size_t len) {
    stop_if_interrupted();
    uint64_t index = p->docs[TRAIN] + p->docs[VAL];
    int split = (p->val_every > 0 && index % (uint64_t)p->val_every == (uint64_t)p->val_every - 1) ? VAL : TRAIN;
    p->ids.len = 0;
    token_list_push(&p->ids, p->tk.eot);
    double t0 = now_seconds();
    tokenizer_encode(&p->tk, text, len, &p->ids);
    p->encode_seconds += now_seconds() - t0;
    char err[4096 + 256];
    if (shard_writer_add(&p->split[split], p->ids.data, p->ids.len, err, sizeof(err)) < 0) die("%s", err);
    p->docs[split]++;
    p->text_bytes += len;
}

// Skips the JSON value at s; returns the position after it, or NULL if it is malformed.
static const char* json_skip_value(const char* s, const char* end, int depth) {
    s = json_skip_space(s, end);
    if (s >= end || depth > 64) return NULL;
    if (*s == '"') return json_string_end(s, end);
    if (*s == '{' || *s == '[') {
        char close = *s == '{' ? '}' : ']';
        s = json_skip_space(s + 1, end);
        if (s < end && *s == close) return s + 1;
        for (;;) {
            if (close == '}') {
                s = json_skip_value(s, end, depth + 1);  // the key
                if (!s || (s = json_skip_space(s, end)) >= end || *s != ':') return NULL;
                s++;
            }
            s = json_skip_value(s, end, depth + 1);
            if (!s || (s = json_skip_space(s, end)) >= end) return NULL;
            if (*s == close) return s + 1;
            if (*s != ',') return NULL;
            s++;
        }
    }
    const char* start = s;  // a number, true, false or null
    while (s < end && (*s == '-' || *s == '+' || *s == '.' || (*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'z') ||
                       (*s >= 'A' && *s <= 'Z')))
        s++;
    return s > start ? s : NULL;
}

// The "text" string of one JSONL line, into text. Returns 0, or -1 with err.
static int jsonl_text(const char* line, size_t len, ByteBuf* text, char* err, size_t err_len) {
    const char *s = json_skip_space(line, line + len), *end = line + len;
    if (s >= end || *s != '{') return fail(err, err_len, "expected a JSON object");
    s = json_skip_space(s + 1, end);
    ByteBuf key = {NULL, 0, 0};
    int found = 0, rc = 0;
    char why[128];
    while (rc == 0 && s < end && *s != '}') {
        key.len = 0;
        if (json_read_string(&s, end, &key, why, sizeof(why)) < 0) { rc = fail(err, err_len, "key: %s", why); break; }
        s = json_skip_space(s, end);
        if (s >= end || *s != ':') { rc = fail(err, err_len, "expected ':' after a key"); break; }
        s = json_skip_space(s + 1, end);
        if (key.len == 4 && memcmp(key.data, "text", 4) == 0 && !found) {
            if (s >= end || *s != '"') { rc = fail(err, err_len, "\"text\" is not a string"); break; }
            text->len = 0;
            if (json_read_string(&s, end, text, why, sizeof(why)) < 0) { rc = fail(err, err_len, "\"text\": %s", why); break; }
            found = 1;
        } else if (!(s = json_skip_value(s, end, 0))) {
            rc = fail(err, err_len, "malformed value");
            break;
        }
        s = json_skip_space(s, end);
        if (s < end && *s == ',') s = json_skip_space(s + 1, end);
        else if (s >= end || *s != '}') rc = fail(err, err_len, "expected ',' or '}'");
    }
    free(key.data);
    if (rc == 0 && s >= end) rc = fail(err, err_len, "unterminated object");
    if (rc == 0 && json_skip_space(s + 1, end) != end) rc = fail(err, err_len, "characters after the object");
    if (rc == 0 && !found) rc = fail(err, err_len, "no \"text\" field");
    return rc;
}

static void add_jsonl(Prepro* p, const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) die("%s: cannot open: %s", path, strerror(errno));
    char* line = NULL;
    size_t cap = 0;
    ssize_t n;
    ByteBuf text = {NULL, 0, 0};
    char err[256];
    long docs = 0;
    for (long lineno = 1; (n = getline(&line, &cap, f)) >= 0; lineno++) {
        const char* s = json_skip_space(line, line + n);
        if (s == line + n) continue;  // blank line
        if (jsonl_text(line, (size_t)n, &text, err, sizeof(err)) < 0)
            die("%s:%ld: %s (each line must be a JSON object with a \"text\" string)", path, lineno, err);
        add_document(p, text.data, text.len);
        docs++;
    }
    if (ferror(f)) die("%s: read error", path);
    if (docs == 0) die("%s: no documents: the file is empty or every line is blank", path);
    fclose(f);
    free(line);
    free(text.data);
}

static void add_text_file(Prepro* p, const char* path) {
    size_t len;
    char err[4096 + 128];
    char* text;
    if (read_whole_file(path, SIZE_MAX, &text, &len, err, sizeof(err)) < 0) die("%s", err);
    if (len == 0) die("%s: empty file: no text to tokenize", path);
    const char* nul = (const char*)memchr(text, '\0', len);
    if (nul) die("%s: not a text file: byte %zu is NUL (a binary file?)", path, (size_t)(nul - text));
    add_document(p, text, len);
    free(text);
}

typedef struct { char** paths; size_t n, cap; } PathList;

static int compare_paths(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

// Every regular file under dir, recursively, skipping names that start with '.'.
static void list_files(const char* dir, PathList* out) {
    DIR* d = opendir(dir);
    if (!d) die("%s: cannot open directory: %s", dir, strerror(errno));
    struct dirent* e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        size_t n = strlen(dir) + strlen(e->d_name) + 2;
        char* path = (char*)xcalloc(n, 1);
        snprintf(path, n, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0) die("%s: cannot stat: %s", path, strerror(errno));
        if (S_ISDIR(st.st_mode)) {
            list_files(path, out);
            free(path);
        } else if (S_ISREG(st.st_mode)) {
            if (out->n == out->cap) {
                out->cap = out->cap ? 2 * out->cap : 256;
                out->paths = (char**)xrealloc(out->paths, out->cap * sizeof(char*));
            }
            out->paths[out->n++] = path;
        } else {
            free(path);
        }
    }
    closedir(d);
}

static void add_input(Prepro* p, const char* path) {
    struct stat st;
    if (stat(path, &st) != 0) die("%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        PathList files = {NULL, 0, 0};
        list_files(path, &files);
        qsort(files.paths, files.n, sizeof(char*), compare_paths);
        if (files.n == 0) die("%s: no files in this directory", path);
        for (size_t i = 0; i < files.n; i++) {
            if (ends_with(files.paths[i], ".jsonl")) add_jsonl(p, files.paths[i]);
            else add_text_file(p, files.paths[i]);
            free(files.paths[i]);
        }
        free(files.paths);
    } else if (ends_with(path, ".jsonl")) {
        add_jsonl(p, path);
    } else {
        add_text_file(p, path);
    }
}

static void make_shards(const char* out, const char* tokenizer_dir, int val_every, long shard_tokens,
                        char** inputs, int n_inputs) {
    Prepro p;
    memset(&p, 0, sizeof(p));
    char err[8192];
    if (tokenizer_load(&p.tk, tokenizer_dir, err, sizeof(err)) < 0) die("%s", err);
    if (p.tk.eot < 0) die("tokenizer %s has no %s token to separate documents", tokenizer_dir, EOT_TEXT);
    for (int i = 0; i < n_inputs; i++) {  // before anything is made
        struct stat st;
        if (stat(inputs[i], &st) != 0) die("%s: %s", inputs[i], strerror(errno));
    }
    struct stat st;
    if (stat(out, &st) == 0 && !S_ISDIR(st.st_mode)) die("%s: exists and is not a directory", out);
    const char* names[2] = {"train", "val"};
    for (int s = 0; s < 2; s++) {
        char first[8192];
        shard_path(out, names[s], 0, first, sizeof(first));
        if (stat(first, &st) == 0)
            die("%s already exists: remove the old shards first (rm %s/%s_*.bin), or choose another --out",
                first, out, names[s]);
    }
    staging_create(out, p.split);
    for (int s = 0; s < 2; s++) shard_writer_init(&p.split[s], g_staging, names[s], (size_t)shard_tokens);
    p.val_every = val_every;
    double t0 = now_seconds();
    for (int i = 0; i < n_inputs; i++) add_input(&p, inputs[i]);
    for (int s = 0; s < 2; s++)
        if (shard_writer_finish(&p.split[s], err, sizeof(err)) < 0) die("%s", err);
    staging_publish(out);
    double seconds = now_seconds() - t0;
    uint64_t docs = p.docs[TRAIN] + p.docs[VAL];
    printf("prepro: %llu document%s, %.1f MB of text, tokenized at %.1f MB/s; %.1f s in all\n",
           (unsigned long long)docs, docs == 1 ? "" : "s", (double)p.text_bytes / 1e6,
           (double)p.text_bytes / 1e6 / (p.encode_seconds > 0 ? p.encode_seconds : 1e-9), seconds);
    for (int s = 0; s < 2; s++) {
        printf("  %-5s %8llu documents %12llu tokens  %d shard%s in %s/%s_*.bin\n", names[s],
               (unsigned long long)p.docs[s], (unsigned long long)p.split[s].n_tokens, p.split[s].n_shards,
               p.split[s].n_shards == 1 ? " " : "s", out, names[s]);
    }
    if (val_every > 0 && p.docs[VAL] == 0)
        printf("  no val split: only %llu document%s and every %dth goes to val; give more documents (files or "
               "JSONL lines) or a smaller --val-every\n", (unsigned long long)docs, docs == 1 ? "" : "s", val_every);
    tokenizer_free(&p.tk);
    free(p.ids.data);
}

// ----------------------------------------------------------------------------------------------
// Looking at tokens

static void encode_file(const char* path, const char* tokenizer_dir) {
    Tokenizer tk;
    char err[8192];
    if (tokenizer_load(&tk, tokenizer_dir, err, sizeof(err)) < 0) die("%s", err);
    ByteBuf text = {NULL, 0, 0};
    if (strcmp(path, "-") == 0) {
        char chunk[1 << 16];
        size_t got;
        while ((got = fread(chunk, 1, sizeof(chunk), stdin)) > 0) byte_buf_append(&text, chunk, got);
        if (ferror(stdin)) die("standard input: read error");
    } else {
        if (read_whole_file(path, SIZE_MAX, &text.data, &text.len, err, sizeof(err)) < 0) die("%s", err);
    }
    TokenList ids = {NULL, 0, 0};
    tokenizer_encode(&tk, text.data, text.len, &ids);
    for (size_t i = 0; i < ids.len; i++) printf(i ? " %d" : "%d", ids.data[i]);
    printf("\n");
    free(ids.data);
    free(text.data);
    tokenizer_free(&tk);
}

// Ids may be separated by white space, commas or brackets, so a Python list pastes in as it is.
static void decode_stdin(const char* tokenizer_dir) {
    Tokenizer tk;
    char err[8192];
    if (tokenizer_load(&tk, tokenizer_dir, err, sizeof(err)) < 0) die("%s", err);
    ByteBuf in = {NULL, 0, 0}, out = {NULL, 0, 0};
    char chunk[1 << 16];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), stdin)) > 0) byte_buf_append(&in, chunk, got);
    if (ferror(stdin)) die("standard input: read error");
    const char* s = byte_buf_cstr(&in);
    for (size_t count = 0;; count++) {
        while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == ',' || *s == '[' || *s == ']') s++;
        if (!*s) break;
        const char* start = s;
        long id = 0;
        while (*s >= '0' && *s <= '9' && id < 1000000000) id = id * 10 + (*s++ - '0');
        if (s == start || !(*s == '\0' || *s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == ',' || *s == ']')) {
            size_t len = strcspn(start, " \t\r\n,[]");
            die("--decode: value %zu of the input, '%.*s', is not a token id", count + 1, (int)(len < 40 ? len : 40), start);
        }
        int one = (int)id;
        if (tokenizer_decode(&tk, &one, 1, &out, err, sizeof(err)) < 0)
            die("--decode: value %zu of the input, token id %ld, is not in the vocabulary (0..%d)", count + 1, id,
                tk.vocab_size - 1);
    }
    if (out.len && fwrite(out.data, 1, out.len, stdout) != out.len) die("standard output: write error");
    free(in.data);
    free(out.data);
    tokenizer_free(&tk);
}

static int shard_info(char** args, int n) {
    uint64_t total = 0;
    int bad = 0, count = 0;
    for (int i = 0; i < n; i++) {
        glob_t g;
        if (glob(args[i], GLOB_NOCHECK, NULL, &g) != 0) die("%s: cannot expand", args[i]);
        for (size_t k = 0; k < g.gl_pathc; k++) {
            char err[8192];
            int64_t tokens = shard_probe(g.gl_pathv[k], err, sizeof(err));
            if (tokens < 0) {
                fprintf(stderr, "prepro: %s\n", err);
                bad = 1;
            } else {
                printf("%12lld tokens  %s\n", (long long)tokens, g.gl_pathv[k]);
                total += (uint64_t)tokens;
                count++;
            }
        }
        globfree(&g);
    }
    printf("%12llu tokens in %d shard%s\n", (unsigned long long)total, count, count == 1 ? "" : "s");
    return bad;
}

static long parse_count(const char* flag, const char* value, long min, long max) {
    char* end;
    errno = 0;
    long v = value ? strtol(value, &end, 10) : 0;
    if (!value || *end || errno || v < min || v > max)
        usage_error("%s needs a whole number from %ld to %ld (got '%s')", flag, min, max, value ? value : "");
    return v;
}

#ifndef PREPRO_NO_MAIN  // test/fuzz/fuzz_jsonl.c includes this file for jsonl_text
int main(int argc, char** argv) {
    program_name = "prepro";
    const char *out = NULL, *tokenizer_dir = DEFAULT_TOKENIZER_DIR, *encode = NULL;
    int val_every = DEFAULT_VAL_EVERY, decode = 0, info = 0;
    long shard_tokens = DEFAULT_SHARD_TOKENS;
    char** inputs = (char**)xcalloc((size_t)argc, sizeof(char*));
    int n_inputs = 0;
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        const char* value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        else if (!strcmp(a, "-o") || !strcmp(a, "--out")) { if (!value) usage_error("%s needs a directory", a); out = value; i++; }
        else if (!strcmp(a, "--tokenizer")) { if (!value) usage_error("%s needs a directory", a); tokenizer_dir = value; i++; }
        else if (!strcmp(a, "--val-every")) { val_every = (int)parse_count(a, value, 0, INT_MAX); i++; }
        else if (!strcmp(a, "--shard-tokens")) { shard_tokens = parse_count(a, value, 1, SHARD_MAX_TOKENS); i++; }
        else if (!strcmp(a, "--encode")) { if (!value) usage_error("%s needs a file", a); encode = value; i++; }
        else if (!strcmp(a, "--decode")) decode = 1;
        else if (!strcmp(a, "--info")) info = 1;
        else if (a[0] == '-' && a[1]) usage_error("unknown option %s (see prepro --help)", a);
        else inputs[n_inputs++] = argv[i];
    }
    int rc = 0;
    if (encode) encode_file(encode, tokenizer_dir);
    else if (decode) decode_stdin(tokenizer_dir);
    else if (info) {
        if (n_inputs == 0) usage_error("--info needs shard files (e.g. 'data/default/*.bin')");
        rc = shard_info(inputs, n_inputs);
    } else {
        if (n_inputs == 0) { usage(stderr); return 2; }
        if (!out) usage_error("where should the shards go? pass --out DIR");
        char* trimmed = (char*)out;  // argv's own: "dir/" stages beside dir, not inside it
        for (size_t n = strlen(trimmed); n > 1 && trimmed[n - 1] == '/'; n--) trimmed[n - 1] = '\0';
        make_shards(out, tokenizer_dir, val_every, shard_tokens, inputs, n_inputs);
    }
    free(inputs);
    return rc;
}
#endif
