/*
 * test/testing.h - the small test harness behind test_gpt.
 *
 * A test is a function returning TEST_PASS, TEST_FAIL or TEST_SKIP; each subsystem keeps a table
 * of them (name, function) and test_gpt.cu runs every table in turn, printing one line per test
 * and, last, the totals as `N passed, N failed, N skipped` (the line CI reads). A test that needs
 * a GPU calls REQUIRE_GPU() first, so that on a machine without one it counts as skipped.
 * EXPECT prints the failing condition with file and line and makes the test fail, but lets it run
 * on, so one run shows every broken check. test_write_file is for tests that make input files;
 * run_command for those that run ./train_gpt or ./prepro and read what they say;
 * make_test_dir and remove_test_dir for their temporary directories.
 */
#ifndef TESTING_H
#define TESTING_H

#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>
#include <sys/wait.h>

enum { TEST_PASS = 0, TEST_FAIL = 1, TEST_SKIP = 2 };

typedef struct {
    const char* name;
    int (*fn)(void);
} TestCase;

/* Set by test_gpt.cu's main before any test runs. */
static bool g_have_gpu = false;

/* Writes n bytes to path (a test's input file); 0, or -1 if it could not. */
static int test_write_file(const char* path, const void* data, size_t n) {
    FILE* f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(data, 1, n, f) == n;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* Runs a shell command with its stdout discarded; returns its exit code (-1 if it did not exit)
 * with what it wrote on stderr in err (up to len - 1 bytes, NUL-terminated). */
static int run_command(const char* cmd, char* err, size_t len) {
    char full[2048];
    snprintf(full, sizeof(full), "(%s) 2>&1 >/dev/null", cmd);  // the whole command's stderr
    FILE* p = popen(full, "r");
    if (!p) return -1;
    size_t n = fread(err, 1, len - 1, p);
    err[n] = '\0';
    char rest[512];
    while (fread(rest, 1, sizeof(rest), p) > 0) {}
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Each test declares `int failed = 0;` and returns TEST_RESULT at the end. */
#define EXPECT(cond, ...)                                                        \
    do {                                                                         \
        if (!(cond)) {                                                           \
            printf("    %s:%d: expected %s: ", __FILE__, __LINE__, #cond);       \
            printf(__VA_ARGS__);                                                 \
            printf("\n");                                                        \
            failed = 1;                                                          \
        }                                                                        \
    } while (0)
#define TEST_RESULT (failed ? TEST_FAIL : TEST_PASS)
#define REQUIRE_GPU()                                                            \
    do {                                                                         \
        if (!g_have_gpu) return TEST_SKIP;                                       \
    } while (0)

/* Makes a fresh temporary directory /tmp/<name>_XXXXXX into dir (n bytes); 0, or -1 if it could not. */
static int make_test_dir(char* dir, size_t n, const char* name) {
    snprintf(dir, n, "/tmp/%s_XXXXXX", name);
    return mkdtemp(dir) ? 0 : -1;
}

/* Removes a test's temporary directory with all it holds; 1 (having said so) if that failed. */
static int remove_test_dir(const char* dir) {
    int failed = 0;
    char cmd[1100];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    EXPECT(system(cmd) == 0, "cleanup of %s", dir);
    return failed;
}

#endif
