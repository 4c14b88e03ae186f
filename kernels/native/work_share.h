/* Chunks of one job shared between the calling thread and helper threads, for kernels whose calls are short (a
 * decode step of the indexer: a millisecond or two). The caller claims chunks itself from the start and never
 * waits for a helper that has not claimed one: a helper the OS schedules late (another process holds its core)
 * costs nothing, where an OpenMP parallel region ends at a barrier every thread of the team must reach, however
 * late it was woken. The caller waits only for chunks a helper is running.
 *
 * Helpers are created at first use (up to SHARE_MAX_HELPERS, as many as a call's `threads` asks for) and sleep
 * between jobs; a job uses helpers 1 .. threads-1, the caller is worker 0. One job at a time: a caller that finds
 * the pool busy (another thread's job) runs its chunks alone, as does a child process after fork (its helpers
 * were not copied).
 */
#ifndef ASCEND_DSA_WORK_SHARE_H
#define ASCEND_DSA_WORK_SHARE_H

#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#define SHARE_MAX_HELPERS 63

typedef void (*share_fn)(void *ctx, int64_t chunk, int worker);

static struct {
    pthread_mutex_t lock;   /* guards the fields below */
    pthread_cond_t wake;    /* helpers sleep on it between jobs */
    pthread_mutex_t busy;   /* held by the caller whose job is posted */
    uint64_t job;           /* number of the job posted last */
    share_fn fn;
    void *ctx;
    int64_t chunks, next;   /* chunks of the job, and the next one to claim */
    int active;             /* chunks helpers are running */
    int workers;            /* helpers 1 .. workers-1 take part in the job */
    int helpers;            /* helper threads started */
    int forked;             /* the fork handler is registered */
} share = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER};

/* In a child process: no helpers, nothing posted, the locks free. */
static void share_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER, fresh_busy = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_wake = PTHREAD_COND_INITIALIZER;
    share.lock = fresh;
    share.busy = fresh_busy;
    share.wake = fresh_wake;
    share.helpers = 0;
    share.chunks = share.next = 0;
    share.active = 0;
}

/* Claims chunks of the job posted (share.lock held on entry and on return). */
static void share_claim(int worker) {
    while (share.next < share.chunks && worker < share.workers) {
        int64_t chunk = share.next++;
        share_fn fn = share.fn;
        void *ctx = share.ctx;
        share.active += worker > 0;
        pthread_mutex_unlock(&share.lock);
        fn(ctx, chunk, worker);
        pthread_mutex_lock(&share.lock);
        share.active -= worker > 0;
    }
}

static void *share_helper(void *arg) {
    int worker = (int)(intptr_t)arg;
    pthread_mutex_lock(&share.lock);
    for (uint64_t seen = share.job;; seen = share.job) {
        while (share.job == seen) pthread_cond_wait(&share.wake, &share.lock);
        share_claim(worker);
    }
    return NULL;
}

/* Starts helpers until `wanted` run (share.lock held). */
static void share_start_helpers(int wanted) {
    if (!share.forked) share.forked = !pthread_atfork(NULL, NULL, share_after_fork);
    while (share.helpers < wanted && share.forked) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, share_helper, (void *)(intptr_t)(share.helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        share.helpers++;
    }
}

/* fn(ctx, chunk, worker) for every chunk in [0, chunks), on the caller and up to threads-1 helpers (worker: 0 for
 * the caller, 1 .. threads-1 for helpers); returns when every chunk has run. */
static void share_run(share_fn fn, void *ctx, int64_t chunks, int threads) {
    threads = threads < SHARE_MAX_HELPERS + 1 ? threads : SHARE_MAX_HELPERS + 1;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&share.busy) != 0) {
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c, 0);
        return;
    }
    pthread_mutex_lock(&share.lock);
    share_start_helpers(threads - 1);
    share.fn = fn;
    share.ctx = ctx;
    share.chunks = chunks;
    share.next = 0;
    share.workers = threads;
    share.job++;
    pthread_cond_broadcast(&share.wake);
    share_claim(0);
    while (share.active > 0) {      /* chunks helpers are still running: short, and their threads are running */
        pthread_mutex_unlock(&share.lock);
        sched_yield();
        pthread_mutex_lock(&share.lock);
    }
    share.chunks = 0;
    pthread_mutex_unlock(&share.lock);
    pthread_mutex_unlock(&share.busy);
}

#endif
