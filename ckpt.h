/*
 * ckpt.h - the on-disk layer of checkpoints and export: safetensors files, a small JSON writer
 * and reader, CRC32C, and the atomic protocol that writes checkpoint directories.
 *
 * train_gpt.cu decides what goes into a checkpoint (which tensors, their Hugging Face names, the
 * asynchronous snapshot, the resume logic); this header only puts bytes on disk and gets them back,
 * verified. It is plain C/POSIX compiled as C++17 (nvcc or g++), needs no CUDA, keeps no global
 * state beyond the CRC tables, and can run on a writer thread while training goes on.
 *
 * The one convention a reader must know is lib/util.h's: every function that can fail returns 0 on
 * success and -1 on failure, having written one line into the caller's `err` buffer that names the
 * file and the problem (`out/ckpt_50/model.safetensors: CRC32C 1a2b3c4d, but the manifest says
 * 5e6f7a8b: the file is corrupted`). Nothing in here prints, exits or aborts, not even when memory
 * runs out (that comes back as an error too: the writer thread must not take training down); a
 * failed write leaves the previous checkpoint intact.
 *
 * Sections: CRC32C; JSON writer; JSON reader; atomic files; safetensors; checkpoint directories
 * (with several writers: one per rank of a data-parallel run).
 * doc/checkpoints.md describes the directory layout, the manifest and why each fsync is there.
 */
#ifndef CKPT_H
#define CKPT_H

#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <inttypes.h>
#include <pthread.h>
#include <fcntl.h>
#include <unistd.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/types.h>

#include "lib/util.h"

/* Tensors are written in host byte order and safetensors is little-endian by definition. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ckpt.h writes tensors in host byte order, but safetensors files are little-endian"
#endif

#define CK_PATH_MAX 4096

/* ----------------------------------------------------------------------------------------------
 * CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every checkpoint file.
 * On x86-64 with SSE4.2 the crc32 instruction does 8 bytes per instruction; elsewhere a
 * slicing-by-8 table does 8 bytes per 8 table look-ups. Both give the same value (tested).
 * crc32c(crc, data, n) continues a running CRC: start with 0, and crc32c(crc32c(0, a), b) equals
 * the CRC of a followed by b. The pre- and post-inversion of the standard are done inside.
 */

#if defined(__x86_64__) && defined(__GNUC__)
#define CK_CRC_X86 1
#else
#define CK_CRC_X86 0
#endif

static uint32_t ck_crc_table[8][256];
static int ck_crc_hw_ok;
static pthread_once_t ck_crc_once = PTHREAD_ONCE_INIT;

static void ck_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        ck_crc_table[0][i] = c;
    }
    /* table[t][i]: the CRC register after byte i is followed by t zero bytes */
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            ck_crc_table[t][i] = (ck_crc_table[t - 1][i] >> 8) ^
                                 ck_crc_table[0][ck_crc_table[t - 1][i] & 0xFF];
#if CK_CRC_X86
    __builtin_cpu_init();
    ck_crc_hw_ok = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

/* Both kernels work on the raw (already inverted) register. */
static uint32_t ck_crc32c_sw(uint32_t crc, const uint8_t* p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ ck_crc_table[0][(crc ^ *p++) & 0xFF]; n--; }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;  /* the first byte of the stream is the lowest: it has 7 bytes still to pass */
        crc = ck_crc_table[7][w & 0xFF] ^ ck_crc_table[6][(w >> 8) & 0xFF] ^
              ck_crc_table[5][(w >> 16) & 0xFF] ^ ck_crc_table[4][(w >> 24) & 0xFF] ^
              ck_crc_table[3][(w >> 32) & 0xFF] ^ ck_crc_table[2][(w >> 40) & 0xFF] ^
              ck_crc_table[1][(w >> 48) & 0xFF] ^ ck_crc_table[0][w >> 56];
    }
    while (n--) crc = (crc >> 8) ^ ck_crc_table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if CK_CRC_X86
/* Inline assembly rather than the _mm_crc32 intrinsics: it needs no -msse4.2 for the whole
 * translation unit, so one binary runs everywhere and picks this path at run time. */
static uint32_t ck_crc32c_hw(uint32_t crc, const uint8_t* p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { __asm__("crc32b %1, %0" : "+r"(crc) : "rm"(*p)); p++; n--; }
    uint64_t c = crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        __asm__("crc32q %1, %0" : "+r"(c) : "rm"(w));
    }
    crc = (uint32_t)c;
    while (n--) { __asm__("crc32b %1, %0" : "+r"(crc) : "rm"(*p)); p++; }
    return crc;
}
#endif

/* Whether crc32c uses the crc32 instruction on this machine. */
static int crc32c_have_hw(void) {
    pthread_once(&ck_crc_once, ck_crc_init);
    return ck_crc_hw_ok;
}

/* crc32c with the implementation chosen by the caller (the tests compare both); use_hw is
 * ignored where there is no instruction. */
static uint32_t crc32c_with(int use_hw, uint32_t crc, const void* data, size_t n) {
    pthread_once(&ck_crc_once, ck_crc_init);
    const uint8_t* p = (const uint8_t*)data;
    crc = ~crc;
#if CK_CRC_X86
    if (use_hw && ck_crc_hw_ok) return ~ck_crc32c_hw(crc, p, n);
#else
    (void)use_hw;
#endif
    return ~ck_crc32c_sw(crc, p, n);
}

static uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
    return crc32c_with(1, crc, data, n);
}

/* ----------------------------------------------------------------------------------------------
 * JSON writer: builds a document into a growing buffer, placing commas itself. Objects may be
 * pretty-printed (one member a line, two-space indent); arrays always stay on one line, so a shape
 * reads [768, 2048]. Doubles are written in the shortest form that reads back to the same double,
 * always with a '.' or an exponent so that Python reads them back as floats (10000.0, 1e-06);
 * non-finite values as NaN / Infinity / -Infinity, as Python's json module writes and reads them.
 * An allocation failure or unbalanced nesting makes jw_text return NULL instead of a document.
 */

#define CK_JSON_MAX_DEPTH 64

typedef struct {
    char* buf;
    size_t len, cap;
    int pretty;
    int depth;
    int failed;     /* allocation failure or misuse: jw_text returns NULL */
    int after_key;  /* the next value completes a "key": pair */
    unsigned char has_items[CK_JSON_MAX_DEPTH];
} JsonWriter;

static void jw_init(JsonWriter* w, int pretty) {
    memset(w, 0, sizeof *w);
    w->pretty = pretty;
}

static void jw_free(JsonWriter* w) {
    free(w->buf);
    memset(w, 0, sizeof *w);
}

static void jw_putn(JsonWriter* w, const char* s, size_t n) {
    if (w->failed) return;
    if (w->len + n + 1 > w->cap) {
        size_t cap = w->cap ? w->cap : 256;
        while (cap < w->len + n + 1) cap *= 2;
        char* buf = (char*)realloc(w->buf, cap);
        if (!buf) { w->failed = 1; return; }
        w->buf = buf;
        w->cap = cap;
    }
    memcpy(w->buf + w->len, s, n);
    w->len += n;
    w->buf[w->len] = '\0';
}

static void jw_puts(JsonWriter* w, const char* s) { jw_putn(w, s, strlen(s)); }

static void jw_newline(JsonWriter* w, int depth) {
    jw_puts(w, "\n");
    for (int i = 0; i < depth; i++) jw_puts(w, "  ");
}

/* What goes before a value: nothing after a key, else a comma between array items. */
static void jw_before_value(JsonWriter* w) {
    if (w->after_key) { w->after_key = 0; return; }
    if (w->depth == 0) return;
    if (w->has_items[w->depth - 1]) jw_puts(w, w->pretty ? ", " : ",");
    w->has_items[w->depth - 1] = 1;
}

static void jw_escaped(JsonWriter* w, const char* s) {
    jw_puts(w, "\"");
    for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
        char esc[8];
        switch (*p) {
        case '"': jw_puts(w, "\\\""); break;
        case '\\': jw_puts(w, "\\\\"); break;
        case '\n': jw_puts(w, "\\n"); break;
        case '\r': jw_puts(w, "\\r"); break;
        case '\t': jw_puts(w, "\\t"); break;
        case '\b': jw_puts(w, "\\b"); break;
        case '\f': jw_puts(w, "\\f"); break;
        default:
            if (*p < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", *p);
                jw_puts(w, esc);
            } else {
                jw_putn(w, (const char*)p, 1);  /* UTF-8 passes through unchanged */
            }
        }
    }
    jw_puts(w, "\"");
}

static void jw_open(JsonWriter* w, const char* bracket) {
    jw_before_value(w);
    if (w->depth == CK_JSON_MAX_DEPTH) { w->failed = 1; return; }
    jw_puts(w, bracket);
    w->has_items[w->depth++] = 0;
}

static void jw_close(JsonWriter* w, const char* bracket, int newline) {
    if (w->depth == 0 || w->after_key) { w->failed = 1; return; }
    w->depth--;
    if (newline && w->pretty && w->has_items[w->depth]) jw_newline(w, w->depth);
    jw_puts(w, bracket);
}

static void jw_object_begin(JsonWriter* w) { jw_open(w, "{"); }
static void jw_object_end(JsonWriter* w) { jw_close(w, "}", 1); }
static void jw_array_begin(JsonWriter* w) { jw_open(w, "["); }
static void jw_array_end(JsonWriter* w) { jw_close(w, "]", 0); }

static void jw_key(JsonWriter* w, const char* key) {
    if (w->depth == 0 || w->after_key) { w->failed = 1; return; }
    if (w->has_items[w->depth - 1]) jw_puts(w, ",");
    w->has_items[w->depth - 1] = 1;
    if (w->pretty) jw_newline(w, w->depth);
    jw_escaped(w, key);
    jw_puts(w, w->pretty ? ": " : ":");
    w->after_key = 1;
}

static void jw_string(JsonWriter* w, const char* s) { jw_before_value(w); jw_escaped(w, s); }
static void jw_bool(JsonWriter* w, int b) { jw_before_value(w); jw_puts(w, b ? "true" : "false"); }
static void jw_null(JsonWriter* w) { jw_before_value(w); jw_puts(w, "null"); }

