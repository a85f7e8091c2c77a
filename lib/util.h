/*
 * lib/util.h - the small C helpers that data.h, comm.h, ckpt.h and lib/tokenizer.h share: error
 * lines (and the programs' one way to stop on one), monotonic time, allocation that cannot come back empty, reading a whole file, and reading
 * JSON strings (the one decoder of string literals, for encoder.json, prepro's JSONL and ckpt.h's
 * JSON reader).
 * Header-only; compiles as C11 (gcc: tools/prepro.c and test/fuzz/, which define
 * _POSIX_C_SOURCE 200809L before any include) and as C++17 (nvcc: train_gpt.cu, test_gpt.cu).
 *
 * THE error convention of these headers: a function that can fail returns 0 on success (or a
 * count, where its comment says so) and -1 on failure, having written one line into the caller's
 * (err, err_len) buffer that names the file or thing at fault and the problem, e.g.
 *     shard data/x.bin: the header says 1000000 tokens but the file holds 999000 (...); re-create it
 * It never prints and never exits: what to do is the caller's choice (the tools and the trainer
 * print the line and stop, through die or usage_error below; the tests compare it).
 * `return fail(err, err_len, "...", ...)` is the idiom. The only exception is running out of
 * memory, which no caller can do anything about: xmalloc, xcalloc, xrealloc and xaligned_alloc
 * print one line and exit(1).
 */
#ifndef UTIL_H
#define UTIL_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <time.h>

// ----------------------------------------------------------------------------------------------
// Errors

// An error is one line: a control character that came in with the input (a newline in a file
// name, a tab or an escape byte in a token) is written out as \xNN, as far as err has room.
static inline void error_one_line(char* err, size_t err_len) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; err[i]; i++) {
        unsigned char c = (unsigned char)err[i];
        if (c >= 0x20 && c != 0x7f) continue;
        size_t n = strlen(err);
        if (n + 3 >= err_len) {  // no room to grow: the tail goes
            if (i + 4 >= err_len) {
                err[i] = '\0';
                break;
            }
            n = err_len - 4;
            err[n] = '\0';
        }
        memmove(err + i + 4, err + i + 1, n - i);  // the rest, with its NUL
        err[i] = '\\';
        err[i + 1] = 'x';
        err[i + 2] = hex[c >> 4];
        err[i + 3] = hex[c & 15];
        i += 3;
    }
}

// Formats one error line into err (if any) and returns -1.
static inline int fail(char* err, size_t err_len, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int fail(char* err, size_t err_len, const char* fmt, ...) {
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
        error_one_line(err, err_len);
    }
    return -1;
}

// The system's text for errnum. strerror_r, not strerror, because the loader, the checkpoint
// writer and the bootstrap run on threads or in processes of their own; its two signatures (GNU
// returns the text, POSIX fills the buffer) are told apart here and nowhere else.
static inline const char* system_error_text(int errnum, char* buf, size_t n) {
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return strerror_r(errnum, buf, n);
#else
    return strerror_r(errnum, buf, n) == 0 ? buf : "unknown error";
#endif
}

// Like fail, with ": <the system's text for errnum>" appended: fail_errno(.., errno, "%s: cannot
// open", path).
static inline int fail_errno(char* err, size_t err_len, int errnum, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int fail_errno(char* err, size_t err_len, int errnum, const char* fmt, ...) {
    if (!err || !err_len) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    char buf[128];
    size_t used = strlen(err);
    snprintf(err + used, err_len - used, ": %s", system_error_text(errnum, buf, sizeof(buf)));
    error_one_line(err, err_len);
    return -1;
}

// ----------------------------------------------------------------------------------------------
// Stopping a program. train_gpt and prepro end on an error with one line on stderr,
// "<program>: <what is wrong>", written as error_one_line writes it, and exit 1 for a failure (a
// bad file, a write that did not happen) or 2 for a mistake on the command line (an unknown flag,
// a value outside its flag's domain): die and usage_error; warn says one line and goes on. Only the
// programs call them; the headers return -1 with err. main names its program first: program_name =
// "prepro" (train_gpt adds its rank once it knows it: "train_gpt rank 1 of 2").

static const char* program_name __attribute__((unused)) = "?";

static void vsay(const char* fmt, va_list ap) __attribute__((format(printf, 1, 0)));
static void vsay(const char* fmt, va_list ap) {
    char line[8192];
    vsnprintf(line, sizeof(line), fmt, ap);
    error_one_line(line, sizeof(line));
    fprintf(stderr, "%s: %s\n", program_name, line);
}

static void vexit_with(int code, const char* fmt, va_list ap) __attribute__((format(printf, 2, 0), noreturn));
static void vexit_with(int code, const char* fmt, va_list ap) {
    vsay(fmt, ap);
    exit(code);
}

// Something the user must know that stops nothing (a fallback taken, a failure survived): the same
// one line on stderr, and the program goes on.
static void warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsay(fmt, ap);
    va_end(ap);
}

