/* persist.c: session files for `petrel serve --session-dir` (persist.h). */
#include "serve/persist.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/err.h"

#define PERSIST_QUEUE 4

typedef struct item { petrel_snapshot *k; } item;

struct persist {
    petrel_engine *e;
    char dir[4096];
    int max_files;
    pthread_t th;
    int started, stopping;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    item q[PERSIST_QUEUE];
    int nq;
    long written;
};

long persist_written(const persist *p) { return p ? p->written : 0; }

static int is_psess(const char *n) {
    size_t l = strlen(n);
    return l > 6 && !strcmp(n + l - 6, ".psess");
}

/* Removes the oldest files past max_files. */
static void prune(persist *p) {
    DIR *d = opendir(p->dir);
    if (!d) return;
    struct ent { char name[256]; time_t t; } *v = NULL;
    int n = 0, cap = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (!is_psess(de->d_name) || strlen(de->d_name) >= 256) continue;
        char path[4400];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", p->dir, de->d_name);
        if (stat(path, &st)) continue;
        if (n == cap) {
            struct ent *nv = realloc(v, sizeof *v * (size_t)(cap = cap ? 2 * cap : 64));
            if (!nv) break;
            v = nv;
        }
        snprintf(v[n].name, sizeof v[n].name, "%s", de->d_name);
        v[n++].t = st.st_mtime;
    }
    closedir(d);
    while (n > p->max_files) { /* the oldest goes */
        int o = 0;
        for (int i = 1; i < n; i++)
            if (v[i].t < v[o].t) o = i;
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", p->dir, v[o].name);
        unlink(path);
        v[o] = v[--n];
    }
    free(v);
}

static void write_one(persist *p, item *it) {
    const int32_t *tokens;
    int len = petrel_snapshot_tokens(it->k, &tokens);
    uint64_t h = XXH3_64bits_withSeed(tokens, sizeof *tokens * (size_t)len, petrel_snapshot_id(it->k));
    char path[4400];
    snprintf(path, sizeof path, "%s/%016llx.psess", p->dir, (unsigned long long)h);
    petrel_error err = {0};
    if (access(path, F_OK) == 0) utimensat(AT_FDCWD, path, NULL, 0); /* known: keep it, as the newest */
    else if (petrel_snapshot_save(it->k, path, &err) == 0) p->written++;
    petrel_snapshot_free(it->k);
    prune(p);
}

static void *writer(void *arg) {
    persist *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->nq && !p->stopping) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->nq) break;
        item it = p->q[0];
        memmove(p->q, p->q + 1, sizeof *p->q * (size_t)(--p->nq));
        pthread_mutex_unlock(&p->mu);
        write_one(p, &it);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void persist_offer(persist *p, const petrel_session *s) {
    int page = 1;
    if (p) petrel_kv_usage(p->e, NULL, NULL, &page);
    if (!p || !s || petrel_session_len(s) < page) return;
    pthread_mutex_lock(&p->mu);
    int room = p->nq < PERSIST_QUEUE && !p->stopping;
    pthread_mutex_unlock(&p->mu);
    petrel_snapshot *k = NULL;
    if (!room || petrel_session_snapshot(s, &k, &(petrel_error){0})) return; /* shares the pages: no copy */
    pthread_mutex_lock(&p->mu);
    p->q[p->nq++] = (item){k};
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Every file in the folder into the prefix cache, through one session (each adapter set tried:
 * a file's identity says which made it). */
static void load_all(persist *p, int ctx, int *loaded, int *skipped) {
    DIR *d = opendir(p->dir);
    if (!d) return;
    petrel_session *s = NULL;
    petrel_error err = {0};
    if (petrel_session_create(p->e, ctx, &s, &err)) { closedir(d); return; }
    int nl = petrel_engine_lora_count(p->e);
    for (struct dirent *de; (de = readdir(d));) {
        if (!is_psess(de->d_name)) continue;
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", p->dir, de->d_name);
        int ok = 0;
        for (int a = -1; a < nl && !ok; a++) {
            petrel_session_truncate(s, 0, &err);
            if (a >= 0 && petrel_session_set_lora(s, &a, NULL, 1, &err)) break; /* merged adapters: base only */
            if (a < 0) petrel_session_set_lora(s, NULL, NULL, 0, &err); /* the base (refused, harmlessly, when merged) */
            ok = petrel_session_load(s, path, &err) == 0;
        }
        if (ok) ok = petrel_session_prefix_put(s, &err) >= 0;
        ++*(ok ? loaded : skipped);
    }
    closedir(d);
    petrel_session_free(s);
}

int persist_open(petrel_engine *e, const char *dir, int max_files, int ctx, persist **out, int *loaded, int *skipped, petrel_error *err) {
    *out = NULL;
    *loaded = *skipped = 0;
    if (!dir || !*dir) return pt_err(err, PETREL_EINVAL, "--session-dir: no folder given");
    struct stat st;
    if (stat(dir, &st) < 0 && mkdir(dir, 0700) < 0) return pt_err(err, PETREL_EIO, "--session-dir %s: cannot create it: %s", dir, strerror(errno));
    if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) return pt_err(err, PETREL_EIO, "--session-dir %s: not a folder", dir);
    if (access(dir, W_OK | X_OK)) return pt_err(err, PETREL_EIO, "--session-dir %s: not writable", dir);
    persist *p = calloc(1, sizeof *p);
    if (!p) return pt_err(err, PETREL_ENOMEM, "out of memory");
    p->e = e;
    snprintf(p->dir, sizeof p->dir, "%s", dir);
    p->max_files = max_files > 0 ? max_files : 256;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    load_all(p, ctx, loaded, skipped);
    if (pthread_create(&p->th, NULL, writer, p)) {
        persist_close(p);
        return pt_err(err, PETREL_ENOMEM, "cannot start the session writer");
    }
    p->started = 1;
    *out = p;
    return 0;
}

long persist_close(persist *p) {
    if (!p) return 0;
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started) pthread_join(p->th, NULL);
    for (int i = 0; i < p->nq; i++) petrel_snapshot_free(p->q[i].k);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    long w = p->written;
    free(p);
    return w;
}
