/*
 * test/test_ckpt.h - CPU tests of ckpt.h: CRC32C, the JSON writer and reader, safetensors files (our
 * reader, an independent Python reader, and every malformed file the reader must reject), and the
 * checkpoint directory protocol (round trip, corruption, crashes between the steps, pruning, write
 * failures that must come back as errors while the previous checkpoint stays loadable, and several
 * writers committing one checkpoint).
 *
 * test_gpt.cu includes this file and runs ckpt_tests. Each test works in its own mkdtemp directory
 * under /tmp and removes it. A "crash" is simulated by stopping the
 * protocol between two of its steps (or by doing by hand what a killed writer leaves behind);
 * errors are checked for naming the file at fault, since that is what a user gets to read.
 */
#ifndef TEST_CKPT_H
#define TEST_CKPT_H

#include "testing.h"
#include "../ckpt.h"

#define CKT_ERR 1024

/* dir/name into buf, a CK_PATH_MAX buffer (test paths are short: it always fits). */
static char* ckt_join(char* buf, const char* dir, const char* name) {
    if (snprintf(buf, CK_PATH_MAX, "%s/%s", dir, name) >= CK_PATH_MAX) buf[0] = '\0';
    return buf;
}

static int ckt_has(const char* s, const char* part) { return s && strstr(s, part) != NULL; }

static int ckt_exists(const char* path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

/* A hand-made safetensors file: the 8-byte length, the header text as given, then data. */
static int ckt_write_st_raw(const char* path, const char* header, const void* data, size_t n) {
    size_t hlen = strlen(header);
    uint8_t* buf = (uint8_t*)malloc(8 + hlen + n + 1);
    for (int b = 0; b < 8; b++) buf[b] = (uint8_t)((uint64_t)hlen >> (8 * b));
    memcpy(buf + 8, header, hlen);
    if (n) memcpy(buf + 8 + hlen, data, n);
    int rc = test_write_file(path, buf, 8 + hlen + n);
    free(buf);
    return rc;
}

/* Flips the lowest bit of the byte `from_end` bytes before the end of the file. */
static void ckt_flip_byte(const char* path, long from_end) {
    FILE* f = fopen(path, "r+b");
    if (!f) return;
    fseek(f, -from_end, SEEK_END);
    long offset = ftell(f);
    int c = fgetc(f);
    fseek(f, offset, SEEK_SET);
    fputc(c ^ 0x01, f);
    fclose(f);
}

static void ckt_fill(uint8_t* p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint8_t)(seed >> 24);
    }
}

/* A small complete checkpoint: model.safetensors (one F32 [4] tensor, values step + i) and
 * state.json. */
static int ckt_commit_simple(const char* out, int64_t step, int keep_last, char* err) {
    float w[4];
    for (int i = 0; i < 4; i++) w[i] = (float)step + (float)i;
    StTensor t = {"w", ST_F32, 1, {4}, w};
    char state[64];
    snprintf(state, sizeof state, "{\"step\": %" PRId64 "}", step);
    CkptWriter cw;
    if (ckpt_begin(&cw, out, step, err, CKT_ERR) ||
        ckpt_add_safetensors(&cw, "model.safetensors", &t, 1, NULL, 0, err, CKT_ERR) ||
        ckpt_add_file(&cw, "state.json", state, strlen(state), err, CKT_ERR) ||
        ckpt_commit(&cw, "{\"n_layer\": 2}", keep_last, err, CKT_ERR)) {
        ckpt_abort(&cw);
        return -1;
    }
    return 0;
}

/* Opens the checkpoint `latest` points to; returns its step, or -1. */
static int64_t ckt_latest_step(const char* out, char* err) {
    char path[CK_PATH_MAX];
    CkptReader r;
    if (ckpt_resolve_latest(out, path, sizeof path, err, CKT_ERR) != 0) return -1;
    if (ckpt_open(&r, path, err, CKT_ERR)) return -1;
    int64_t step = r.step;
    ckpt_close(&r);
    return step;
}

/* ---------------------------------------------------------------------------------------------- */

static int test_crc32c_known_answers(void) {
    int failed = 0;
    uint8_t zeros[32], ones[32], inc[32], dec[32];
    for (int i = 0; i < 32; i++) { zeros[i] = 0; ones[i] = 0xFF; inc[i] = (uint8_t)i; dec[i] = (uint8_t)(31 - i); }
    for (int hw = 0; hw <= 1; hw++) {
        /* "123456789" is the standard check value; the 32-byte vectors are RFC 3720's (iSCSI) */
        EXPECT(crc32c_with(hw, 0, "123456789", 9) == 0xE3069283u, "hw=%d: %08x", hw, crc32c_with(hw, 0, "123456789", 9));
        EXPECT(crc32c_with(hw, 0, "", 0) == 0, "hw=%d: empty input", hw);
        EXPECT(crc32c_with(hw, 0, zeros, 32) == 0x8A9136AAu, "hw=%d: zeros %08x", hw, crc32c_with(hw, 0, zeros, 32));
        EXPECT(crc32c_with(hw, 0, ones, 32) == 0x62A8AB43u, "hw=%d: ones %08x", hw, crc32c_with(hw, 0, ones, 32));
        EXPECT(crc32c_with(hw, 0, inc, 32) == 0x46DD794Eu, "hw=%d: incrementing %08x", hw, crc32c_with(hw, 0, inc, 32));
        EXPECT(crc32c_with(hw, 0, dec, 32) == 0x113FDB5Cu, "hw=%d: decrementing %08x", hw, crc32c_with(hw, 0, dec, 32));
    }
    /* both paths agree at every alignment and length, and a CRC continues across pieces */
    uint8_t buf[1100];
    ckt_fill(buf, sizeof buf, 7);
    for (int off = 0; off < 8; off++)
        for (int n = 0; n <= 1090; n += (n < 40 ? 1 : 97)) {
            uint32_t sw = crc32c_with(0, 0, buf + off, (size_t)n);
            uint32_t hw = crc32c_with(1, 0, buf + off, (size_t)n);
            uint32_t split = crc32c(crc32c(0, buf + off, (size_t)n / 3), buf + off + n / 3, (size_t)(n - n / 3));
            EXPECT(sw == hw && hw == split, "offset %d length %d: sw %08x hw %08x split %08x", off, n, sw, hw, split);
        }
    return TEST_RESULT;
}