// A failure: one line, exit 1.
static void die(const char* fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vexit_with(1, fmt, ap);
}

// A mistake on the command line: one line, exit 2.
static void usage_error(const char* fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void usage_error(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vexit_with(2, fmt, ap);
}

// ----------------------------------------------------------------------------------------------
// Time: monotonic seconds, for durations and deadlines (they must not jump with the wall clock).

static inline double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline void sleep_seconds(double seconds) {
    struct timespec t = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {}
}

// ----------------------------------------------------------------------------------------------
// Allocation: out of memory is not an input error a caller can handle, so these say so and exit.
// A request for 0 bytes still returns a pointer that can be freed.

static inline void* xmalloc(size_t bytes) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
        exit(1);
    }
    return p;
}

static inline void* xcalloc(size_t n, size_t size) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "out of memory allocating %zu x %zu bytes\n", n, size);
        exit(1);
    }
    return p;
}

static inline void* xrealloc(void* p, size_t bytes) {
    void* q = realloc(p, bytes ? bytes : 1);
    if (!q) {
        fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
        exit(1);
    }
    return q;
}

// bytes aligned to `alignment` (a power of two, a multiple of sizeof(void*)); free() it.
static inline void* xaligned_alloc(size_t alignment, size_t bytes) {
    void* p = NULL;
    if (posix_memalign(&p, alignment, bytes ? bytes : 1) != 0) {
        fprintf(stderr, "out of memory allocating %zu bytes aligned to %zu\n", bytes, alignment);
        exit(1);
    }
    return p;
}

// ----------------------------------------------------------------------------------------------
// Files

// Reads the whole file at path (a regular file, or a pipe read to its end) into a malloc'ed buffer
// with a NUL after its last byte: 0 with *out and *len, or -1 with err. A file of more than
// max_bytes is refused (SIZE_MAX: no limit); so is one too large for memory, as an error about the
// file, not an exit.
static inline int read_whole_file(const char* path, size_t max_bytes, char** out, size_t* len,
                                  char* err, size_t err_len) {
    *out = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail_errno(err, err_len, errno, "%s: cannot open", path);
    size_t cap = (size_t)1 << 16, n = 0;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size <= max_bytes)
        cap = (size_t)st.st_size + 2;  // its bytes, the NUL, and room for the read that sees the end
    char* buf = (char*)malloc(cap);
    int rc = buf ? 0 : fail(err, err_len, "%s: out of memory for %zu bytes", path, cap);
    while (rc == 0) {
        if (cap - n < 2) {  // full: keep room for at least one more byte and the NUL
            char* grown = (char*)realloc(buf, 2 * cap);
            if (!grown) { rc = fail(err, err_len, "%s: out of memory for %zu bytes", path, 2 * cap); break; }
            buf = grown;
            cap *= 2;
        }
        ssize_t got = read(fd, buf + n, cap - n - 1);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) rc = fail_errno(err, err_len, errno, "%s: cannot read", path);
        else if (got == 0) break;
        else if ((n += (size_t)got) > max_bytes)
            rc = fail(err, err_len, "%s: more than the %zu bytes this file may have", path, max_bytes);
    }
    close(fd);
    if (rc) {
        free(buf);
        return -1;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

// ----------------------------------------------------------------------------------------------
// JSON strings (RFC 8259). These read a string literal in place, in a larger text; the grammar
// around it (objects, numbers) is the caller's: ckpt.h's JSON reader, lib/tokenizer.h's
// encoder.json loader, tools/prepro.c's JSONL lines.

static inline const char* json_skip_space(const char* s, const char* end) {
    while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) s++;
    return s;
}