/* A ready-made JSON value (e.g. a config object the caller wrote), inserted as it is. */
static void jw_raw(JsonWriter* w, const char* json) { jw_before_value(w); jw_puts(w, json); }

static void jw_int(JsonWriter* w, int64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%" PRId64, v);
    jw_before_value(w);
    jw_puts(w, s);
}

/* Python's repr of a float: the fewest significant digits that read back to x (to the same float,
 * when is_float), in fixed notation for decimal exponents -4..15 and scientific outside, with ".0"
 * added where the digits alone would read back as an integer. */
static void jw_number(JsonWriter* w, double x, int is_float) {
    char s[400];
    if (isnan(x)) snprintf(s, sizeof s, "NaN");
    else if (isinf(x)) snprintf(s, sizeof s, "%s", x > 0 ? "Infinity" : "-Infinity");
    else {
        int digits = 1;
        for (; digits < 17; digits++) {
            snprintf(s, sizeof s, "%.*e", digits - 1, x);
            double back = strtod(s, NULL);
            if (is_float ? (float)back == (float)x : back == x) break;
        }
        snprintf(s, sizeof s, "%.*e", digits - 1, x);
        int exponent = atoi(strchr(s, 'e') + 1);
        if (exponent >= -4 && exponent < 16) {
            int decimals = digits - 1 - exponent;
            snprintf(s, sizeof s, "%.*f", decimals > 0 ? decimals : 0, x);
            if (!strchr(s, '.')) strcat(s, ".0");
        }
    }
    jw_before_value(w);
    jw_puts(w, s);
}

static void jw_double(JsonWriter* w, double x) { jw_number(w, x, 0); }
static void jw_float(JsonWriter* w, float x) { jw_number(w, x, 1); }

/* The document so far, or NULL if an allocation failed or an object/array is still open. */
static const char* jw_text(const JsonWriter* w) {
    if (w->failed || w->depth != 0 || w->after_key) return NULL;
    return w->buf ? w->buf : "";
}

/* ----------------------------------------------------------------------------------------------
 * JSON reader: parses a whole document into a flat array of nodes, enough for our manifests, for
 * safetensors headers and for transformers' config.json. Strict RFC 8259 grammar, each key once in
 * an object, plus the NaN, Infinity and -Infinity that Python's json module writes. Strings are decoded (escapes, \u with
 * surrogate pairs to UTF-8) into a private copy of the text, so node strings stay valid until
 * json_free. Nodes link to their first child and next sibling; an object's members carry their
 * key. Node pointers are stable after json_parse returns.
 */

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonType;

typedef struct {
    JsonType type;
    int is_int;          /* JSON_NUMBER written as an integer literal that fits int64: i is exact */
    int64_t i;
    double num;          /* JSON_NUMBER; JSON_BOOL: 1 or 0 */
    const char* str;     /* JSON_STRING: decoded, NUL-terminated */
    const char* key;     /* member of an object: its key; otherwise NULL */
    int child, next;     /* node indices, -1 for none */
    int count;           /* JSON_ARRAY / JSON_OBJECT: number of children */
} JsonNode;

typedef struct {
    JsonNode* nodes;     /* nodes[0] is the root */
    int n, cap;
    char* text;
} JsonDoc;

typedef struct {
    JsonDoc* doc;
    char* s;
    size_t pos, len;
    int depth;
    char* err;
    size_t err_len;
} JsonParser;

static int jp_fail(JsonParser* p, const char* what) {
    return fail(p->err, p->err_len, "bad JSON at byte %zu: %s", p->pos, what);
}

static void jp_skip_ws(JsonParser* p) { p->pos = (size_t)(json_skip_space(p->s + p->pos, p->s + p->len) - p->s); }

static int jp_new_node(JsonParser* p, JsonType type) {
    JsonDoc* d = p->doc;
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 64;
        JsonNode* nodes = (JsonNode*)realloc(d->nodes, (size_t)cap * sizeof(JsonNode));
        if (!nodes) return jp_fail(p, "out of memory");
        d->nodes = nodes;
        d->cap = cap;
    }
    JsonNode* nd = &d->nodes[d->n];
    memset(nd, 0, sizeof *nd);
    nd->type = type;
    nd->child = nd->next = -1;
    return d->n++;
}

/* Decodes the string at p->pos (on its opening quote) in place, with lib/util.h's decoder: the
 * decoded form is never longer than the escaped one, so it is written over the text it came from. */
static int jp_string(JsonParser* p, const char** out) {
    char* dst = p->s + p->pos + 1;
    const char* after;
    size_t n;
    char why[128];
    int rc = json_string_decode(p->s + p->pos, p->s + p->len, dst, &n, &after, why, sizeof why);
    p->pos = (size_t)(after - p->s);
    if (rc) return jp_fail(p, why);
    if (memchr(dst, '\0', n)) return jp_fail(p, "\\u0000 inside a string is not supported");
    dst[n] = '\0';  /* over the closing quote at the latest */
    *out = dst;
    return 0;
}

static int jp_literal(JsonParser* p, const char* word) {
    size_t n = strlen(word);
    if (p->pos + n > p->len || strncmp(p->s + p->pos, word, n) != 0) return 0;
    p->pos += n;
    return 1;
}

static size_t jp_digits(JsonParser* p) {
    size_t start = p->pos;
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    return p->pos - start;
}

static int jp_number(JsonParser* p, int idx) {
    JsonNode* nd = &p->doc->nodes[idx];
    size_t start = p->pos;
    int negative = p->s[p->pos] == '-';
    if (negative) p->pos++;
    if (jp_literal(p, "Infinity")) { nd->num = negative ? -INFINITY : INFINITY; return 0; }
    if (!negative && jp_literal(p, "NaN")) { nd->num = NAN; return 0; }
    size_t int_digits = jp_digits(p);
    if (int_digits == 0) return jp_fail(p, "expected a value");
    if (int_digits > 1 && p->s[p->pos - int_digits] == '0') return jp_fail(p, "number with a leading zero");
    int integral = 1;
    if (p->pos < p->len && p->s[p->pos] == '.') {
        p->pos++;
        integral = 0;
        if (!jp_digits(p)) return jp_fail(p, "expected digits after '.'");
    }
    if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        p->pos++;
        integral = 0;
        if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
        if (!jp_digits(p)) return jp_fail(p, "expected digits in the exponent");
    }
    /* strtod/strtoll read a bounded copy: on the text itself they could run past the number (and
     * accept forms JSON forbids, like hex) */
    char num[64];
    size_t n = p->pos - start;
    if (n >= sizeof num) { p->pos = start; return jp_fail(p, "number longer than 63 characters"); }
    memcpy(num, p->s + start, n);
    num[n] = '\0';
    nd->num = strtod(num, NULL);
    if (integral) {
        errno = 0;
        long long v = strtoll(num, NULL, 10);
        if (errno == 0) { nd->is_int = 1; nd->i = v; }
    }
    return 0;
}

static int jp_value(JsonParser* p);

static int jp_key_cmp(const void* a, const void* b) { return strcmp(*(const char* const*)a, *(const char* const*)b); }

/* An object whose key appears twice is refused: RFC 8259 leaves its meaning open (Python keeps the
 * last value, json_get finds the first), so reading it either way could take a value the writer
 * did not mean. Called as the object closes; the keys are sorted to find twins. */
static int jp_unique_keys(JsonParser* p, int idx) {
    const JsonNode* nodes = p->doc->nodes;
    int n = nodes[idx].count;
    if (n < 2) return 0;
    const char** keys = (const char**)malloc((size_t)n * sizeof(char*));
    if (!keys) return jp_fail(p, "out of memory");
    int k = 0;
    for (int c = nodes[idx].child; c >= 0; c = nodes[c].next) keys[k++] = nodes[c].key;
    qsort(keys, (size_t)n, sizeof(char*), jp_key_cmp);
    char what[128] = "";
    for (int i = 1; i < n && !what[0]; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0) snprintf(what, sizeof what, "key \"%.80s\" appears twice", keys[i]);
    free(keys);
    return what[0] ? jp_fail(p, what) : 0;
}

/* Arrays and objects: children are linked in order through `next`. */
static int jp_container(JsonParser* p, int is_object) {
    if (p->depth >= CK_JSON_MAX_DEPTH) return jp_fail(p, "nested deeper than 64 levels");
    int idx = jp_new_node(p, is_object ? JSON_OBJECT : JSON_ARRAY);
    if (idx < 0) return -1;
    char close = is_object ? '}' : ']';
    p->pos++;
    p->depth++;
    jp_skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) { p->pos++; p->depth--; return idx; }
    int last = -1;
    for (;;) {
        const char* key = NULL;
        jp_skip_ws(p);
        if (is_object) {
            if (p->pos >= p->len || p->s[p->pos] != '"') return jp_fail(p, "expected a string key");
            if (jp_string(p, &key)) return -1;
            jp_skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') return jp_fail(p, "expected ':' after a key");
            p->pos++;
        }
        int child = jp_value(p);
        if (child < 0) return -1;
        p->doc->nodes[child].key = key;
        if (last < 0) p->doc->nodes[idx].child = child;
        else p->doc->nodes[last].next = child;
        last = child;
        p->doc->nodes[idx].count++;
        jp_skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') { p->pos++; continue; }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            p->depth--;
            return is_object && jp_unique_keys(p, idx) ? -1 : idx;
        }
        return jp_fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int jp_value(JsonParser* p) {
    jp_skip_ws(p);
    if (p->pos >= p->len) return jp_fail(p, "unexpected end of input");
    char c = p->s[p->pos];
    if (c == '{' || c == '[') return jp_container(p, c == '{');
    int idx;
    if (c == '"') {
        if ((idx = jp_new_node(p, JSON_STRING)) < 0) return -1;
        const char* s;
        if (jp_string(p, &s)) return -1;
        p->doc->nodes[idx].str = s;
        return idx;
    }
    int truth = jp_literal(p, "true");
    if (truth || jp_literal(p, "false")) {
        if ((idx = jp_new_node(p, JSON_BOOL)) < 0) return -1;
        p->doc->nodes[idx].num = truth;
        return idx;
    }
    if (jp_literal(p, "null")) return jp_new_node(p, JSON_NULL);
    if ((idx = jp_new_node(p, JSON_NUMBER)) < 0) return -1;
    return jp_number(p, idx) ? -1 : idx;
}