static int test_json_writer(void) {
    int failed = 0;
    JsonWriter w;
    jw_init(&w, 0);
    jw_object_begin(&w);
    jw_key(&w, "s");
    jw_string(&w, "q\" b\\ n\n t\t c\x01 \xc3\xa9");
    jw_key(&w, "n");
    jw_array_begin(&w);
    jw_double(&w, 0.1);
    jw_double(&w, 1e-6);
    jw_double(&w, 10000.0);
    jw_float(&w, 1e-6f);
    jw_float(&w, 0.1f);
    jw_double(&w, -0.0);
    jw_double(&w, NAN);
    jw_double(&w, -INFINITY);
    jw_int(&w, INT64_MAX);
    jw_int(&w, -3);
    jw_array_end(&w);
    jw_key(&w, "o");
    jw_object_begin(&w);
    jw_object_end(&w);
    jw_key(&w, "b");
    jw_bool(&w, 1);
    jw_key(&w, "z");
    jw_null(&w);
    jw_key(&w, "r");
    jw_raw(&w, "{\"x\": [1, 2]}");
    jw_object_end(&w);
    const char* want = "{\"s\":\"q\\\" b\\\\ n\\n t\\t c\\u0001 \xc3\xa9\",\"n\":[0.1,1e-06,10000.0,1e-06,0.1,-0.0,NaN,"
                       "-Infinity,9223372036854775807,-3],\"o\":{},\"b\":true,\"z\":null,\"r\":{\"x\": [1, 2]}}";
    EXPECT(jw_text(&w) && strcmp(jw_text(&w), want) == 0, "got  %s\n    want %s", jw_text(&w), want);

    /* what it wrote reads back to the same values */
    JsonDoc d;
    char err[CKT_ERR];
    const char* s = NULL;
    int64_t i = 0;
    EXPECT(json_parse(&d, w.buf, w.len, err, sizeof err) == 0, "%s", err);
    const JsonNode* n = json_get(&d, json_root(&d), "n");
    EXPECT(json_get_string(&d, json_root(&d), "s", &s) == 0 && strcmp(s, "q\" b\\ n\n t\t c\x01 \xc3\xa9") == 0, "s");
    EXPECT(n && n->count == 10 && json_first(&d, n)->num == 0.1 && json_next(&d, json_first(&d, n))->num == 1e-6, "n");
    EXPECT(n && n->count == 10 && d.nodes[n->child + 8].is_int && d.nodes[n->child + 8].i == INT64_MAX, "int64 max");
    EXPECT(n && n->count == 10 && isnan(d.nodes[n->child + 6].num) && isinf(d.nodes[n->child + 7].num), "NaN, -Infinity");
    EXPECT(json_get_int(&d, json_get(&d, json_root(&d), "r"), "x", &i) == -1, "x is an array, not an int");
    json_free(&d);
    jw_free(&w);

    /* pretty: one member a line, arrays inline */
    jw_init(&w, 1);
    jw_object_begin(&w);
    jw_key(&w, "a");
    jw_int(&w, 1);
    jw_key(&w, "b");
    jw_object_begin(&w);
    jw_key(&w, "shape");
    jw_array_begin(&w);
    jw_int(&w, 2);
    jw_int(&w, 3);
    jw_array_end(&w);
    jw_object_end(&w);
    jw_object_end(&w);
    want = "{\n  \"a\": 1,\n  \"b\": {\n    \"shape\": [2, 3]\n  }\n}";
    EXPECT(jw_text(&w) && strcmp(jw_text(&w), want) == 0, "got\n%s\n    want\n%s", jw_text(&w), want);
    jw_free(&w);

    /* unbalanced documents and misplaced keys give no text */
    jw_init(&w, 0);
    jw_object_begin(&w);
    EXPECT(jw_text(&w) == NULL, "an open object has no text");
    jw_int(&w, 1);
    jw_object_end(&w);
    jw_free(&w);
    jw_init(&w, 0);
    jw_array_begin(&w);
    jw_key(&w, "k");
    jw_array_end(&w);
    EXPECT(jw_text(&w) == NULL, "a key in an array is a misuse");
    jw_free(&w);
    return TEST_RESULT;
}

static int test_json_reader(void) {
    int failed = 0;
    char err[CKT_ERR];
    JsonDoc d;
    /* the shape of transformers' config.json, plus the corners of the grammar */
    const char* text =
        " {\"architectures\": [\"Qwen3ForCausalLM\"], \"num_hidden_layers\": 12, \"rms_norm_eps\": 1e-06,\n"
        "  \"rope_theta\": 10000.0, \"tie_word_embeddings\": true, \"rope_scaling\": null, \"use_sliding_window\": false,\n"
        "  \"big\": 12345678901234567, \"neg\": -0, \"exp\": -1.5E+3, \"esc\": \"\\u00e9\\ud83d\\ude00\\/\\\"\",\n"
        "  \"nested\": {\"a\": [[], {}, [1, [2]]]}, \"twelve\": 12.0, \"half\": 12.5, \"huge\": 1e300} ";
    EXPECT(json_parse(&d, text, strlen(text), err, sizeof err) == 0, "%s", err);
    if (d.n) {
        const JsonNode* r = json_root(&d);
        int64_t i = 0;
        double x = 0;
        int b = -1;
        const char* s = NULL;
        EXPECT(r->type == JSON_OBJECT && r->count == 15, "root: type %d, %d members", (int)r->type, r->count);
        EXPECT(json_get_int(&d, r, "num_hidden_layers", &i) == 0 && i == 12, "num_hidden_layers %" PRId64, i);
        EXPECT(json_get_double(&d, r, "rms_norm_eps", &x) == 0 && x == 1e-6, "rms_norm_eps %g", x);
        EXPECT(json_get_double(&d, r, "rope_theta", &x) == 0 && x == 10000.0, "rope_theta %g", x);
        EXPECT(json_get_bool(&d, r, "tie_word_embeddings", &b) == 0 && b == 1, "tie_word_embeddings");
        EXPECT(json_get_bool(&d, r, "use_sliding_window", &b) == 0 && b == 0, "use_sliding_window");
        EXPECT(json_get(&d, r, "rope_scaling") && json_get(&d, r, "rope_scaling")->type == JSON_NULL, "null");
        EXPECT(json_get_int(&d, r, "big", &i) == 0 && i == 12345678901234567LL, "big %" PRId64, i);
        EXPECT(json_get_double(&d, r, "exp", &x) == 0 && x == -1500.0, "exp %g", x);
        EXPECT(json_get_string(&d, r, "esc", &s) == 0 && strcmp(s, "\xc3\xa9\xf0\x9f\x98\x80/\"") == 0, "esc '%s'", s);
        EXPECT(json_get_int(&d, r, "twelve", &i) == 0 && i == 12, "12.0 reads as an integer");
        EXPECT(json_get_int(&d, r, "half", &i) == -1, "12.5 is not an integer");
        EXPECT(json_get_int(&d, r, "huge", &i) == -1, "1e300 is not an int64");
        EXPECT(json_get_int(&d, r, "missing", &i) == -1 && json_get_string(&d, r, "big", &s) == -1, "missing / wrong type");
        const JsonNode* a = json_get(&d, json_get(&d, r, "nested"), "a");
        const JsonNode* third = json_next(&d, json_next(&d, json_first(&d, a)));
        EXPECT(a && a->count == 3 && third && third->count == 2 && json_first(&d, json_first(&d, a)) == NULL,
               "nested arrays");
        const JsonNode* first = json_first(&d, r);
        EXPECT(first && strcmp(first->key, "architectures") == 0 && strcmp(json_first(&d, first)->str, "Qwen3ForCausalLM") == 0,
               "architectures");
        json_free(&d);
    }
    const char* bad[] = {
        "", "   ", "{", "{\"a\":}", "[1,]", "{\"a\" 1}", "{\"a\":1,}", "01", "1.", ".5", "+1", "1e", "0x10", "tru",
        "nul", "[1] x", "\"abc", "\"\\x\"", "\"a\x01\"", "\"\\ud800\"", "\"\\udc00\"", "\"\\u12\"", "{1: 2}",
        "[\"a\" \"b\"]", "-", "[", "}", "nan", "inf", "\"\\u0000\"",
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        err[0] = '\0';
        int rc = json_parse(&d, bad[k], strlen(bad[k]), err, sizeof err);
        EXPECT(rc == -1 && ckt_has(err, "bad JSON at byte") && d.n == 0, "'%s' accepted (err '%s')", bad[k], err);
    }
    /* nesting deeper than 64 levels is refused rather than recursing without bound */
    char deep[200];
    memset(deep, '[', 65);
    memset(deep + 65, ']', 65);
    EXPECT(json_parse(&d, deep, 130, err, sizeof err) == -1 && ckt_has(err, "deeper"), "65 levels: %s", err);
    EXPECT(json_parse(&d, deep + 1, 128, err, sizeof err) == 0, "64 levels: %s", err);
    json_free(&d);
    return TEST_RESULT;
}

