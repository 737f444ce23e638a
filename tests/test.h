/* test.h: the test harness. Each test file defines tests with TEST(group, name); they register
 * themselves before main (constructor), so adding a test file needs no edit elsewhere.
 * CHECK records a failure with file:line and continues; a test passes if nothing failed.
 * Test data lives under tests/data (override with PETREL_TEST_DATA). */
#ifndef PETREL_TEST_H
#define PETREL_TEST_H
#include <math.h>
#include <stdio.h>

typedef void (*test_fn)(void);
void test_register(const char *group, const char *name, test_fn fn);
void test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Path under the test data folder (static buffer rotating over 8 slots). */
const char *test_data(const char *rel);
/* A fresh temporary directory for this test run (created once, removed at exit). */
const char *test_tmpdir(void);
/* test_tmpdir()/name (static buffer rotating over 8 slots). */
const char *test_tmp(const char *name);
/* A whole file, malloc'd with a NUL after its n bytes (free() it); NULL when it cannot be read
 * whole (then *n = 0). n may be NULL. */
void *test_read_file(const char *path, size_t *n);
/* Relative L2 error ||a - ref|| / ||ref|| over n floats (in double). */
double test_rel_l2(const float *a, const float *ref, size_t n);
/* Sum over rows t < T of KL(softmax(ref[t]) || softmax(lg[t])) (nats, in double): a quantized
 * or adapted model's logits against a reference. */
double test_kl_rows(const float *ref, const float *lg, int T, int V);
/* Runs cmd through the shell, capturing stdout into out and stderr into err (both truncated to
 * their capacity, NUL-terminated); returns the exit status (-1 if it did not exit). */
int test_sh(const char *cmd, char *out, size_t cap, char *err, size_t ecap);
/* The tensor "prompt_<prompt>.<part>" of a golden.safetensors set (NULL if absent). */
struct st_set;
struct st_tensor;
const struct st_tensor *test_gold(const struct st_set *g, int prompt, const char *part);
/* Marks the running test skipped (it needs what this run lacks: a built binary, a CPU feature,
 * a malloc the sanitizers do not own), with the reason; the test should return after it. The
 * runner counts skipped tests apart and names them before its last line. */
void test_skip(const char *why);
/* Converts tests/data/FIXTURE to a fresh pack in the temporary folder with every class in quant
 * (a CVQ_* of io/convert.h); its path (static buffer rotating over 8 slots), or NULL after a
 * recorded failure. */
const char *test_pack_of(const char *fixture, int quant);
/* Number of '\n' in s. */
int test_count_lines(const char *s);

#define TEST(group, name)                                                        \
    static void test_##group##_##name(void);                                     \
    __attribute__((constructor)) static void test_reg_##group##_##name(void) {   \
        test_register(#group, #name, test_##group##_##name);                     \
    }                                                                            \
    static void test_##group##_##name(void)

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) test_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);          \
    } while (0)
#define CHECK_MSG(cond, ...)                                                     \
    do {                                                                         \
        if (!(cond)) test_fail(__FILE__, __LINE__, __VA_ARGS__);                 \
    } while (0)
#define CHECK_EQ_INT(a, b)                                                       \
    do {                                                                         \
        long long ta_ = (long long)(a), tb_ = (long long)(b);                    \
        if (ta_ != tb_)                                                          \
            test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, ta_, tb_); \
    } while (0)
#define CHECK_NEAR(a, b, tol)                                                    \
    do {                                                                         \
        double ta_ = (double)(a), tb_ = (double)(b);                             \
        if (!(fabs(ta_ - tb_) <= (tol)))                                         \
            test_fail(__FILE__, __LINE__, "%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, ta_, tb_, (double)(tol)); \
    } while (0)
#endif