static void json_free(JsonDoc* doc) {
    free(doc->nodes);
    free(doc->text);
    memset(doc, 0, sizeof *doc);
}

/* Parses text[0..len); on failure doc is left empty and err says where and what. */
static int json_parse(JsonDoc* doc, const char* text, size_t len, char* err, size_t err_len) {
    memset(doc, 0, sizeof *doc);
    doc->text = (char*)malloc(len + 1);
    if (!doc->text) return fail(err, err_len, "bad JSON: out of memory for %zu bytes", len);
    memcpy(doc->text, text, len);
    doc->text[len] = '\0';
    JsonParser p = {doc, doc->text, 0, len, 0, err, err_len};
    if (jp_value(&p) < 0) { json_free(doc); return -1; }
    jp_skip_ws(&p);
    if (p.pos != len) { jp_fail(&p, "unexpected characters after the JSON value"); json_free(doc); return -1; }
    return 0;
}

static const JsonNode* json_root(const JsonDoc* doc) { return doc->n ? &doc->nodes[0] : NULL; }

static const JsonNode* json_first(const JsonDoc* doc, const JsonNode* node) {
    return node && node->child >= 0 ? &doc->nodes[node->child] : NULL;
}

static const JsonNode* json_next(const JsonDoc* doc, const JsonNode* node) {
    return node && node->next >= 0 ? &doc->nodes[node->next] : NULL;
}

/* The member `key` of object obj (the first, if repeated), or NULL. */
static const JsonNode* json_get(const JsonDoc* doc, const JsonNode* obj, const char* key) {
    if (!obj || obj->type != JSON_OBJECT) return NULL;
    for (const JsonNode* m = json_first(doc, obj); m; m = json_next(doc, m))
        if (strcmp(m->key, key) == 0) return m;
    return NULL;
}

/* The member `key` of obj if it has that type, else NULL. */
static const JsonNode* json_get_typed(const JsonDoc* doc, const JsonNode* obj, const char* key, JsonType type) {
    const JsonNode* v = json_get(doc, obj, key);
    return v && v->type == type ? v : NULL;
}

/* Typed getters: 0 and *out set when obj has `key` of that type, -1 otherwise (out untouched).
 * An integer may be written as 12 or 12.0, as long as the value is integral and exact. */
static int json_get_int(const JsonDoc* doc, const JsonNode* obj, const char* key, int64_t* out) {
    const JsonNode* v = json_get_typed(doc, obj, key, JSON_NUMBER);
    if (!v || (!v->is_int && (v->num != floor(v->num) || fabs(v->num) > 9007199254740992.0))) return -1;
    *out = v->is_int ? v->i : (int64_t)v->num;
    return 0;
}

static int json_get_double(const JsonDoc* doc, const JsonNode* obj, const char* key, double* out) {
    const JsonNode* v = json_get_typed(doc, obj, key, JSON_NUMBER);
    if (v) *out = v->num;
    return v ? 0 : -1;
}

static int json_get_string(const JsonDoc* doc, const JsonNode* obj, const char* key, const char** out) {
    const JsonNode* v = json_get_typed(doc, obj, key, JSON_STRING);
    if (v) *out = v->str;
    return v ? 0 : -1;
}

static int json_get_bool(const JsonDoc* doc, const JsonNode* obj, const char* key, int* out) {
    const JsonNode* v = json_get_typed(doc, obj, key, JSON_BOOL);
    if (v) *out = v->num != 0;
    return v ? 0 : -1;
}

/* ----------------------------------------------------------------------------------------------
 * Atomic files. A file is written as `path.tmp`, fsynced, renamed over `path`, and then the
 * directory is fsynced: a reader (or a crash at any instant) sees the old file or the whole new
 * one, never a part. The fsync before the rename puts the data on disk before the name points at
 * it; the one after makes the rename itself durable. The CRC32C and size of what was written are
 * kept, for the checkpoint manifest. On failure every af_ function has already closed and removed
 * the tmp file; af_abort is for the caller's own failures between af_open and af_commit.
 */

typedef struct {
    int fd;
    uint64_t bytes;   /* written so far */
    uint32_t crc;     /* CRC32C of those bytes */
    char path[CK_PATH_MAX];
    char tmp[CK_PATH_MAX];
} AtomicFile;

/* write(2) until done: it may write less than asked (and never more than ~2 GiB a call). */
static int ck_write_all(int fd, const void* data, size_t n, const char* what, char* err, size_t err_len) {
    const char* p = (const char*)data;
    while (n) {
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = write(fd, p, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return fail_errno(err, err_len, errno, "write %s", what);
        if (w == 0) return fail(err, err_len, "write %s: the system wrote 0 bytes", what);
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The directory part of path ("." when there is none). */
static int ck_parent_dir(const char* path, char* out, size_t out_len) {
    const char* slash = strrchr(path, '/');
    if (!slash) return snprintf(out, out_len, ".") < (int)out_len ? 0 : -1;
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    if (n >= out_len) return -1;
    memcpy(out, path, n);
    out[n] = '\0';
    return 0;
}

/* Makes a directory's entries (files created, renamed or removed in it) durable. Some file systems
 * cannot fsync a directory and say EINVAL; there is nothing more to do there. */
static int ck_fsync_dir(const char* dir, char* err, size_t err_len) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fail_errno(err, err_len, errno, "open directory %s to fsync it", dir);
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL) return fail_errno(err, err_len, e, "fsync directory %s", dir);
    return 0;
}

static int ck_fsync_parent(const char* path, char* err, size_t err_len) {
    char dir[CK_PATH_MAX];
    if (ck_parent_dir(path, dir, sizeof dir)) return fail(err, err_len, "%s: path too long", path);
    return ck_fsync_dir(dir, err, err_len);
}

static void af_abort(AtomicFile* f) {
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    if (f->tmp[0]) unlink(f->tmp);
    f->tmp[0] = '\0';
}

static int af_open(AtomicFile* f, const char* path, char* err, size_t err_len) {
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if (snprintf(f->path, sizeof f->path, "%s", path) >= (int)sizeof f->path ||
        snprintf(f->tmp, sizeof f->tmp, "%s.tmp", path) >= (int)sizeof f->tmp) {
        f->tmp[0] = '\0';
        return fail(err, err_len, "%s: path too long", path);
    }
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        int e = errno;
        f->tmp[0] = '\0';  /* nothing was created, nothing to remove */
        return fail_errno(err, err_len, e, "create %s.tmp", path);
    }
    return 0;
}

static int af_write(AtomicFile* f, const void* data, size_t n, char* err, size_t err_len) {
    if (ck_write_all(f->fd, data, n, f->tmp, err, err_len)) { af_abort(f); return -1; }
    f->crc = crc32c(f->crc, data, n);
    f->bytes += n;
    return 0;
}

static int af_commit(AtomicFile* f, char* err, size_t err_len) {
    if (fsync(f->fd) != 0) {
        fail_errno(err, err_len, errno, "fsync %s", f->tmp);
        af_abort(f);
        return -1;
    }
    int rc = close(f->fd);
    f->fd = -1;
    if (rc != 0) { fail_errno(err, err_len, errno, "close %s", f->tmp); af_abort(f); return -1; }
    if (rename(f->tmp, f->path) != 0) {
        fail_errno(err, err_len, errno, "rename %s to %s", f->tmp, f->path);
        af_abort(f);
        return -1;
    }
    f->tmp[0] = '\0';
    return ck_fsync_parent(f->path, err, err_len);
}

/* Writes a whole file atomically. */
static int ck_write_file_atomic(const char* path, const void* data, size_t n, char* err, size_t err_len) {
    AtomicFile f;
    if (af_open(&f, path, err, err_len) || af_write(&f, data, n, err, err_len)) return -1;
    return af_commit(&f, err, err_len);
}

/* mkdir -p; each directory it creates is made durable in its parent. */
static int ck_mkdir_p(const char* path, char* err, size_t err_len) {
    char buf[CK_PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return fail(err, err_len, "%s: path too long", path);
    for (char* p = buf + 1;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        struct stat st;
        if (mkdir(buf, 0755) == 0) {
            if (ck_fsync_parent(buf, err, err_len)) return -1;
        } else if (errno != EEXIST) {
            return fail_errno(err, err_len, errno, "create directory %s (at %s)", path, buf);
        } else if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
            return fail(err, err_len, "create directory %s: %s exists and is not a directory", path, buf);
        }
        *p = saved;
        if (saved == '\0') return 0;
    }
}

/* rm -rf, without following symbolic links. A missing path is not an error. */
static int ck_rmtree(const char* path, char* err, size_t err_len) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : fail_errno(err, err_len, errno, "stat %s", path);
    if (!S_ISDIR(st.st_mode)) {
        if (unlink(path) != 0) return fail_errno(err, err_len, errno, "remove %s", path);
        return 0;
    }
    DIR* d = opendir(path);
    if (!d) return fail_errno(err, err_len, errno, "open directory %s", path);
    int rc = 0;
    struct dirent* e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        char child[CK_PATH_MAX];
        if (snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= (int)sizeof child)
            rc = fail(err, err_len, "%s/%s: path too long", path, e->d_name);
        else
            rc = ck_rmtree(child, err, err_len);
    }
    closedir(d);
    if (rc == 0 && rmdir(path) != 0) return fail_errno(err, err_len, errno, "remove directory %s", path);
    return rc;
}