/* Every dtype and rank 0 to 4, a zero-size tensor, and metadata, written and read back. */
#define CKT_N_TENSORS 16
static int ckt_make_tensors(StTensor* t, uint8_t* storage) {
    static const struct { const char* name; StDtype dt; int ndim; int64_t shape[4]; } spec[CKT_N_TENSORS] = {
        {"a.scalar_f32", ST_F32, 0, {0}},           {"b.bf16", ST_BF16, 1, {3}},
        {"c.f16", ST_F16, 2, {2, 3}},               {"d.i32", ST_I32, 3, {2, 1, 3}},
        {"e.i64", ST_I64, 4, {1, 2, 1, 3}},         {"f.u8_odd", ST_U8, 1, {5}},
        {"g.u16", ST_U16, 1, {3}},                  {"h.bool", ST_BOOL, 1, {3}},
        {"i.i8", ST_I8, 2, {1, 3}},                 {"j.f64", ST_F64, 1, {2}},
        {"k.u32", ST_U32, 1, {1}},                  {"l.u64", ST_U64, 1, {2}},
        {"m.i16", ST_I16, 1, {3}},                  {"n.f8e4m3", ST_F8_E4M3, 1, {3}},
        {"o.f8e5m2", ST_F8_E5M2, 1, {1}},           {"p.empty_f32", ST_F32, 2, {0, 4}},
    };
    size_t off = 0;
    for (int i = 0; i < CKT_N_TENSORS; i++) {
        memset(&t[i], 0, sizeof t[i]);
        t[i].name = spec[i].name;
        t[i].dtype = spec[i].dt;
        t[i].ndim = spec[i].ndim;
        memcpy(t[i].shape, spec[i].shape, sizeof spec[i].shape);
        t[i].data = storage + off;
        ckt_fill(storage + off, (size_t)st_nbytes(&t[i]), 100u + (uint32_t)i);
        off += (size_t)st_nbytes(&t[i]);
    }
    return (int)off;
}