// The value of hex digit c, or -1.
static inline int hex_digit(char c) {
    return (c >= '0' && c <= '9') ? c - '0'
         : (c >= 'a' && c <= 'f') ? c - 'a' + 10
         : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
}

// Writes code point cp (at most U+10FFFF, not a surrogate) as UTF-8 into out; returns its length.
static inline size_t utf8_encode(uint32_t cp, char out[4]) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// The end of the string literal at s (on its opening quote): just past its closing quote, or NULL
// when s is not on a quote or the literal does not close before end. Escapes are stepped over, not
// checked (json_string_decode checks them). A decoded literal needs at most (end - s) bytes.
static inline const char* json_string_end(const char* s, const char* end) {
    if (s >= end || *s != '"') return NULL;
    for (s++; s < end; s++) {
        if (*s == '"') return s + 1;
        if (*s == '\\') s++;
    }
    return NULL;
}

// The four hex digits of a \u escape at s: 0 and *v, or -1.
static inline int json_hex4(const char* s, const char* end, uint32_t* v) {
    if (end - s < 4) return -1;
    *v = 0;
    for (int i = 0; i < 4; i++) {
        int d = hex_digit(s[i]);
        if (d < 0) return -1;
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

// Decodes the string literal at s (on its opening quote; the text ends at end) into dst as UTF-8:
// *dst_len bytes, no NUL added. dst needs room for json_string_end(s, end) - s bytes; it may be
// s + 1, to decode the literal over itself (the decoded form is never longer than what it comes
// from). On success *after is just past the closing quote; on failure it points at the fault, for
// the caller's message. Strict: a control character, an escape other than \" \\ \/ \b \f \n \r \t
// and \uXXXX, and a \u surrogate that is not a high one followed by a low one (a lone surrogate
// has no UTF-8 form) are errors. \u0000 decodes to a NUL byte: a caller that keeps C strings
// refuses it. Returns 0, or -1 with err saying what is wrong (the caller adds where).
static inline int json_string_decode(const char* s, const char* end, char* dst, size_t* dst_len,
                                     const char** after, char* err, size_t err_len) {
    char* d = dst;
    *dst_len = 0;
    *after = s;
    if (s >= end || *s != '"') return fail(err, err_len, "expected a string");
    for (s++;;) {
        *after = s;
        if (s >= end) return fail(err, err_len, "unterminated string");
        unsigned char c = (unsigned char)*s;
        if (c == '"') break;
        if (c < 0x20) return fail(err, err_len, "control character 0x%02x inside a string", c);
        if (c != '\\') { *d++ = (char)c; s++; continue; }
        char e = s + 1 < end ? s[1] : '\0';
        const char* from = "\"\\/bfnrt";
        const char* to = "\"\\/\b\f\n\r\t";
        const char* hit = e ? strchr(from, e) : NULL;
        if (hit) { *d++ = to[hit - from]; s += 2; continue; }
        if (e != 'u') return fail(err, err_len, "unknown escape in a string");
        uint32_t cp, lo;
        if (json_hex4(s + 2, end, &cp) < 0) return fail(err, err_len, "bad \\u escape: expected 4 hex digits");
        if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(err, err_len, "\\u low surrogate without a high one");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (end - s < 12 || s[6] != '\\' || s[7] != 'u' || json_hex4(s + 8, end, &lo) < 0 ||
                lo < 0xDC00 || lo > 0xDFFF)
                return fail(err, err_len, "\\u high surrogate not followed by a low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            s += 6;
        }
        s += 6;
        d += utf8_encode(cp, d);  // at most 4 bytes for the 6 or 12 just read: d stays behind s
    }
    *after = s + 1;
    *dst_len = (size_t)(d - dst);
    return 0;
}

#endif