/* ----------------------------------------------------------------------------------------------
 * safetensors (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N,
 * N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 * "__metadata__": {"key": "value"}}, then the tensors' bytes, offsets relative to the end of the
 * header, with no gaps and no overlaps. The writer pads the header with spaces so that the data
 * starts 8-byte aligned, and lays tensors out largest element size first (stable otherwise), so
 * every tensor of a file it wrote is aligned to its element size, as the reference writer does.
 * The reader maps the file read-only; a StTensor's data points into the mapping and is valid until
 * st_close. In files from other writers a tensor may be unaligned: copy it out with memcpy.
 */

typedef enum {
    ST_BOOL, ST_U8, ST_I8, ST_F8_E4M3, ST_F8_E5M2, ST_U16, ST_I16, ST_F16, ST_BF16,
    ST_U32, ST_I32, ST_F32, ST_U64, ST_I64, ST_F64, ST_N_DTYPES
} StDtype;

static const struct { const char* name; int size; } st_dtypes[ST_N_DTYPES] = {
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"U16", 2}, {"I16", 2},
    {"F16", 2}, {"BF16", 2}, {"U32", 4}, {"I32", 4}, {"F32", 4}, {"U64", 8}, {"I64", 8}, {"F64", 8},
};

#define ST_MAX_DIMS 8
#define ST_MAX_HEADER 100000000  /* the reference implementation's limit on N */

typedef struct {
    const char* name;
    StDtype dtype;
    int ndim;                      /* 0 for a scalar */
    int64_t shape[ST_MAX_DIMS];
    const void* data;              /* nbytes = numel * element size, host byte order */
} StTensor;

typedef struct {
    char path[CK_PATH_MAX];
    const uint8_t* map;            /* the whole file, mapped read-only */
    size_t map_len;
    JsonDoc header;
    StTensor* tensors;             /* in file (offset) order */
    int n_tensors;
    const char** meta;             /* __metadata__ as pairs: meta[2k] is a key, meta[2k+1] its value */
    int n_meta;
} StFile;

static int st_dtype_size(StDtype dt) { return (int)dt >= 0 && dt < ST_N_DTYPES ? st_dtypes[dt].size : 0; }
static const char* st_dtype_name(StDtype dt) { return (int)dt >= 0 && dt < ST_N_DTYPES ? st_dtypes[dt].name : "?"; }

/* The byte size of a tensor, or -1 if the shape is invalid or the size overflows. */
static int64_t st_nbytes(const StTensor* t) {
    int size = st_dtype_size(t->dtype);
    if (size == 0 || t->ndim < 0 || t->ndim > ST_MAX_DIMS) return -1;
    int64_t n = size;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0) return -1;
        if (t->shape[d] != 0 && n > INT64_MAX / t->shape[d]) return -1;
        n *= t->shape[d];
    }
    return n;
}

typedef struct { int size, index; } StOrder;

static int st_order_cmp(const void* a, const void* b) {
    const StOrder* x = (const StOrder*)a;
    const StOrder* y = (const StOrder*)b;
    if (x->size != y->size) return y->size - x->size;
    return x->index - y->index;
}

static int st_check_tensors(const StTensor* t, int n, const char* path, char* err, size_t err_len) {
    for (int i = 0; i < n; i++) {
        const char* name = t[i].name ? t[i].name : "";
        if (!name[0] || strcmp(name, "__metadata__") == 0)
            return fail(err, err_len, "%s: tensor %d has an invalid name '%s'", path, i, name);
        if (st_dtype_size(t[i].dtype) == 0)
            return fail(err, err_len, "%s: tensor '%s' has unknown dtype %d", path, name, (int)t[i].dtype);
        int64_t nbytes = st_nbytes(&t[i]);
        if (nbytes < 0) return fail(err, err_len, "%s: tensor '%s' has an invalid shape (ndim %d)", path, name, t[i].ndim);
        if (nbytes > 0 && !t[i].data) return fail(err, err_len, "%s: tensor '%s' has no data", path, name);
        for (int j = 0; j < i; j++)
            if (strcmp(name, t[j].name) == 0) return fail(err, err_len, "%s: tensor name '%s' appears twice", path, name);
    }
    return 0;
}

/* The header JSON, padded with spaces to a multiple of 8 bytes; order[] gives the data layout. */
static int st_build_header(JsonWriter* w, const StTensor* t, const StOrder* order, int n,
                           const char* const* meta_kv, int n_meta) {
    jw_init(w, 0);
    jw_object_begin(w);
    if (n_meta > 0) {
        jw_key(w, "__metadata__");
        jw_object_begin(w);
        for (int k = 0; k < n_meta; k++) { jw_key(w, meta_kv[2 * k]); jw_string(w, meta_kv[2 * k + 1]); }
        jw_object_end(w);
    }
    int64_t offset = 0;
    for (int k = 0; k < n; k++) {
        const StTensor* x = &t[order[k].index];
        jw_key(w, x->name);
        jw_object_begin(w);
        jw_key(w, "dtype");
        jw_string(w, st_dtype_name(x->dtype));
        jw_key(w, "shape");
        jw_array_begin(w);
        for (int d = 0; d < x->ndim; d++) jw_int(w, x->shape[d]);
        jw_array_end(w);
        jw_key(w, "data_offsets");
        jw_array_begin(w);
        jw_int(w, offset);
        offset += st_nbytes(x);
        jw_int(w, offset);
        jw_array_end(w);
        jw_object_end(w);
    }
    jw_object_end(w);
    while (w->len % 8) jw_puts(w, " ");
    return jw_text(w) ? 0 : -1;
}

/* Writes a whole safetensors file into f (opened by the caller). */
static int st_write_to(AtomicFile* f, const StTensor* t, int n, const char* const* meta_kv, int n_meta,
                       char* err, size_t err_len) {
    if (n < 0 || n_meta < 0 || st_check_tensors(t, n, f->path, err, err_len)) { af_abort(f); return -1; }
    for (int k = 0; k < 2 * n_meta; k++)
        if (!meta_kv[k]) { af_abort(f); return fail(err, err_len, "%s: metadata entry %d is NULL", f->path, k / 2); }
    StOrder* order = (StOrder*)malloc((size_t)(n > 0 ? n : 1) * sizeof(StOrder));
    if (!order) { af_abort(f); return fail(err, err_len, "%s: out of memory", f->path); }
    for (int i = 0; i < n; i++) { order[i].size = st_dtype_size(t[i].dtype); order[i].index = i; }
    qsort(order, (size_t)n, sizeof(StOrder), st_order_cmp);
    JsonWriter w;
    int rc = 0;
    if (st_build_header(&w, t, order, n, meta_kv, n_meta)) {
        af_abort(f);
        rc = fail(err, err_len, "%s: out of memory building the header", f->path);
    } else {
        uint8_t len_le[8];
        for (int b = 0; b < 8; b++) len_le[b] = (uint8_t)((uint64_t)w.len >> (8 * b));
        rc = af_write(f, len_le, 8, err, err_len);
        if (!rc) rc = af_write(f, w.buf, w.len, err, err_len);
        for (int k = 0; k < n && !rc; k++)
            rc = af_write(f, t[order[k].index].data, (size_t)st_nbytes(&t[order[k].index]), err, err_len);
    }
    jw_free(&w);
    free(order);
    return rc;
}

/* Writes path atomically. meta_kv: NULL or n_meta key/value pairs, {"k1", "v1", "k2", "v2", ...}. */
static int st_write(const char* path, const StTensor* t, int n, const char* const* meta_kv, int n_meta,
                    char* err, size_t err_len) {
    AtomicFile f;
    if (af_open(&f, path, err, err_len) || st_write_to(&f, t, n, meta_kv, n_meta, err, err_len)) return -1;
    return af_commit(&f, err, err_len);
}

static void st_close(StFile* f) {
    if (f->map) munmap((void*)f->map, f->map_len);
    json_free(&f->header);
    free(f->tensors);
    free((void*)f->meta);
    memset(f, 0, sizeof *f);
}

typedef struct { int64_t begin, end; int index; } StSpan;

static int st_span_cmp(const void* a, const void* b) {
    const StSpan* x = (const StSpan*)a;
    const StSpan* y = (const StSpan*)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* One header entry into t and span; data_len bounds the offsets. */
static int st_parse_entry(StFile* f, const JsonNode* e, StTensor* t, StSpan* span, uint64_t data_len,
                          char* err, size_t err_len) {
    const JsonDoc* h = &f->header;
    const char* name = e->key;
    const char* dtype;
    if (e->type != JSON_OBJECT) return fail(err, err_len, "%s: tensor '%s': entry is not an object", f->path, name);
    if (json_get_string(h, e, "dtype", &dtype))
        return fail(err, err_len, "%s: tensor '%s': no \"dtype\" string", f->path, name);
    t->name = name;
    t->dtype = ST_N_DTYPES;
    for (int k = 0; k < ST_N_DTYPES; k++)
        if (strcmp(dtype, st_dtypes[k].name) == 0) t->dtype = (StDtype)k;
    if (t->dtype == ST_N_DTYPES) return fail(err, err_len, "%s: tensor '%s': unknown dtype \"%s\"", f->path, name, dtype);
    const JsonNode* shape = json_get(h, e, "shape");
    if (!shape || shape->type != JSON_ARRAY) return fail(err, err_len, "%s: tensor '%s': no \"shape\" array", f->path, name);
    if (shape->count > ST_MAX_DIMS)
        return fail(err, err_len, "%s: tensor '%s': %d dimensions, at most %d are supported", f->path, name, shape->count, ST_MAX_DIMS);
    t->ndim = 0;
    for (const JsonNode* d = json_first(h, shape); d; d = json_next(h, d)) {
        if (d->type != JSON_NUMBER || !d->is_int || d->i < 0)
            return fail(err, err_len, "%s: tensor '%s': shape holds something other than a size", f->path, name);
        t->shape[t->ndim++] = d->i;
    }
    const JsonNode* offs = json_get(h, e, "data_offsets");
    const JsonNode* b = json_first(h, offs);
    const JsonNode* en = json_next(h, b);
    if (!offs || offs->type != JSON_ARRAY || offs->count != 2 || b->type != JSON_NUMBER || !b->is_int ||
        en->type != JSON_NUMBER || !en->is_int || b->i < 0 || en->i < b->i)
        return fail(err, err_len, "%s: tensor '%s': \"data_offsets\" is not [begin, end] with 0 <= begin <= end",
                    f->path, name);
    if ((uint64_t)en->i > data_len)
        return fail(err, err_len, "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64 "] run past the %" PRIu64
                    " bytes of data: the file is truncated or the header is wrong", f->path, name, b->i, en->i, data_len);
    int64_t need = st_nbytes(t);
    if (need < 0) return fail(err, err_len, "%s: tensor '%s': shape too large", f->path, name);
    if (need != en->i - b->i)
        return fail(err, err_len, "%s: tensor '%s': data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRId64
                    " bytes but %s of that shape needs %" PRId64, f->path, name, b->i, en->i, en->i - b->i, dtype, need);
    span->begin = b->i;
    span->end = en->i;
    return 0;
}