static int test_safetensors_roundtrip(void) {
    int failed = 0;
    char dir[64], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(path, dir, "all.safetensors");
    StTensor t[CKT_N_TENSORS];
    uint8_t storage[512];
    ckt_make_tensors(t, storage);
    const char* meta[] = {"format", "pt", "note", "quote \" backslash \\ newline \n end"};
    EXPECT(st_write(path, t, CKT_N_TENSORS, meta, 2, err, sizeof err) == 0, "%s", err);
    char tmp[CK_PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    EXPECT(!ckt_exists(tmp), "the tmp file is gone after the rename");
    StFile f;
    int rc = st_open(&f, path, err, sizeof err);
    EXPECT(rc == 0, "%s", err);
    if (rc == 0) {
        EXPECT(f.n_tensors == CKT_N_TENSORS, "%d tensors", f.n_tensors);
        for (int i = 0; i < CKT_N_TENSORS; i++) {
            const StTensor* g = st_find(&f, t[i].name);
            EXPECT(g != NULL, "%s missing", t[i].name);
            if (!g) continue;
            int same_shape = g->ndim == t[i].ndim;
            for (int k = 0; k < g->ndim && same_shape; k++) same_shape = g->shape[k] == t[i].shape[k];
            size_t nb = (size_t)st_nbytes(&t[i]);
            EXPECT(g->dtype == t[i].dtype && same_shape, "%s: dtype %s ndim %d", t[i].name, st_dtype_name(g->dtype), g->ndim);
            EXPECT(nb == 0 || memcmp(g->data, t[i].data, nb) == 0, "%s: bytes differ", t[i].name);
            EXPECT((uintptr_t)g->data % (uintptr_t)st_dtype_size(g->dtype) == 0, "%s: unaligned", t[i].name);
        }
        for (int i = 1; i < f.n_tensors; i++)
            EXPECT(st_dtype_size(f.tensors[i].dtype) <= st_dtype_size(f.tensors[i - 1].dtype),
                   "file order: %s before %s", f.tensors[i - 1].name, f.tensors[i].name);
        EXPECT(f.n_meta == 2 && st_meta(&f, "format") && strcmp(st_meta(&f, "format"), "pt") == 0, "metadata format");
        EXPECT(st_meta(&f, "note") && strcmp(st_meta(&f, "note"), meta[3]) == 0, "metadata note");
        EXPECT(st_find(&f, "nope") == NULL && st_meta(&f, "nope") == NULL, "absent names");
        st_close(&f);
    }
    /* no tensors at all is a valid file too */
    EXPECT(st_write(path, NULL, 0, NULL, 0, err, sizeof err) == 0, "%s", err);
    EXPECT(st_open(&f, path, err, sizeof err) == 0 && f.n_tensors == 0, "%s", err);
    st_close(&f);
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* The bytes on disk: header length a multiple of 8, padded with spaces, data exactly after. */
static int test_safetensors_header_layout(void) {
    int failed = 0;
    char dir[64], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(path, dir, "x.safetensors");
    uint16_t v[3] = {1, 2, 3};
    for (int len = 1; len <= 8; len++) {  /* name lengths that leave every possible remainder mod 8 */
        char name[16] = "xxxxxxxx";
        name[len] = '\0';
        StTensor t = {name, ST_U16, 1, {3}, v};
        EXPECT(st_write(path, &t, 1, NULL, 0, err, sizeof err) == 0, "%s", err);
        char* b;
        size_t n;
        if (read_whole_file(path, 1 << 20, &b, &n, err, sizeof err)) { EXPECT(0, "%s", err); continue; }
        uint64_t h = 0;
        for (int k = 0; k < 8; k++) h |= (uint64_t)(uint8_t)b[k] << (8 * k);
        char want[128];
        snprintf(want, sizeof want, "{\"%s\":{\"dtype\":\"U16\",\"shape\":[3],\"data_offsets\":[0,6]}}", name);
        size_t wl = strlen(want);
        int spaces = 1;
        for (size_t k = wl; k < h; k++) spaces &= b[8 + k] == ' ';
        EXPECT(h % 8 == 0 && h >= wl && h < wl + 8, "name length %d: header length %" PRIu64 " for %zu bytes of JSON", len, h, wl);
        EXPECT(n == 8 + h + 6 && memcmp(b + 8, want, wl) == 0 && spaces, "name length %d: header '%.*s'", len, (int)h, b + 8);
        EXPECT(n == 8 + h + 6 && memcmp(b + 8 + h, v, 6) == 0, "name length %d: data after the header", len);
        free(b);
    }
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* A reader that shares no code with ours: Python's struct and json, checking the spec's rules. */
static const char* ckt_python_reader =
    "import json, struct, sys\n"
    "SIZES = {'BOOL': 1, 'U8': 1, 'I8': 1, 'F8_E4M3': 1, 'F8_E5M2': 1, 'U16': 2, 'I16': 2, 'F16': 2,\n"
    "         'BF16': 2, 'U32': 4, 'I32': 4, 'F32': 4, 'U64': 8, 'I64': 8, 'F64': 8}\n"
    "b = open(sys.argv[1], 'rb').read()\n"
    "(n,) = struct.unpack('<Q', b[:8])\n"
    "assert 8 + n <= len(b) and n % 8 == 0, 'header length'\n"
    "raw = b[8:8 + n].decode('utf-8')\n"
    "assert raw.startswith('{') and raw.rstrip(' ').endswith('}'), 'header padding'\n"
    "h = json.loads(raw)\n"
    "meta = h.pop('__metadata__', {})\n"
    "data = b[8 + n:]\n"
    "end = 0\n"
    "for name, t in sorted(h.items(), key=lambda kv: kv[1]['data_offsets']):\n"
    "    s, e = t['data_offsets']\n"
    "    numel = 1\n"
    "    for d in t['shape']: numel *= d\n"
    "    assert s == end and e - s == numel * SIZES[t['dtype']], name + ': offsets'\n"
    "    assert (8 + n + s) % SIZES[t['dtype']] == 0, name + ': alignment'\n"
    "    end = e\n"
    "assert end == len(data), 'bytes after the last tensor'\n"
    "for k in sorted(meta): print('meta', k, meta[k])\n"
    "for name in sorted(h):\n"
    "    t = h[name]; s, e = t['data_offsets']\n"
    "    print(name, t['dtype'], ','.join(map(str, t['shape'])), data[s:e].hex())\n"
    "print('OK')\n";

static int test_safetensors_python_reader(void) {
    int failed = 0;
    if (system("python3 -c pass >/dev/null 2>&1") != 0) return TEST_SKIP;
    char dir[64], path[CK_PATH_MAX], script[CK_PATH_MAX], cmd[3 * CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(path, dir, "all.safetensors");
    ckt_join(script, dir, "reader.py");
    StTensor t[CKT_N_TENSORS];
    uint8_t storage[512];
    ckt_make_tensors(t, storage);
    const char* meta[] = {"format", "pt", "producer", "train_gpt"};
    EXPECT(st_write(path, t, CKT_N_TENSORS, meta, 2, err, sizeof err) == 0, "%s", err);
    EXPECT(test_write_file(script, ckt_python_reader, strlen(ckt_python_reader)) == 0, "write %s", script);
    /* what the Python reader must print: metadata, then each tensor (names are in sorted order) */
    char want[8192], got[8192];
    size_t wl = (size_t)snprintf(want, sizeof want, "meta format pt\nmeta producer train_gpt\n");
    for (int i = 0; i < CKT_N_TENSORS; i++) {
        wl += (size_t)snprintf(want + wl, sizeof want - wl, "%s %s ", t[i].name, st_dtype_name(t[i].dtype));
        for (int k = 0; k < t[i].ndim; k++)
            wl += (size_t)snprintf(want + wl, sizeof want - wl, k ? ",%" PRId64 : "%" PRId64, t[i].shape[k]);
        wl += (size_t)snprintf(want + wl, sizeof want - wl, " ");
        for (int64_t k = 0; k < st_nbytes(&t[i]); k++)
            wl += (size_t)snprintf(want + wl, sizeof want - wl, "%02x", ((const uint8_t*)t[i].data)[k]);
        wl += (size_t)snprintf(want + wl, sizeof want - wl, "\n");
    }
    snprintf(want + wl, sizeof want - wl, "OK\n");
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' 2>&1", script, path);
    size_t gl = 0;
    FILE* p = popen(cmd, "r");
    if (p) {
        size_t n;
        while (gl < sizeof got - 1 && (n = fread(got + gl, 1, sizeof got - 1 - gl, p)) > 0) gl += n;
        got[gl] = '\0';
        EXPECT(pclose(p) == 0, "python3 reader failed:\n%s", got);
    }
    EXPECT(p && strcmp(got, want) == 0, "python3 reader printed\n%s\n    expected\n%s", p ? got : "", want);
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* Malformed files: each is refused with one message naming the file and the problem. */
static int test_safetensors_rejects_bad_files(void) {
    int failed = 0;
    char dir[64], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(path, dir, "bad.safetensors");
    uint8_t data[32] = {0};
    const struct { const char* header; size_t data_len; const char* expect; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "bad JSON"},
        {"[1, 2]", 0, "does not start with '{'"},
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype \"F33\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, "run past"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20, "gap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "the file holds 12 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, "appears twice"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "shape"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets"},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "dtype"},
        {"{\"__metadata__\":{\"k\":1}}", 0, "not a string"},
        {"{\"a\":[1]}", 0, "not an object"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        ckt_write_st_raw(path, cases[k].header, data, cases[k].data_len);
        StFile f;
        err[0] = '\0';
        int rc = st_open(&f, path, err, sizeof err);
        EXPECT(rc == -1 && ckt_has(err, path) && ckt_has(err, cases[k].expect), "case %zu: rc %d, err '%s', wanted '%s'",
               k, rc, err, cases[k].expect);
    }
    /* truncation: of a real file by one byte, to 4 bytes, and a length that runs past the end */
    float w[4] = {1, 2, 3, 4};
    StTensor t = {"w", ST_F32, 1, {4}, w};
    StFile f;
    struct stat st;
    st_write(path, &t, 1, NULL, 0, err, sizeof err);
    stat(path, &st);
    EXPECT(truncate(path, st.st_size - 1) == 0, "truncate");
    EXPECT(st_open(&f, path, err, sizeof err) == -1 && ckt_has(err, path) && ckt_has(err, "truncated"), "%s", err);
    EXPECT(truncate(path, 4) == 0, "truncate");
    EXPECT(st_open(&f, path, err, sizeof err) == -1 && ckt_has(err, path) && ckt_has(err, "too short"), "%s", err);
    uint8_t huge[16] = {0xe8, 0x03};  /* header length 1000 in a 16-byte file */
    test_write_file(path, huge, sizeof huge);
    EXPECT(st_open(&f, path, err, sizeof err) == -1 && ckt_has(err, "runs past the end"), "%s", err);
    ckt_join(path, dir, "missing.safetensors");
    EXPECT(st_open(&f, path, err, sizeof err) == -1 && ckt_has(err, path) && ckt_has(err, "No such file"), "%s", err);
    /* and the writer refuses what it cannot write, leaving no file behind */
    StTensor dup[2] = {t, t};
    StTensor nodata = {"w", ST_F32, 1, {4}, NULL};
    StTensor rank9 = {"w", ST_F32, 9, {1}, w};
    EXPECT(st_write(path, dup, 2, NULL, 0, err, sizeof err) == -1 && ckt_has(err, "twice"), "%s", err);
    EXPECT(st_write(path, &nodata, 1, NULL, 0, err, sizeof err) == -1 && ckt_has(err, "no data"), "%s", err);
    EXPECT(st_write(path, &rank9, 1, NULL, 0, err, sizeof err) == -1 && ckt_has(err, "shape"), "%s", err);
    char tmp[CK_PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    EXPECT(!ckt_exists(path) && !ckt_exists(tmp), "a refused write leaves no file");
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

static int test_ckpt_roundtrip(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(out, dir, "run/a");  /* created on the way */
    StTensor t[CKT_N_TENSORS];
    uint8_t storage[512], rng[100];
    ckt_make_tensors(t, storage);
    ckt_fill(rng, sizeof rng, 3);
    const char* state = "{\"epoch\": 1, \"position\": 4096}";
    CkptWriter w;
    int rc = ckpt_begin(&w, out, 10, err, sizeof err);
    if (!rc) rc = ckpt_add_safetensors(&w, "model.safetensors", t, CKT_N_TENSORS, NULL, 0, err, sizeof err);
    if (!rc) rc = ckpt_add_file(&w, "loader.json", state, strlen(state), err, sizeof err);
    if (!rc) rc = ckpt_add_file(&w, "rng.bin", rng, sizeof rng, err, sizeof err);
    if (!rc) rc = ckpt_add_file(&w, "empty.bin", NULL, 0, err, sizeof err);
    if (!rc) rc = ckpt_commit(&w, "{\"n_layer\": 12, \"lr\": 0.0006, \"name\": \"d12\"}", 3, err, sizeof err);
    EXPECT(rc == 0, "%s", err);
    ckpt_abort(&w);

    char* latest;
    size_t n;
    ckt_join(path, out, "latest");
    EXPECT(read_whole_file(path, 64, &latest, &n, err, sizeof err) == 0 && strcmp(latest, "ckpt_10\n") == 0, "latest");
    free(latest);
    ckt_join(path, out, "ckpt_10.tmp");
    EXPECT(!ckt_exists(path), "%s left behind", path);
    EXPECT(ckpt_resolve_latest(out, path, sizeof path, err, sizeof err) == 0 && ckt_has(path, "/run/a/ckpt_10"), "%s", path);
    CkptReader r;
    rc = ckpt_open(&r, path, err, sizeof err);
    EXPECT(rc == 0, "%s", err);
    if (rc == 0) {
        int64_t layers = 0;
        double lr = 0;
        EXPECT(r.step == 10 && r.n_files == 4, "step %" PRId64 ", %d files", r.step, r.n_files);
        EXPECT(json_get_int(&r.manifest, r.config, "n_layer", &layers) == 0 && layers == 12, "config n_layer");
        EXPECT(json_get_double(&r.manifest, r.config, "lr", &lr) == 0 && lr == 0.0006, "config lr");
        const CkptFileInfo* info = ckpt_find_file(&r, "rng.bin");
        EXPECT(info && info->bytes == sizeof rng && info->crc32c == crc32c(0, rng, sizeof rng), "rng.bin in the manifest");
        void* data;
        EXPECT(ckpt_read_file(&r, "loader.json", &data, &n, err, sizeof err) == 0 && n == strlen(state) &&
               strcmp((char*)data, state) == 0, "loader.json: %s", err);
        free(data);
        EXPECT(ckpt_read_file(&r, "empty.bin", &data, &n, err, sizeof err) == 0 && n == 0, "empty.bin: %s", err);
        free(data);
        EXPECT(ckpt_read_file(&r, "other.bin", &data, &n, err, sizeof err) == -1 && ckt_has(err, "other.bin"), "%s", err);
        StFile f;
        EXPECT(ckpt_open_safetensors(&r, "model.safetensors", &f, err, sizeof err) == 0, "%s", err);
        for (int i = 0; i < f.n_tensors; i++) {
            const StTensor* g = st_find(&f, t[i].name);
            EXPECT(g && memcmp(g->data, t[i].data, (size_t)st_nbytes(&t[i])) == 0, "%s", t[i].name);
        }
        st_close(&f);
        ckpt_close(&r);
    }
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* A flipped bit, a truncated or missing file, a damaged manifest: one error naming the file. */
static int test_ckpt_detects_damage(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], ck[CK_PATH_MAX], file[CK_PATH_MAX], mpath[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(out, dir, "out");
    ckt_join(ck, out, "ckpt_5");
    ckt_join(file, ck, "model.safetensors");
    ckt_join(mpath, ck, "manifest.json");
    CkptReader r;
    struct stat st;

    EXPECT(ckt_commit_simple(out, 5, 0, err) == 0, "%s", err);
    ckt_flip_byte(file, 3);  /* inside the tensor data */
    EXPECT(ckpt_open(&r, ck, err, sizeof err) == -1 && ckt_has(err, file) && ckt_has(err, "CRC32C"), "flipped: %s", err);

    EXPECT(ckt_commit_simple(out, 5, 0, err) == 0, "%s", err);
    stat(file, &st);
    EXPECT(truncate(file, st.st_size - 3) == 0, "truncate");
    EXPECT(ckpt_open(&r, ck, err, sizeof err) == -1 && ckt_has(err, file) && ckt_has(err, "truncated"), "truncated: %s", err);

    EXPECT(ckt_commit_simple(out, 5, 0, err) == 0, "%s", err);
    unlink(file);
    EXPECT(ckpt_open(&r, ck, err, sizeof err) == -1 && ckt_has(err, file) && ckt_has(err, "No such file"), "missing: %s", err);

    EXPECT(ckt_commit_simple(out, 5, 0, err) == 0, "%s", err);
    unlink(mpath);
    EXPECT(ckpt_open(&r, ck, err, sizeof err) == -1 && ckt_has(err, mpath), "no manifest: %s", err);

    /* manifests that parse but are wrong, each rejected before any file is trusted */
    const struct { const char* text; const char* expect; } manifests[] = {
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5", "bad JSON"},
        {"[]", "not a train_gpt checkpoint"},
        {"{\"format\": \"other\", \"version\": 1, \"step\": 5, \"config\": {}, \"files\": {}}", "not a train_gpt"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 2, \"step\": 5, \"config\": {}, \"files\": {}}", "version 2"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"config\": {}, \"files\": {}}", "step"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"files\": {}}", "config"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}}", "files"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}, "
         "\"files\": {\"../x\": {\"bytes\": 1, \"crc32c\": \"00000000\"}}}", "invalid file name '../x'"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}, "
         "\"files\": {\"manifest.json\": {\"bytes\": 1, \"crc32c\": \"00000000\"}}}", "invalid file name 'manifest.json'"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}, "
         "\"files\": {\"model.safetensors\": {\"bytes\": 1}}}", "crc32c"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}, "
         "\"files\": {\"model.safetensors\": {\"bytes\": 1, \"crc32c\": \"xyz00000\"}}}", "crc32c"},
        {"{\"format\": \"train_gpt checkpoint\", \"version\": 1, \"step\": 5, \"config\": {}, "
         "\"files\": {\"model.safetensors\": {\"bytes\": 1, \"crc32c\": \" 1234567\"}}}", "crc32c"},
    };
    EXPECT(ckt_commit_simple(out, 5, 0, err) == 0, "%s", err);
    for (size_t k = 0; k < sizeof manifests / sizeof manifests[0]; k++) {
        test_write_file(mpath, manifests[k].text, strlen(manifests[k].text));
        err[0] = '\0';
        int rc = ckpt_open(&r, ck, err, sizeof err);
        EXPECT(rc == -1 && ckt_has(err, mpath) && ckt_has(err, manifests[k].expect), "manifest %zu: rc %d, err '%s'", k, rc, err);
    }
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* What a kill -9 can leave behind, at each step of the protocol: the previous checkpoint must stay
 * the one that loads, and startup cleanup must remove the debris. */
static int test_ckpt_crash_between_steps(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(out, dir, "out");
    EXPECT(ckt_commit_simple(out, 10, 0, err) == 0, "%s", err);

    /* killed while writing ckpt_20: a half-written tmp directory with no manifest, and a latest.tmp */
    CkptWriter w;
    uint8_t half[1000] = {0};
    EXPECT(ckpt_begin(&w, out, 20, err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_add_file(&w, "model.safetensors", half, sizeof half, err, sizeof err) == 0, "%s", err);
    free(w.files);  /* the process is gone: no commit, no abort */
    EXPECT(ckt_latest_step(out, err) == 10, "after a crash inside ckpt_20: %s", err);

    /* killed after renaming ckpt_30 into place but before `latest` moved: latest still rules */
    EXPECT(ckt_commit_simple(out, 30, 0, err) == 0, "%s", err);
    ckt_join(path, out, "latest");
    test_write_file(path, "ckpt_10\n", 8);
    EXPECT(ckt_latest_step(out, err) == 10, "after a crash before latest moved: %s", err);

    /* killed while pruning: a directory renamed for deletion, half deleted; and killed while
     * writing `latest`, leaving latest.tmp */
    ckt_join(path, out, "ckpt_3.del.tmp");
    mkdir(path, 0755);
    ckt_join(path, out, "latest.tmp");
    test_write_file(path, "ckpt_3", 6);
    EXPECT(ckt_latest_step(out, err) == 10, "with a stale latest.tmp: %s", err);

    /* startup: cleanup removes exactly the debris */
    int removed = ckpt_cleanup(out, err, sizeof err);
    EXPECT(removed == 3, "removed %d (%s)", removed, err);
    const char* gone[] = {"ckpt_20.tmp", "latest.tmp", "ckpt_3.del.tmp"};
    const char* kept[] = {"ckpt_10", "ckpt_30", "latest"};
    for (int k = 0; k < 3; k++) {
        ckt_join(path, out, gone[k]);
        EXPECT(!ckt_exists(path), "%s still there", path);
        ckt_join(path, out, kept[k]);
        EXPECT(ckt_exists(path), "%s removed", path);
    }
    EXPECT(ckpt_cleanup(out, err, sizeof err) == 0, "nothing left to clean");

    /* the resumed run reaches step 30 again and replaces the stale ckpt_30 */
    EXPECT(ckt_commit_simple(out, 30, 0, err) == 0, "replacing ckpt_30: %s", err);
    EXPECT(ckt_latest_step(out, err) == 30, "%s", err);
    ckt_join(path, out, "ckpt_30.del.tmp");
    EXPECT(!ckt_exists(path), "the replaced directory is removed");

    /* `latest` lost or pointing at nothing (a crash inside a replacement): the newest directory,
     * with the reason for the caller to print */
    ckt_join(path, out, "latest");
    test_write_file(path, "ckpt_99\n", 8);
    char found[CK_PATH_MAX];
    EXPECT(ckpt_resolve_latest(out, found, sizeof found, err, sizeof err) == 1 && ckt_has(found, "ckpt_30") &&
           ckt_has(err, "ckpt_99"), "dangling latest: %s (%s)", found, err);
    unlink(path);
    EXPECT(ckpt_resolve_latest(out, found, sizeof found, err, sizeof err) == 1 && ckt_has(found, "ckpt_30"),
           "no latest: %s (%s)", found, err);
    ckt_join(path, dir, "empty");
    mkdir(path, 0755);
    EXPECT(ckpt_resolve_latest(path, found, sizeof found, err, sizeof err) == -1 && ckt_has(err, "no checkpoint"),
           "empty directory: %s", err);
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

static int test_ckpt_keep_last_k(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(out, dir, "out");
    for (int step = 10; step <= 50; step += 10) EXPECT(ckt_commit_simple(out, step, 2, err) == 0, "%s", err);
    int64_t* steps;
    int n;
    EXPECT(ckpt_list(out, &steps, &n, err, sizeof err) == 0 && n == 2 && steps[0] == 50 && steps[1] == 40,
           "%d left, newest %" PRId64, n, n ? steps[0] : -1);
    free(steps);
    /* names that are not ckpt_<step> as ckpt_begin writes it are not checkpoints: left alone */
    const char* strangers[] = {"ckpt_0040", "ckpt_x", "ckpt_", "notes"};
    for (int k = 0; k < 4; k++) mkdir(ckt_join(path, out, strangers[k]), 0755);
    EXPECT(ckt_commit_simple(out, 55, 1, err) == 0, "%s", err);
    for (int k = 0; k < 4; k++) EXPECT(ckt_exists(ckt_join(path, out, strangers[k])), "%s removed", strangers[k]);
    EXPECT(ckpt_list(out, &steps, &n, err, sizeof err) == 0 && n == 1 && steps[0] == 55, "%d left", n);
    free(steps);
    /* a checkpoint from beyond the current step (the run was resumed from an earlier one) is kept */
    EXPECT(ckt_commit_simple(out, 100, 0, err) == 0, "%s", err);
    ckt_join(path, out, "latest");
    test_write_file(path, "ckpt_55\n", 8);  /* as if resumed from ckpt_55 */
    EXPECT(ckt_commit_simple(out, 60, 2, err) == 0, "%s", err);
    EXPECT(ckpt_list(out, &steps, &n, err, sizeof err) == 0 && n == 3 && steps[0] == 100 && steps[1] == 60 &&
           steps[2] == 55, "%d left", n);
    free(steps);
    EXPECT(ckt_latest_step(out, err) == 60, "%s", err);
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* Unwritable places, a full disk, a write that fails halfway, bad arguments: errors, never a crash,
 * and the previous checkpoint stays the one that loads. */
static int test_ckpt_write_errors(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    /* a path below a regular file cannot be created, even by root */
    ckt_join(path, dir, "file");
    test_write_file(path, "x", 1);
    ckt_join(out, dir, "file/sub");
    CkptWriter w;
    EXPECT(ckpt_begin(&w, out, 1, err, sizeof err) == -1 && ckt_has(err, out) && ckt_has(err, "not a directory"), "%s", err);
    ckpt_abort(&w);
    float x[2] = {1, 2};
    StTensor t = {"x", ST_F32, 1, {2}, x};
    ckt_join(path, dir, "file/sub/x.safetensors");
    EXPECT(st_write(path, &t, 1, NULL, 0, err, sizeof err) == -1 && ckt_has(err, path), "%s", err);

    /* a full disk: /dev/full fails every write with ENOSPC */
    int fd = open("/dev/full", O_WRONLY);
    if (fd >= 0) {
        EXPECT(ck_write_all(fd, x, sizeof x, "/dev/full", err, sizeof err) == -1 && ckt_has(err, "No space left"), "%s", err);
        close(fd);
    }

    ckt_join(out, dir, "out");
    EXPECT(ckt_commit_simple(out, 10, 2, err) == 0, "%s", err);
    /* the disk goes away under a checkpoint in progress */
    EXPECT(ckpt_begin(&w, out, 20, err, sizeof err) == 0, "%s", err);
    ck_rmtree(w.tmp_dir, NULL, 0);
    EXPECT(ckpt_add_file(&w, "state.json", "{}", 2, err, sizeof err) == -1 && ckt_has(err, "ckpt_20.tmp/state.json"),
           "%s", err);
    ckpt_abort(&w);
    /* misuse: bad names, a bad config, commit without begin */
    EXPECT(ckpt_begin(&w, out, 20, err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_add_file(&w, "../evil", "x", 1, err, sizeof err) == -1 && ckt_has(err, "../evil"), "%s", err);
    EXPECT(ckpt_add_file(&w, "manifest.json", "x", 1, err, sizeof err) == -1, "manifest.json is reserved");
    EXPECT(ckpt_add_file(&w, "a.bin", "x", 1, err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_add_file(&w, "a.bin", "x", 1, err, sizeof err) == -1 && ckt_has(err, "twice"), "%s", err);
    EXPECT(ckpt_add_safetensors(&w, "b.safetensors", &t, 1, NULL, 0, err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_commit(&w, "{\"n_layer\": ", 2, err, sizeof err) == -1 && ckt_has(err, "not valid JSON"), "%s", err);
    EXPECT(ckpt_commit(&w, "[1]", 2, err, sizeof err) == -1 && ckt_has(err, "not a JSON object"), "%s", err);
    ckpt_abort(&w);
    EXPECT(ckpt_commit(&w, "{}", 2, err, sizeof err) == -1 && ckt_has(err, "no checkpoint in progress"), "%s", err);
    EXPECT(ckpt_begin(&w, out, -1, err, sizeof err) == -1 && ckt_has(err, "negative"), "%s", err);
    ckpt_abort(&w);

    EXPECT(ckt_latest_step(out, err) == 10, "the previous checkpoint still loads: %s", err);
    ckt_join(path, out, "ckpt_20.tmp");
    EXPECT(!ckt_exists(path), "ckpt_abort removed %s", path);
    ckt_join(path, out, "ckpt_20");
    EXPECT(!ckt_exists(path), "no ckpt_20 after failed attempts");
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

/* Several writers, one checkpoint (ckpt_join, receipts). Writers 1..3 run on threads, as ranks
 * would, each starting before the owner has made the directory; the owner commits once their
 * receipts are in. Then: a writer that fails sends its reason and the owner's commit fails with it,
 * leaving the previous checkpoint as `latest`; a receipt that never comes is a timeout naming it; a
 * receipt that lies about a file's size is refused, and so is every line the owner would refuse as
 * one of its own files (a bad name, a file listed twice); a joiner with nothing to join times out. */
#define CKT_WRITERS 4

typedef struct {
    const char* out;
    int64_t step;
    int index;          /* writer 1..CKT_WRITERS-1 */
    const char* fail;   /* if set, it sends this reason instead of its file */
    int rc;
    char err[CKT_ERR];
} CktWriterJob;

static void* ckt_writer_thread(void* arg) {
    CktWriterJob* j = (CktWriterJob*)arg;
    CkptWriter w;
    char name[32], receipt[32];
    snprintf(name, sizeof name, "shard.%d.bin", j->index);
    snprintf(receipt, sizeof receipt, "receipt.%d", j->index);
    uint8_t bytes[300];
    ckt_fill(bytes, sizeof bytes, 100 + j->index);
    j->rc = ckpt_join(&w, j->out, j->step, 10, j->err, sizeof j->err);
    if (!j->rc && !j->fail) j->rc = ckpt_add_file(&w, name, bytes, 100 + 50 * j->index, j->err, sizeof j->err);
    if (!j->rc) j->rc = ckpt_send_receipt(&w, receipt, j->fail, j->err, sizeof j->err);
    return NULL;
}

/* One checkpoint at `step` by the owner and CKT_WRITERS-1 threads (writer `failing` fails). */
static int ckt_shared_checkpoint(const char* out, int64_t step, int failing, char* err, size_t err_len) {
    pthread_t threads[CKT_WRITERS];
    CktWriterJob jobs[CKT_WRITERS];
    for (int i = 1; i < CKT_WRITERS; i++) {
        jobs[i] = (CktWriterJob){out, step, i, i == failing ? "disk full, say" : NULL, 0, ""};
        pthread_create(&threads[i], NULL, ckt_writer_thread, &jobs[i]);
    }
    sleep_seconds(0.05);  /* the joiners are waiting for the directory now */
    CkptWriter w;
    uint8_t own[64];
    ckt_fill(own, sizeof own, 7);
    int rc = ckpt_begin(&w, out, step, err, err_len);
    if (!rc) rc = ckpt_add_file(&w, "shard.0.bin", own, sizeof own, err, err_len);
    for (int i = 1; !rc && i < CKT_WRITERS; i++) {
        char receipt[32];
        snprintf(receipt, sizeof receipt, "receipt.%d", i);
        rc = ckpt_take_receipt(&w, receipt, 10, err, err_len);
    }
    if (!rc) rc = ckpt_commit(&w, NULL, 0, err, err_len);
    if (rc) ckpt_abort(&w);
    for (int i = 1; i < CKT_WRITERS; i++) pthread_join(threads[i], NULL);
    return rc;
}

/* The owner of checkpoint 6, with its own shard.0.bin, takes receipt.1 holding `text`, beside a
 * shard.1.bin of 12 bytes ("twelve bytes") written as a joiner would; returns what
 * ckpt_take_receipt returns (or -1 if the setup failed, with err). */
static int ckt_take_receipt_text(const char* out, const char* text, char* err, size_t err_len) {
    CkptWriter w;
    char path[CK_PATH_MAX];
    int rc = ckpt_begin(&w, out, 6, err, err_len);
    if (!rc) rc = ckpt_add_file(&w, "shard.0.bin", "owner's", 7, err, err_len);
    if (!rc) rc = ck_write_file_atomic(ckt_join(path, w.tmp_dir, "shard.1.bin"), "twelve bytes", 12, err, err_len);
    if (!rc) rc = ck_write_file_atomic(ckt_join(path, w.tmp_dir, "receipt.1"), text, strlen(text), err, err_len);
    if (!rc) rc = ckpt_take_receipt(&w, "receipt.1", 1, err, err_len);
    ckpt_abort(&w);
    return rc;
}

static int test_ckpt_several_writers(void) {
    int failed = 0;
    char dir[64], out[CK_PATH_MAX], path[CK_PATH_MAX], err[CKT_ERR];
    if (make_test_dir(dir, sizeof dir, "ckpt_test")) return TEST_FAIL;
    ckt_join(out, dir, "out");
    EXPECT(ck_mkdir_p(out, err, sizeof err) == 0, "%s", err);
    EXPECT(ckt_shared_checkpoint(out, 4, 0, err, sizeof err) == 0, "%s", err);
    CkptReader r;
    ckt_join(path, out, "ckpt_4");
    int rc = ckpt_open(&r, path, err, sizeof err);
    EXPECT(rc == 0, "%s", err);
    if (rc == 0) {
        EXPECT(r.n_files == CKT_WRITERS, "%d files in the manifest", r.n_files);
        for (int i = 1; i < CKT_WRITERS; i++) {
            char name[32];
            uint8_t bytes[300];
            ckt_fill(bytes, sizeof bytes, 100 + i);
            snprintf(name, sizeof name, "shard.%d.bin", i);
            const CkptFileInfo* info = ckpt_find_file(&r, name);
            EXPECT(info && info->bytes == (uint64_t)(100 + 50 * i) &&
                   info->crc32c == crc32c(0, bytes, (size_t)(100 + 50 * i)), "%s in the manifest", name);
            snprintf(name, sizeof name, "receipt.%d", i);
            EXPECT(!ckt_exists(ckt_join(path, r.dir, name)), "%s left in the checkpoint", name);
        }
        ckpt_close(&r);
    }
    /* writer 2 fails: no checkpoint 5, and latest still names 4 */
    rc = ckt_shared_checkpoint(out, 5, 2, err, sizeof err);
    EXPECT(rc == -1 && ckt_has(err, "disk full, say"), "a failed writer: %d '%s'", rc, err);
    EXPECT(!ckt_exists(ckt_join(path, out, "ckpt_5")) && !ckt_exists(ckt_join(path, out, "ckpt_5.tmp")),
           "the failed checkpoint left a directory");
    EXPECT(ckpt_resolve_latest(out, path, sizeof path, err, sizeof err) == 0 && ckt_has(path, "ckpt_4"), "%s", path);
    /* a receipt that never comes, and one that lies about its file */
    CkptWriter w;
    EXPECT(ckpt_begin(&w, out, 6, err, sizeof err) == 0, "%s", err);
    double t0 = now_seconds();
    EXPECT(ckpt_take_receipt(&w, "receipt.1", 0.2, err, sizeof err) == -1 && ckt_has(err, "receipt.1") &&
           ckt_has(err, "did not arrive") && now_seconds() - t0 < 2, "missing receipt: %s", err);
    const char* lie = "shard.1.bin 999 0badf00d\n";
    ckt_join(path, w.tmp_dir, "receipt.1");
    EXPECT(ck_write_file_atomic(path, lie, strlen(lie), err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_take_receipt(&w, "receipt.1", 1, err, sizeof err) == -1 && ckt_has(err, "shard.1.bin"),
           "a lying receipt: %s", err);
    const char* garbage = "shard.1.bin 12 xyz\n";
    EXPECT(ck_write_file_atomic(path, garbage, strlen(garbage), err, sizeof err) == 0, "%s", err);
    EXPECT(ckpt_take_receipt(&w, "receipt.1", 1, err, sizeof err) == -1 && ckt_has(err, "not a receipt line"),
           "a garbled receipt: %s", err);
    ckpt_abort(&w);

    /* receipts with lines the owner must refuse, each with one line naming the receipt and the file,
     * beside one it must accept (so that the refusals come from the lines) */
    char good[64];
    snprintf(good, sizeof good, "shard.1.bin 12 %08x\n", crc32c(0, "twelve bytes", 12));
    EXPECT(ckt_take_receipt_text(out, good, err, sizeof err) == 0, "a good receipt: %s", err);
    const struct { const char* text; const char* expect[2]; } refused[] = {
        {"../evil 12 00000000\n", {"'../evil'", "names are"}},
        {"manifest.json 12 00000000\n", {"'manifest.json'", "not manifest.json"}},
        {".hidden 12 00000000\n", {"'.hidden'", "names are"}},
        {"shard.0.bin 7 00000000\n", {"shard.0.bin", "written twice"}},  /* the owner's own */
    };
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++) {
        err[0] = '\0';
        int rc = ckt_take_receipt_text(out, refused[k].text, err, sizeof err);
        EXPECT(rc == -1 && ckt_has(err, "receipt.1: ") && ckt_has(err, refused[k].expect[0]) &&
               ckt_has(err, refused[k].expect[1]) && !strchr(err, '\n'), "'%s': rc %d, err '%s'", refused[k].text, rc, err);
    }
    char twice[128];
    snprintf(twice, sizeof twice, "%s%s", good, good);
    err[0] = '\0';
    rc = ckt_take_receipt_text(out, twice, err, sizeof err);
    EXPECT(rc == -1 && ckt_has(err, "receipt.1: ") && ckt_has(err, "shard.1.bin: written twice") && !strchr(err, '\n'),
           "a receipt naming a file twice: rc %d, err '%s'", rc, err);

    /* ckpt_join shares ckpt_begin's checks, and waits for the owner only so long */
    EXPECT(ckpt_join(&w, out, -1, 1, err, sizeof err) == -1 && ckt_has(err, "negative"), "%s", err);
    t0 = now_seconds();
    EXPECT(ckpt_join(&w, out, 7, 0.2, err, sizeof err) == -1 && ckt_has(err, "ckpt_7.tmp") &&
           ckt_has(err, "not created within") && now_seconds() - t0 < 2, "no owner: %s", err);
    char deep[CK_PATH_MAX], deep_err[CK_PATH_MAX + 64];  /* the error names the whole path */
    memset(deep, 'd', sizeof deep - 8);
    deep[sizeof deep - 8] = '\0';
    EXPECT(ckpt_join(&w, deep, 7, 1, deep_err, sizeof deep_err) == -1 && ckt_has(deep_err, "path too long"),
           "%s", deep_err + (strlen(deep_err) > 60 ? strlen(deep_err) - 60 : 0));
    EXPECT(ckpt_begin(&w, deep, 7, deep_err, sizeof deep_err) == -1 && ckt_has(deep_err, "path too long"),
           "%s", deep_err + (strlen(deep_err) > 60 ? strlen(deep_err) - 60 : 0));
    ck_rmtree(dir, NULL, 0);
    return TEST_RESULT;
}

static const TestCase ckpt_tests[] = {
    {"crc32c_known_answers", test_crc32c_known_answers},
    {"json_writer", test_json_writer},
    {"json_reader", test_json_reader},
    {"safetensors_roundtrip", test_safetensors_roundtrip},
    {"safetensors_header_layout", test_safetensors_header_layout},
    {"safetensors_python_reader", test_safetensors_python_reader},
    {"safetensors_rejects_bad_files", test_safetensors_rejects_bad_files},
    {"ckpt_roundtrip", test_ckpt_roundtrip},
    {"ckpt_detects_damage", test_ckpt_detects_damage},
    {"ckpt_crash_between_steps", test_ckpt_crash_between_steps},
    {"ckpt_keep_last_k", test_ckpt_keep_last_k},
    {"ckpt_write_errors", test_ckpt_write_errors},
    {"ckpt_several_writers", test_ckpt_several_writers},
};
static const int n_ckpt_tests = sizeof(ckpt_tests) / sizeof(ckpt_tests[0]);

#endif