/* Checks that the tensors tile the data exactly (sorting f->tensors into offset order) and sets
 * their data pointers. */
static int st_check_layout(StFile* f, StSpan* spans, const uint8_t* data, uint64_t data_len, char* err, size_t err_len) {
    int n = f->n_tensors;
    for (int i = 0; i < n; i++) spans[i].index = i;
    qsort(spans, (size_t)n, sizeof(StSpan), st_span_cmp);
    StTensor* sorted = (StTensor*)malloc((size_t)(n > 0 ? n : 1) * sizeof(StTensor));
    if (!sorted) return fail(err, err_len, "%s: out of memory", f->path);
    int64_t expect = 0;
    for (int i = 0; i < n; i++) {
        const StTensor* t = &f->tensors[spans[i].index];
        if (spans[i].begin != expect) {
            free(sorted);
            return fail(err, err_len, "%s: tensor '%s' starts at byte %" PRId64 " of the data, expected %" PRId64
                        " (%s)", f->path, t->name, spans[i].begin, expect,
                        spans[i].begin < expect ? "it overlaps the tensor before it" : "a gap before it");
        }
        expect = spans[i].end;
        sorted[i] = *t;
        sorted[i].data = data + spans[i].begin;
    }
    free(f->tensors);
    f->tensors = sorted;
    if ((uint64_t)expect != data_len)
        return fail(err, err_len, "%s: the tensors end at byte %" PRId64 " of the data but the file holds %" PRIu64
                    " bytes after the header", f->path, expect, data_len);
    return 0;
}

static int st_parse_metadata(StFile* f, const JsonNode* e, char* err, size_t err_len) {
    if (e->type != JSON_OBJECT || f->meta)
        return fail(err, err_len, "%s: __metadata__ is not one object of strings", f->path);
    f->meta = (const char**)calloc(2 * (size_t)e->count + 1, sizeof(char*));
    if (!f->meta) return fail(err, err_len, "%s: out of memory", f->path);
    for (const JsonNode* m = json_first(&f->header, e); m; m = json_next(&f->header, m)) {
        if (m->type != JSON_STRING)
            return fail(err, err_len, "%s: __metadata__ value of '%s' is not a string", f->path, m->key);
        f->meta[2 * f->n_meta] = m->key;
        f->meta[2 * f->n_meta + 1] = m->str;
        f->n_meta++;
    }
    return 0;
}

static int st_parse_header(StFile* f, const uint8_t* data, uint64_t data_len, char* err, size_t err_len) {
    const JsonDoc* h = &f->header;
    const JsonNode* root = json_root(h);
    if (root->type != JSON_OBJECT) return fail(err, err_len, "%s: the header is not a JSON object", f->path);
    f->tensors = (StTensor*)calloc((size_t)root->count + 1, sizeof(StTensor));
    StSpan* spans = (StSpan*)calloc((size_t)root->count + 1, sizeof(StSpan));
    if (!f->tensors || !spans) { free(spans); return fail(err, err_len, "%s: out of memory", f->path); }
    int rc = 0;
    for (const JsonNode* e = json_first(h, root); e && !rc; e = json_next(h, e)) {
        if (strcmp(e->key, "__metadata__") == 0) {
            rc = st_parse_metadata(f, e, err, err_len);
            continue;
        }
        rc = st_parse_entry(f, e, &f->tensors[f->n_tensors], &spans[f->n_tensors], data_len, err, err_len);
        f->n_tensors++;
    }
    if (!rc) rc = st_check_layout(f, spans, data, data_len, err, err_len);
    free(spans);
    return rc;
}

/* Opens and validates a safetensors file: header length, JSON, dtypes, shapes, and offsets that
 * tile the data exactly. On failure f is left closed. */
static int st_open(StFile* f, const char* path, char* err, size_t err_len) {
    memset(f, 0, sizeof *f);
    if (snprintf(f->path, sizeof f->path, "%s", path) >= (int)sizeof f->path) return fail(err, err_len, "%s: path too long", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail_errno(err, err_len, errno, "open %s", path);
    struct stat st;
    if (fstat(fd, &st) != 0) { int e = errno; close(fd); return fail_errno(err, err_len, e, "stat %s", path); }
    uint64_t size = (uint64_t)st.st_size;
    if (!S_ISREG(st.st_mode) || size < 8) {
        close(fd);
        return fail(err, err_len, "%s: %" PRIu64 " bytes, too short for a safetensors file (8-byte header length, "
                    "then the header): truncated?", path, size);
    }
    void* map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return fail_errno(err, err_len, e, "mmap %s", path);
    f->map = (const uint8_t*)map;
    f->map_len = (size_t)size;
    uint64_t n = 0;
    for (int b = 0; b < 8; b++) n |= (uint64_t)f->map[b] << (8 * b);
    int rc = 0;
    char why[256];
    if (n > size - 8)
        rc = fail(err, err_len, "%s: header length %" PRIu64 " runs past the end of the %" PRIu64
                  "-byte file: truncated, or not a safetensors file", path, n, size);
    else if (n > ST_MAX_HEADER)
        rc = fail(err, err_len, "%s: header length %" PRIu64 " is over the %d-byte limit", path, n, ST_MAX_HEADER);
    else if (n == 0 || f->map[8] != '{')
        rc = fail(err, err_len, "%s: the header does not start with '{': not a safetensors file", path);
    else if (json_parse(&f->header, (const char*)f->map + 8, (size_t)n, why, sizeof why))
        rc = fail(err, err_len, "%s: header: %s", path, why);
    else
        rc = st_parse_header(f, f->map + 8 + n, size - 8 - n, err, err_len);
    if (rc) st_close(f);
    return rc;
}

static const StTensor* st_find(const StFile* f, const char* name) {
    for (int i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

/* The __metadata__ value of key, or NULL. */
static const char* st_meta(const StFile* f, const char* key) {
    for (int k = 0; k < f->n_meta; k++)
        if (strcmp(f->meta[2 * k], key) == 0) return f->meta[2 * k + 1];
    return NULL;
}

/* ----------------------------------------------------------------------------------------------
 * Checkpoint directories. Layout under the output directory:
 *   <out>/ckpt_<step>/        one complete checkpoint: its files and manifest.json
 *   <out>/ckpt_<step>.tmp/    being written (or left by a crash); never read
 *   <out>/latest              the name of the newest checkpoint directory, e.g. "ckpt_500\n"
 * Writing: ckpt_begin makes ckpt_<step>.tmp/; each ckpt_add_* writes one file into it (atomically,
 * fsynced, CRC32C recorded); ckpt_commit writes manifest.json, renames the directory to ckpt_<step>,
 * fsyncs <out>, rewrites `latest` atomically, then prunes old checkpoints. A crash at any point
 * leaves the previous checkpoint and `latest` as they were. On any error call ckpt_abort, which
 * removes the unfinished directory (it is also harmless after a successful commit).
 * Only one process may write to an output directory at a time.
 */

#define CKPT_FORMAT "train_gpt checkpoint"
#define CKPT_VERSION 1
#define CKPT_NAME_MAX 128
#define CKPT_MANIFEST "manifest.json"
#define CKPT_MANIFEST_MAX ((size_t)64 << 20)

typedef struct {
    char name[CKPT_NAME_MAX];
    uint64_t bytes;
    uint32_t crc32c;
} CkptFileInfo;

typedef struct {
    char out_dir[CK_PATH_MAX];
    char tmp_dir[CK_PATH_MAX];
    int64_t step;
    int active;                /* between ckpt_begin (or ckpt_join) and ckpt_commit / ckpt_abort */
    int joined;                /* a writer that joined another's checkpoint: it never removes the directory */
    CkptFileInfo* files;
    int n_files, cap_files;
} CkptWriter;

typedef struct {
    char dir[CK_PATH_MAX];
    int64_t step;
    JsonDoc manifest;
    const JsonNode* config;    /* the object given to ckpt_commit; read it with json_get_* on &manifest */
    CkptFileInfo* files;
    int n_files;
} CkptReader;

/* The names of the files a checkpoint lists: plain names, so that a manifest (or a receipt) cannot
 * point outside its directory, and not the manifest's own. */
static int ckpt_valid_name(const char* name) {
    size_t n = strlen(name);
    if (n == 0 || n >= CKPT_NAME_MAX || name[0] == '.' || strcmp(name, CKPT_MANIFEST) == 0) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9') || strchr("._-", name[i])))
            return 0;
    return 1;
}

/* A manifest's (and a receipt's) "crc32c": exactly 8 hex digits. */
static int ckpt_parse_crc(const char* s, uint32_t* out) {
    uint32_t v = 0;
    for (int i = 0; i < 8; i++) {
        int d = hex_digit(s[i]);
        if (d < 0) return -1;
        v = v * 16 + (uint32_t)d;
    }
    if (s[8] != '\0') return -1;
    *out = v;
    return 0;
}

/* The step of a directory entry named ckpt_<digits>, or -1. Digits as ckpt_begin writes them (no
 * leading zeros), so that a step names exactly one directory. */
static int64_t ckpt_parse_dirname(const char* name) {
    if (strncmp(name, "ckpt_", 5) != 0 || name[5] < '0' || name[5] > '9') return -1;
    if (name[5] == '0' && name[6] >= '0' && name[6] <= '9') return -1;
    char* end;
    errno = 0;
    long long step = strtoll(name + 5, &end, 10);
    if (errno || *end != '\0') return -1;
    return step;
}

static void ckpt_abort(CkptWriter* w) {
    if (w->active && !w->joined) ck_rmtree(w->tmp_dir, NULL, 0);
    free(w->files);
    w->files = NULL;
    w->n_files = w->cap_files = 0;
    w->active = 0;
}

/* What ckpt_begin and ckpt_join both set up: a writer of checkpoint `step` of out_dir, whose files
 * go into out_dir/ckpt_<step>.tmp/, not active yet. */
static int ckpt_writer_init(CkptWriter* w, const char* out_dir, int64_t step, char* err, size_t err_len) {
    memset(w, 0, sizeof *w);
    if (step < 0) return fail(err, err_len, "checkpoint step %" PRId64 " is negative", step);
    if (snprintf(w->out_dir, sizeof w->out_dir, "%s", out_dir) >= (int)sizeof w->out_dir ||
        snprintf(w->tmp_dir, sizeof w->tmp_dir, "%s/ckpt_%" PRId64 ".tmp", out_dir, step) >= (int)sizeof w->tmp_dir)
        return fail(err, err_len, "%s: path too long", out_dir);
    w->step = step;
    return 0;
}

/* Starts checkpoint `step` in out_dir (created if missing); a stale ckpt_<step>.tmp is replaced. */
static int ckpt_begin(CkptWriter* w, const char* out_dir, int64_t step, char* err, size_t err_len) {
    if (ckpt_writer_init(w, out_dir, step, err, err_len) || ck_mkdir_p(out_dir, err, err_len) ||
        ck_rmtree(w->tmp_dir, err, err_len))
        return -1;
    if (mkdir(w->tmp_dir, 0755) != 0) return fail_errno(err, err_len, errno, "create directory %s", w->tmp_dir);
    w->active = 1;
    return 0;
}

/* The path of `name`, a new file of the unfinished checkpoint, after checking that it may be one (a
 * valid name, not listed yet) and making room for its entry, so that ckpt_record_file cannot fail
 * once the file is on disk. The one check of every listed file: the writer's own (ckpt_add_*) and
 * those a receipt brings (ckpt_take_receipt). path has CK_PATH_MAX bytes. */
static int ckpt_new_file(CkptWriter* w, const char* name, char* path, char* err, size_t err_len) {
    if (!w->active) return fail(err, err_len, "checkpoint file %s: no checkpoint in progress (call ckpt_begin)", name);
    if (!ckpt_valid_name(name))
        return fail(err, err_len, "checkpoint file '%s': names are letters, digits, '.', '_' and '-' (not "
                    "starting with '.', at most %d characters), and not " CKPT_MANIFEST, name, CKPT_NAME_MAX - 1);
    for (int i = 0; i < w->n_files; i++)
        if (strcmp(w->files[i].name, name) == 0) return fail(err, err_len, "%s/%s: written twice", w->tmp_dir, name);
    if (snprintf(path, CK_PATH_MAX, "%s/%s", w->tmp_dir, name) >= CK_PATH_MAX)
        return fail(err, err_len, "%s/%s: path too long", w->tmp_dir, name);
    if (w->n_files < w->cap_files) return 0;
    int cap = w->cap_files ? 2 * w->cap_files : 8;
    CkptFileInfo* files = (CkptFileInfo*)realloc(w->files, (size_t)cap * sizeof(CkptFileInfo));
    if (!files) return fail(err, err_len, "%s: out of memory", w->tmp_dir);
    w->files = files;
    w->cap_files = cap;
    return 0;
}

/* Lists a file that ckpt_new_file admitted, now on disk with these bytes and CRC32C. */
static void ckpt_record_file(CkptWriter* w, const char* name, uint64_t bytes, uint32_t crc) {
    CkptFileInfo* info = &w->files[w->n_files++];
    snprintf(info->name, sizeof info->name, "%s", name);
    info->bytes = bytes;
    info->crc32c = crc;
}

/* Opens `name` in the unfinished checkpoint for writing; ckpt_file_end lists it. */
static int ckpt_file_begin(CkptWriter* w, const char* name, AtomicFile* f, char* err, size_t err_len) {
    char path[CK_PATH_MAX];
    if (ckpt_new_file(w, name, path, err, err_len)) return -1;
    return af_open(f, path, err, err_len);
}

static int ckpt_file_end(CkptWriter* w, const char* name, AtomicFile* f, char* err, size_t err_len) {
    if (af_commit(f, err, err_len)) return -1;
    ckpt_record_file(w, name, f->bytes, f->crc);
    return 0;
}

/* Adds a file of raw bytes to the unfinished checkpoint. */
static int ckpt_add_file(CkptWriter* w, const char* name, const void* data, size_t n, char* err, size_t err_len) {
    AtomicFile f;
    if (ckpt_file_begin(w, name, &f, err, err_len) || af_write(&f, data, n, err, err_len)) return -1;
    return ckpt_file_end(w, name, &f, err, err_len);
}

/* Adds a safetensors file (see st_write) to the unfinished checkpoint. */
static int ckpt_add_safetensors(CkptWriter* w, const char* name, const StTensor* t, int n,
                                const char* const* meta_kv, int n_meta, char* err, size_t err_len) {
    AtomicFile f;
    if (ckpt_file_begin(w, name, &f, err, err_len) || st_write_to(&f, t, n, meta_kv, n_meta, err, err_len)) return -1;
    return ckpt_file_end(w, name, &f, err, err_len);
}

static int ckpt_write_manifest(CkptWriter* w, const char* config_json, char* err, size_t err_len) {
    JsonWriter j;
    jw_init(&j, 1);
    jw_object_begin(&j);
    jw_key(&j, "format");
    jw_string(&j, CKPT_FORMAT);
    jw_key(&j, "version");
    jw_int(&j, CKPT_VERSION);
    jw_key(&j, "step");
    jw_int(&j, w->step);
    jw_key(&j, "config");
    jw_raw(&j, config_json);
    jw_key(&j, "files");
    jw_object_begin(&j);
    for (int i = 0; i < w->n_files; i++) {
        char crc[16];
        snprintf(crc, sizeof crc, "%08x", w->files[i].crc32c);
        jw_key(&j, w->files[i].name);
        jw_object_begin(&j);
        jw_key(&j, "bytes");
        jw_int(&j, (int64_t)w->files[i].bytes);
        jw_key(&j, "crc32c");
        jw_string(&j, crc);
        jw_object_end(&j);
    }
    jw_object_end(&j);
    jw_object_end(&j);
    jw_puts(&j, "\n");
    int rc;
    char path[CK_PATH_MAX];
    if (!jw_text(&j)) rc = fail(err, err_len, "%s: out of memory building the manifest", w->tmp_dir);
    else if (snprintf(path, sizeof path, "%s/" CKPT_MANIFEST, w->tmp_dir) >= (int)sizeof path)
        rc = fail(err, err_len, "%s: path too long", w->tmp_dir);
    else
        rc = ck_write_file_atomic(path, j.buf, j.len, err, err_len);
    jw_free(&j);
    return rc;
}

/* Removes a complete checkpoint directory: renamed to *.del.tmp first, so that a crash halfway
 * through leaves something startup cleanup removes, never a ckpt_<step> with files missing. */
static int ckpt_remove_dir(const char* out_dir, int64_t step, char* err, size_t err_len) {
    char dir[CK_PATH_MAX], doomed[CK_PATH_MAX];
    if (snprintf(dir, sizeof dir, "%s/ckpt_%" PRId64, out_dir, step) >= (int)sizeof dir ||
        snprintf(doomed, sizeof doomed, "%s.del.tmp", dir) >= (int)sizeof doomed)
        return fail(err, err_len, "%s: path too long", out_dir);
    if (ck_rmtree(doomed, err, err_len)) return -1;
    if (rename(dir, doomed) != 0) return fail_errno(err, err_len, errno, "rename %s to %s", dir, doomed);
    if (ck_fsync_dir(out_dir, err, err_len)) return -1;
    return ck_rmtree(doomed, err, err_len);
}

static int ckpt_step_desc(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The steps of the complete checkpoints in out_dir (malloc'd, sorted newest first). */
static int ckpt_list(const char* out_dir, int64_t** steps, int* n, char* err, size_t err_len) {
    *steps = NULL;
    *n = 0;
    DIR* d = opendir(out_dir);
    if (!d) return fail_errno(err, err_len, errno, "open directory %s", out_dir);
    int cap = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int64_t step = ckpt_parse_dirname(e->d_name);
        if (step < 0) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t* grown = (int64_t*)realloc(*steps, (size_t)cap * sizeof(int64_t));
            if (!grown) { closedir(d); free(*steps); *steps = NULL; return fail(err, err_len, "%s: out of memory", out_dir); }
            *steps = grown;
        }
        (*steps)[(*n)++] = step;
    }
    closedir(d);
    if (*n) qsort(*steps, (size_t)*n, sizeof(int64_t), ckpt_step_desc);
    return 0;
}

/* Keeps the keep_last newest checkpoints at or below `step` (the one just written among them);
 * those above it come from a run that was resumed from an earlier point: they are not this run's
 * to delete, and are replaced when the run reaches their step. */
static int ckpt_prune(const char* out_dir, int64_t step, int keep_last, char* err, size_t err_len) {
    int64_t* steps;
    int n, kept = 0, rc = 0;
    if (ckpt_list(out_dir, &steps, &n, err, err_len)) return -1;
    for (int i = 0; i < n && !rc; i++) {
        if (steps[i] > step) continue;
        if (++kept > keep_last) rc = ckpt_remove_dir(out_dir, steps[i], err, err_len);
    }
    free(steps);
    return rc;
}

/* Completes the checkpoint: manifest (with config_json, a JSON object, or NULL for {}), rename to
 * ckpt_<step>, `latest`, then pruning to the keep_last newest (0 keeps all). */
static int ckpt_commit(CkptWriter* w, const char* config_json, int keep_last, char* err, size_t err_len) {
    if (!w->active) return fail(err, err_len, "ckpt_commit: no checkpoint in progress (call ckpt_begin)");
    if (!config_json) config_json = "{}";
    JsonDoc cfg;
    char why[256];
    if (json_parse(&cfg, config_json, strlen(config_json), why, sizeof why))
        return fail(err, err_len, "%s: the config to store in the manifest is not valid JSON: %s", w->tmp_dir, why);
    int is_object = json_root(&cfg)->type == JSON_OBJECT;
    json_free(&cfg);
    if (!is_object) return fail(err, err_len, "%s: the config to store in the manifest is not a JSON object", w->tmp_dir);
    if (ckpt_write_manifest(w, config_json, err, err_len)) return -1;

    char final_dir[CK_PATH_MAX], latest[CK_PATH_MAX], name[CKPT_NAME_MAX];
    snprintf(name, sizeof name, "ckpt_%" PRId64, w->step);
    if (snprintf(final_dir, sizeof final_dir, "%s/%s", w->out_dir, name) >= (int)sizeof final_dir ||
        snprintf(latest, sizeof latest, "%s/latest", w->out_dir) >= (int)sizeof latest)
        return fail(err, err_len, "%s: path too long", w->out_dir);
    /* a ckpt_<step> already there is from an earlier attempt at this step (a crash after its rename
     * but before `latest` moved, or a run resumed from an earlier checkpoint): replace it */
    struct stat st;
    if (lstat(final_dir, &st) == 0 && ckpt_remove_dir(w->out_dir, w->step, err, err_len)) return -1;
    if (rename(w->tmp_dir, final_dir) != 0)
        return fail_errno(err, err_len, errno, "rename %s to %s", w->tmp_dir, final_dir);
    w->active = 0;  /* the tmp directory is gone; from here on the checkpoint exists */
    if (ck_fsync_dir(w->out_dir, err, err_len)) return -1;
    strcat(name, "\n");
    if (ck_write_file_atomic(latest, name, strlen(name), err, err_len)) return -1;
    int rc = keep_last > 0 ? ckpt_prune(w->out_dir, w->step, keep_last, err, err_len) : 0;
    ckpt_abort(w);
    return rc;
}

/* ----------------------------------------------------------------------------------------------
 * Several writers, one checkpoint. In a data-parallel run each rank writes its own shard of the
 * optimizer state into the same ckpt_<step>.tmp/ (so the output directory must be one that every
 * rank sees: one machine, or a shared file system). One writer owns the checkpoint: ckpt_begin,
 * its own files, then ckpt_take_receipt for each other writer, then ckpt_commit. Each other writer
 * calls ckpt_join (which waits for the owner's directory), adds its files as usual, and ends with
 * ckpt_send_receipt: a small file in the directory that lists the files it wrote, with their sizes
 * and CRC32Cs, one "<name> <bytes> <crc32c>" line each, or says why it failed ("failed: <why>").
 * The owner folds each receipt's files into its own list and removes the receipt, so the manifest
 * covers every rank's files; since the manifest is written and the directory renamed only after
 * every receipt came in, a checkpoint is complete for all ranks or not at all.
 */

#define CKPT_RECEIPT_MAX 65536

/* Waits up to timeout_s for path to exist (as a directory when want_dir); 0, or -1 on the timeout. */
static int ck_wait_for(const char* path, int want_dir, double timeout_s) {
    struct stat st;
    for (double deadline = now_seconds() + timeout_s;; sleep_seconds(0.01)) {
        if (stat(path, &st) == 0 && (!want_dir || S_ISDIR(st.st_mode))) return 0;
        if (now_seconds() > deadline) return -1;
    }
}

/* Joins checkpoint `step` of out_dir, begun by its owner: waits up to timeout_s for the directory. */
static int ckpt_join(CkptWriter* w, const char* out_dir, int64_t step, double timeout_s, char* err, size_t err_len) {
    if (ckpt_writer_init(w, out_dir, step, err, err_len)) return -1;
    if (ck_wait_for(w->tmp_dir, 1, timeout_s))
        return fail(err, err_len, "%s: not created within %.0f s by the writer that owns the checkpoint", w->tmp_dir,
                    timeout_s);
    w->active = 1;
    w->joined = 1;
    return 0;
}

/* A joined writer's last word: the files it wrote, or (why != NULL) the reason it failed. Ends
 * the writer (ckpt_abort) either way. */
static int ckpt_send_receipt(CkptWriter* w, const char* receipt, const char* why, char* err, size_t err_len) {
    JsonWriter text;  /* used as a growing string */
    jw_init(&text, 0);
    char line[CKPT_NAME_MAX + 64];
    if (why) {
        jw_puts(&text, "failed: ");
        for (const char* c = why; *c; c++) jw_putn(&text, *c == '\n' ? " " : c, 1);
        jw_puts(&text, "\n");
    }
    for (int i = 0; !why && i < w->n_files; i++) {
        snprintf(line, sizeof line, "%s %" PRIu64 " %08x\n", w->files[i].name, w->files[i].bytes, w->files[i].crc32c);
        jw_puts(&text, line);
    }
    char path[CK_PATH_MAX];
    int rc;
    if (!jw_text(&text)) rc = fail(err, err_len, "%s: out of memory", w->tmp_dir);
    else if (snprintf(path, sizeof path, "%s/%s", w->tmp_dir, receipt) >= (int)sizeof path)
        rc = fail(err, err_len, "%s/%s: path too long", w->tmp_dir, receipt);
    else
        rc = ck_write_file_atomic(path, text.buf, text.len, err, err_len);
    jw_free(&text);
    ckpt_abort(w);
    return rc;
}

/* One receipt line "<name> <bytes> <crc32c>" into the owner's list, after the checks of the owner's
 * own files (ckpt_new_file) and that the file is there with that size. */
static int ckpt_receipt_line(CkptWriter* w, const char* rpath, const char* line, char* err, size_t err_len) {
    char name[CKPT_NAME_MAX], *digits_end = NULL;
    const char* bytes_text = strchr(line, ' ');
    const char* crc_text = bytes_text ? strchr(bytes_text + 1, ' ') : NULL;
    size_t name_len = bytes_text ? (size_t)(bytes_text - line) : 0;
    unsigned long long bytes = crc_text && bytes_text[1] >= '0' && bytes_text[1] <= '9'
                                   ? strtoull(bytes_text + 1, &digits_end, 10) : 0;
    uint32_t crc;
    if (!crc_text || digits_end != crc_text || name_len >= CKPT_NAME_MAX || ckpt_parse_crc(crc_text + 1, &crc))
        return fail(err, err_len, "%s: not a receipt line: '%.60s'", rpath, line);
    memcpy(name, line, name_len);
    name[name_len] = '\0';
    char path[CK_PATH_MAX], why[CK_PATH_MAX + 256];
    struct stat st;
    if (ckpt_new_file(w, name, path, why, sizeof why)) return fail(err, err_len, "%s: %s", rpath, why);
    if (stat(path, &st) != 0 || (uint64_t)st.st_size != bytes)
        return fail(err, err_len, "%s: listed in %s with %llu bytes, but it is missing or of another size", path,
                    rpath, bytes);
    ckpt_record_file(w, name, bytes, crc);
    return 0;
}

/* The owner waits up to timeout_s for another writer's receipt, adds the files it lists to the
 * checkpoint (or fails with the other writer's reason), and removes it. */
static int ckpt_take_receipt(CkptWriter* w, const char* receipt, double timeout_s, char* err, size_t err_len) {
    char rpath[CK_PATH_MAX];
    if (snprintf(rpath, sizeof rpath, "%s/%s", w->tmp_dir, receipt) >= (int)sizeof rpath)
        return fail(err, err_len, "%s/%s: path too long", w->tmp_dir, receipt);
    if (ck_wait_for(rpath, 0, timeout_s)) return fail(err, err_len, "%s: did not arrive within %.0f s", rpath, timeout_s);
    char* text;
    size_t len;
    if (read_whole_file(rpath, CKPT_RECEIPT_MAX, &text, &len, err, err_len)) return -1;
    int rc = 0;
    if (strncmp(text, "failed: ", 8) == 0) {
        text[strcspn(text, "\n")] = '\0';
        rc = fail(err, err_len, "another rank: %s", text + 8);
    }
    for (char *line = text, *end; !rc && *line; line = end + 1) {
        end = strchr(line, '\n');
        if (!end) { rc = fail(err, err_len, "%s: the last line is unfinished", rpath); break; }
        *end = '\0';
        rc = ckpt_receipt_line(w, rpath, line, err, err_len);
    }
    free(text);
    if (!rc && unlink(rpath) != 0) rc = fail_errno(err, err_len, errno, "remove %s", rpath);
    return rc;
}

/* Removes what crashed runs left in out_dir: ckpt_*.tmp directories and latest.tmp. Call once at
 * startup, before the first ckpt_begin. Returns the number of entries removed, or -1. */
static int ckpt_cleanup(const char* out_dir, char* err, size_t err_len) {
    DIR* d = opendir(out_dir);
    if (!d) return errno == ENOENT ? 0 : fail_errno(err, err_len, errno, "open directory %s", out_dir);
    int removed = 0, rc = 0;
    struct dirent* e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        size_t n = strlen(e->d_name);
        int stale = strcmp(e->d_name, "latest.tmp") == 0 ||
                    (strncmp(e->d_name, "ckpt_", 5) == 0 && n > 9 && strcmp(e->d_name + n - 4, ".tmp") == 0);
        if (!stale) continue;
        char path[CK_PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", out_dir, e->d_name) >= (int)sizeof path)
            rc = fail(err, err_len, "%s/%s: path too long", out_dir, e->d_name);
        else if (!(rc = ck_rmtree(path, err, err_len)))
            removed++;
    }
    closedir(d);
    if (rc == 0 && removed) rc = ck_fsync_dir(out_dir, err, err_len);
    return rc ? -1 : removed;
}

/* The checkpoint directory to resume from: the one `latest` names. Returns 0 with its path in
 * path; or 1 if `latest` was missing or named a directory that is not there (a crash during a
 * replacement), with the newest complete ckpt_<step> in path and the reason in err, for the caller
 * to print; or -1 if there is no checkpoint at all. */
static int ckpt_resolve_latest(const char* out_dir, char* path, size_t path_len, char* err, size_t err_len) {
    char latest[CK_PATH_MAX], why[CK_PATH_MAX + 128];
    char* text;
    size_t n;
    struct stat st;
    if (snprintf(latest, sizeof latest, "%s/latest", out_dir) >= (int)sizeof latest)
        return fail(err, err_len, "%s: path too long", out_dir);
    if (read_whole_file(latest, 256, &text, &n, why, sizeof why) == 0) {
        while (n && (text[n - 1] == '\n' || text[n - 1] == ' ')) text[--n] = '\0';
        int ok = ckpt_parse_dirname(text) >= 0 &&
                 snprintf(path, path_len, "%s/%s", out_dir, text) < (int)path_len;
        if (ok && stat(path, &st) == 0 && S_ISDIR(st.st_mode)) { free(text); return 0; }
        snprintf(why, sizeof why, "%s names '%s', which is not a checkpoint directory there", latest, text);
        free(text);
    }
    int64_t* steps;
    int count;
    if (ckpt_list(out_dir, &steps, &count, err, err_len)) return -1;
    int64_t newest = count ? steps[0] : -1;
    free(steps);
    if (newest < 0) return fail(err, err_len, "%s: no checkpoint to resume from (%s)", out_dir, why);
    if (snprintf(path, path_len, "%s/ckpt_%" PRId64, out_dir, newest) >= (int)path_len)
        return fail(err, err_len, "%s: path too long", out_dir);
    fail(err, err_len, "%s; using %s, the newest checkpoint directory", why, path);
    return 1;
}

static void ckpt_close(CkptReader* r) {
    json_free(&r->manifest);
    free(r->files);
    memset(r, 0, sizeof *r);
}

static const CkptFileInfo* ckpt_find_file(const CkptReader* r, const char* name) {
    for (int i = 0; i < r->n_files; i++)
        if (strcmp(r->files[i].name, name) == 0) return &r->files[i];
    return NULL;
}

/* Parses and checks manifest.json into r (files, step, config). */
static int ckpt_parse_manifest(CkptReader* r, const char* mpath, const char* text, size_t len, char* err, size_t err_len) {
    char why[256];
    if (json_parse(&r->manifest, text, len, why, sizeof why)) return fail(err, err_len, "%s: %s", mpath, why);
    const JsonDoc* m = &r->manifest;
    const JsonNode* root = json_root(m);
    const char* format;
    int64_t version;
    if (json_get_string(m, root, "format", &format) || strcmp(format, CKPT_FORMAT) != 0)
        return fail(err, err_len, "%s: not a train_gpt checkpoint manifest (no \"format\": \"" CKPT_FORMAT "\")", mpath);
    if (json_get_int(m, root, "version", &version))
        return fail(err, err_len, "%s: no integer \"version\"", mpath);
    if (version != CKPT_VERSION)
        return fail(err, err_len, "%s: format version %" PRId64 ", but this train_gpt reads version %d",
                    mpath, version, CKPT_VERSION);
    if (json_get_int(m, root, "step", &r->step) || r->step < 0)
        return fail(err, err_len, "%s: no \"step\" (a non-negative integer)", mpath);
    r->config = json_get(m, root, "config");
    if (!r->config || r->config->type != JSON_OBJECT) return fail(err, err_len, "%s: no \"config\" object", mpath);
    const JsonNode* files = json_get(m, root, "files");
    if (!files || files->type != JSON_OBJECT) return fail(err, err_len, "%s: no \"files\" object", mpath);
    r->files = (CkptFileInfo*)calloc((size_t)files->count + 1, sizeof(CkptFileInfo));
    if (!r->files) return fail(err, err_len, "%s: out of memory", mpath);
    for (const JsonNode* f = json_first(m, files); f; f = json_next(m, f)) {
        int64_t bytes;
        const char* crc;
        uint32_t crc_value;
        if (!ckpt_valid_name(f->key)) return fail(err, err_len, "%s: invalid file name '%s'", mpath, f->key);
        if (json_get_int(m, f, "bytes", &bytes) || bytes < 0 || json_get_string(m, f, "crc32c", &crc) ||
            ckpt_parse_crc(crc, &crc_value))
            return fail(err, err_len, "%s: file '%s' needs \"bytes\" (an integer) and \"crc32c\" (8 hex digits)",
                        mpath, f->key);
        CkptFileInfo* info = &r->files[r->n_files++];
        snprintf(info->name, sizeof info->name, "%s", f->key);
        info->bytes = (uint64_t)bytes;
        info->crc32c = crc_value;
    }
    return 0;
}

/* Checks one listed file's size and, if read_through, its CRC32C, reading it through in 8 MiB
 * pieces. */
static int ckpt_verify_file(const CkptReader* r, const CkptFileInfo* info, int read_through, char* err,
                            size_t err_len) {
    char path[CK_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", r->dir, info->name) >= (int)sizeof path)
        return fail(err, err_len, "%s/%s: path too long", r->dir, info->name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail_errno(err, err_len, errno, "%s: listed in the manifest but cannot be opened", path);
    struct stat st;
    if (fstat(fd, &st) != 0) { int e = errno; close(fd); return fail_errno(err, err_len, e, "stat %s", path); }
    if ((uint64_t)st.st_size != info->bytes) {
        close(fd);
        return fail(err, err_len, "%s: %lld bytes, but the manifest says %" PRIu64 ": the file is %s",
                    path, (long long)st.st_size, info->bytes,
                    (uint64_t)st.st_size < info->bytes ? "truncated" : "not the one the manifest describes");
    }
    if (!read_through) {
        close(fd);
        return 0;
    }
    size_t cap = (size_t)8 << 20;
    uint8_t* buf = (uint8_t*)malloc(cap);
    if (!buf) { close(fd); return fail(err, err_len, "%s: out of memory", path); }
    uint32_t crc = 0;
    uint64_t left = info->bytes;
    int rc = 0;
    while (left && !rc) {
        ssize_t got = read(fd, buf, left < cap ? (size_t)left : cap);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) rc = fail_errno(err, err_len, errno, "read %s", path);
        else if (got == 0) rc = fail(err, err_len, "%s: file shrank while being read", path);
        else { crc = crc32c(crc, buf, (size_t)got); left -= (uint64_t)got; }
    }
    free(buf);
    close(fd);
    if (!rc && crc != info->crc32c)
        rc = fail(err, err_len, "%s: CRC32C %08x, but the manifest says %08x: the file is corrupted",
                  path, crc, info->crc32c);
    return rc;
}

/* Parses a checkpoint directory's manifest into r and checks every listed file: its size, and if
 * read_through its CRC32C. On failure r is left closed and err names the file at fault. */
static int ckpt_open_checking(CkptReader* r, const char* dir, int read_through, char* err, size_t err_len) {
    memset(r, 0, sizeof *r);
    char mpath[CK_PATH_MAX];
    if (snprintf(r->dir, sizeof r->dir, "%s", dir) >= (int)sizeof r->dir ||
        snprintf(mpath, sizeof mpath, "%s/" CKPT_MANIFEST, dir) >= (int)sizeof mpath)
        return fail(err, err_len, "%s: path too long", dir);
    char* text;
    size_t len;
    if (read_whole_file(mpath, CKPT_MANIFEST_MAX, &text, &len, err, err_len)) return -1;
    int rc = ckpt_parse_manifest(r, mpath, text, len, err, err_len);
    free(text);
    for (int i = 0; i < r->n_files && !rc; i++) rc = ckpt_verify_file(r, &r->files[i], read_through, err, err_len);
    if (rc) ckpt_close(r);
    return rc;
}

/* Opens a checkpoint directory, verifying every file's size and CRC32C. */
static int ckpt_open(CkptReader* r, const char* dir, char* err, size_t err_len) {
    return ckpt_open_checking(r, dir, 1, err, err_len);
}

/* The manifest and the files' sizes only: the check a run makes in milliseconds before it commits
 * to a GPU; ckpt_open reads the files through when it loads them. */
static int ckpt_peek(CkptReader* r, const char* dir, char* err, size_t err_len) {
    return ckpt_open_checking(r, dir, 0, err, err_len);
}

/* Reads a listed file whole into a malloc'd buffer (NUL-terminated, for JSON), verifying its size
 * and CRC32C again, as it may have changed since ckpt_open. The caller frees *data. */
static int ckpt_read_file(const CkptReader* r, const char* name, void** data, size_t* n, char* err, size_t err_len) {
    *data = NULL;
    *n = 0;
    const CkptFileInfo* info = ckpt_find_file(r, name);
    if (!info) return fail(err, err_len, "%s: the manifest lists no file '%s'", r->dir, name);
    char path[CK_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", r->dir, name) >= (int)sizeof path)
        return fail(err, err_len, "%s/%s: path too long", r->dir, name);
    char* buf;
    size_t len;
    if (read_whole_file(path, (size_t)info->bytes, &buf, &len, err, err_len)) return -1;
    uint32_t crc = crc32c(0, buf, len);
    if (len != info->bytes || crc != info->crc32c) {
        free(buf);
        return fail(err, err_len, "%s: %zu bytes with CRC32C %08x, but the manifest says %" PRIu64 " bytes with %08x",
                    path, len, crc, info->bytes, info->crc32c);
    }
    *data = buf;
    *n = len;
    return 0;
}

/* Opens a listed safetensors file of the checkpoint (verified by ckpt_open). */
static int ckpt_open_safetensors(const CkptReader* r, const char* name, StFile* f, char* err, size_t err_len) {
    memset(f, 0, sizeof *f);
    if (!ckpt_find_file(r, name)) return fail(err, err_len, "%s: the manifest lists no file '%s'", r->dir, name);
    char path[CK_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", r->dir, name) >= (int)sizeof path)
        return fail(err, err_len, "%s/%s: path too long", r->dir, name);
    return st_open(f, path, err, err_len);
}

#endif
