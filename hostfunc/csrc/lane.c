/* The native lane of a HostStream: one C thread that runs native host functions in order.
 *
 * A Python worker thread cannot call a C function without holding the GIL, so the CPU stand-in
 * gives each HostStream that runs native host functions a lane: a FIFO of (fn, user_data) and
 * one pthread that pops and calls them. Nothing here touches Python; every call may be made
 * with the GIL released (ctypes.CDLL releases it around each call).
 *
 * An idle lane polls its queue for SPIN_NS (yielding the CPU between polls) before it sleeps, so
 * that a burst of pushes (a graph replay) costs one wake-up rather than one per call.
 *
 * Counters: `enqueued` is the ticket of the latest pushed call, `completed` the number of calls
 * that have returned. hf_lane_wait(ticket) blocks until `completed >= ticket`.
 *
 * Closing: hf_lane_close(lane, wait) stops the lane once its queue is empty (later pushes are
 * refused); with `wait` it returns once the thread has ended. It may be called any number of
 * times, from any thread; the lane stays readable (counters, waits) after it.
 * Freeing: hf_lane_release(lane), once, when nothing can call into the lane any more (Python:
 * the Lane object's finalizer). It frees at once if the thread has ended; else the thread frees
 * the lane as it ends, so a collected stream never waits for its queued calls.
 *
 * The hf_test_* functions at the end are for tests and demos only: small native host functions
 * whose effects a test can read (a spin, a CLOCK_MONOTONIC timestamp, counters, a shared log).
 *
 * Build: cc -O2 -shared -fPIC -pthread -o lane.so lane.c  (hostfunc/native.py does it on first use)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

enum { SPIN_NS = 50000 };  /* how long an idle lane polls before it sleeps */

typedef void (*hf_fn)(void *);

typedef struct {
    hf_fn fn;
    void *user_data;
} hf_call;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work;      /* signalled on push and on close */
    pthread_cond_t done;      /* signalled when a call completes */
    hf_call *ring;            /* capacity entries, head..head+count-1 (mod capacity) */
    size_t capacity, head, count;  /* count: written under mu, also polled without it */
    uint64_t enqueued;        /* tickets handed out (ticket of the latest push) */
    uint64_t completed;       /* calls that have returned */
    uint64_t wake_at;         /* smallest ticket a waiter waits for (UINT64_MAX: none) */
    int closing;              /* no more pushes; end once the queue is empty */
    int exited;               /* the thread has left its loop */
    int detached;             /* released while running: the thread frees the lane */
    pthread_t thread;
} hf_lane;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void lane_free(hf_lane *lane) {
    pthread_cond_destroy(&lane->done);
    pthread_cond_destroy(&lane->work);
    pthread_mutex_destroy(&lane->mu);
    free(lane->ring);
    free(lane);
}

static void *lane_main(void *arg) {
    hf_lane *lane = arg;
    pthread_setname_np(pthread_self(), "hostfunc-lane");  /* what tests and debuggers see */
    pthread_mutex_lock(&lane->mu);
    for (;;) {
        if (lane->count == 0 && !lane->closing) {
            /* Calls often come in bursts (a replay pushes its steps one by one): poll briefly
             * before sleeping, so that a burst costs one wake-up rather than one per call. */
            pthread_mutex_unlock(&lane->mu);
            int64_t until = now_ns() + SPIN_NS;
            while (!__atomic_load_n(&lane->count, __ATOMIC_ACQUIRE) && now_ns() < until)
                sched_yield();
            pthread_mutex_lock(&lane->mu);
        }
        while (lane->count == 0 && !lane->closing)
            pthread_cond_wait(&lane->work, &lane->mu);
        if (lane->count == 0)
            break;  /* closing and drained */
        hf_call call = lane->ring[lane->head];
        lane->head = (lane->head + 1) % lane->capacity;
        __atomic_store_n(&lane->count, lane->count - 1, __ATOMIC_RELEASE);  /* (polled above) */
        pthread_mutex_unlock(&lane->mu);
        call.fn(call.user_data);
        pthread_mutex_lock(&lane->mu);
        lane->completed++;
        if (lane->completed >= lane->wake_at) {  /* wake waiters only when one is due */
            lane->wake_at = UINT64_MAX;            /* (those not yet due register again) */
            pthread_cond_broadcast(&lane->done);
        }
    }
    lane->exited = 1;
    pthread_cond_broadcast(&lane->done);
    int detached = lane->detached;
    pthread_mutex_unlock(&lane->mu);
    if (detached)
        lane_free(lane);  /* released: nobody else touches it again */
    return NULL;
}

/* A new lane with its thread started; NULL when memory or a thread could not be had. */
hf_lane *hf_lane_create(void) {
    hf_lane *lane = calloc(1, sizeof *lane);
    if (!lane)
        return NULL;
    lane->capacity = 64;
    lane->wake_at = UINT64_MAX;
    lane->ring = malloc(lane->capacity * sizeof *lane->ring);
    if (!lane->ring) {
        free(lane);
        return NULL;
    }
    pthread_mutex_init(&lane->mu, NULL);
    pthread_cond_init(&lane->work, NULL);
    pthread_cond_init(&lane->done, NULL);
    if (pthread_create(&lane->thread, NULL, lane_main, lane) != 0) {
        lane_free(lane);
        return NULL;
    }
    return lane;
}

static int grow(hf_lane *lane) {
    size_t capacity = lane->capacity * 2;
    hf_call *ring = malloc(capacity * sizeof *ring);
    if (!ring)
        return 0;
    for (size_t i = 0; i < lane->count; i++)
        ring[i] = lane->ring[(lane->head + i) % lane->capacity];
    free(lane->ring);
    lane->ring = ring;
    lane->capacity = capacity;
    lane->head = 0;
    return 1;
}

/* Append fn(user_data) and, where `release` is not NULL, release(user_data) right behind it
 * (both or neither). Returns the ticket of the last call pushed, 0 if the lane is closing or
 * out of memory (nothing pushed). */
uint64_t hf_lane_push(hf_lane *lane, hf_fn fn, void *user_data, hf_fn release) {
    size_t n = release ? 2 : 1;
    pthread_mutex_lock(&lane->mu);
    uint64_t ticket = 0;
    if (!lane->closing) {
        while (lane->count + n > lane->capacity)
            if (!grow(lane))
                goto out;
        size_t tail = (lane->head + lane->count) % lane->capacity;
        lane->ring[tail] = (hf_call){fn, user_data};
        if (release)
            lane->ring[(tail + 1) % lane->capacity] = (hf_call){release, user_data};
        __atomic_store_n(&lane->count, lane->count + n, __ATOMIC_RELEASE);  /* (polled unlocked) */
        lane->enqueued += n;
        ticket = lane->enqueued;
        pthread_cond_signal(&lane->work);
    }
out:
    pthread_mutex_unlock(&lane->mu);
    return ticket;
}

/* Block until the call with `ticket` (and every earlier one) has returned, or until
 * `timeout_ns` passed (negative: no limit). Returns 1 when reached, 0 on timeout. */
int hf_lane_wait(hf_lane *lane, uint64_t ticket, int64_t timeout_ns) {
    struct timespec until;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);  /* pthread_cond_timedwait's default clock */
        int64_t ns = until.tv_nsec + timeout_ns % 1000000000;
        until.tv_sec += (time_t)(timeout_ns / 1000000000 + ns / 1000000000);
        until.tv_nsec = (long)(ns % 1000000000);
    }
    pthread_mutex_lock(&lane->mu);
    int reached = 1;
    while (lane->completed < ticket) {
        if (ticket < lane->wake_at)
            lane->wake_at = ticket;
        if (timeout_ns < 0) {
            pthread_cond_wait(&lane->done, &lane->mu);
        } else if (pthread_cond_timedwait(&lane->done, &lane->mu, &until) == ETIMEDOUT) {
            reached = lane->completed >= ticket;
            break;
        }
    }
    pthread_mutex_unlock(&lane->mu);
    return reached;
}

uint64_t hf_lane_enqueued(hf_lane *lane) {
    pthread_mutex_lock(&lane->mu);
    uint64_t n = lane->enqueued;
    pthread_mutex_unlock(&lane->mu);
    return n;
}

uint64_t hf_lane_completed(hf_lane *lane) {
    pthread_mutex_lock(&lane->mu);
    uint64_t n = lane->completed;
    pthread_mutex_unlock(&lane->mu);
    return n;
}

/* Stop the lane once its queue is empty; with `wait`, return once its thread has ended. */
void hf_lane_close(hf_lane *lane, int wait) {
    pthread_mutex_lock(&lane->mu);
    lane->closing = 1;
    pthread_cond_signal(&lane->work);
    while (wait && !lane->exited)
        pthread_cond_wait(&lane->done, &lane->mu);
    pthread_mutex_unlock(&lane->mu);
}

/* Free the lane (closing it first); see the top of the file. No call may follow. */
void hf_lane_release(hf_lane *lane) {
    pthread_mutex_lock(&lane->mu);
    lane->closing = 1;
    pthread_cond_signal(&lane->work);
    int exited = lane->exited;
    if (!exited)
        lane->detached = 1;
    pthread_t thread = lane->thread;
    pthread_mutex_unlock(&lane->mu);
    if (exited) {
        pthread_join(thread, NULL);  /* (at once: it has left its loop) */
        lane_free(lane);
    } else {
        pthread_detach(thread);
    }
}

/* ---- copies ---- */

/* user_data points to {void *dst; const void *src; uint64_t nbytes}: copy nbytes from src to
 * dst (hostfunc.native.copy_function: a captured copy that a HostGraph replays, as a CUDA
 * graph replays its copy nodes). */
typedef struct {
    void *dst;
    const void *src;
    uint64_t nbytes;
} hf_copy_args;

void hf_copy_bytes(void *user_data) {
    const hf_copy_args *a = user_data;
    memcpy(a->dst, a->src, (size_t)a->nbytes);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* ---- for tests and demos only ---- */

/* Busy-wait (no sleep) for (uintptr_t)user_data nanoseconds: a stand-in for host work. */
void hf_test_spin_ns(void *user_data) {
    int64_t until = now_ns() + (int64_t)(uintptr_t)user_data;
    while (now_ns() < until) {
    }
}

/* Write CLOCK_MONOTONIC nanoseconds (Python's time.monotonic_ns) into *(int64_t *)user_data. */
void hf_test_timestamp_ns(void *user_data) {
    __atomic_store_n((int64_t *)user_data, now_ns(), __ATOMIC_SEQ_CST);
}

/* Counters at user_data: int64_t[3] = {calls, retains, releases}; each function adds one. */
void hf_test_count_call(void *user_data) {
    __atomic_add_fetch(&((int64_t *)user_data)[0], 1, __ATOMIC_SEQ_CST);
}

void hf_test_count_retain(void *user_data) {
    __atomic_add_fetch(&((int64_t *)user_data)[1], 1, __ATOMIC_SEQ_CST);
}

void hf_test_count_release(void *user_data) {
    __atomic_add_fetch(&((int64_t *)user_data)[2], 1, __ATOMIC_SEQ_CST);
}

/* A shared log: user_data points to {int64_t *log; int64_t *length; int64_t value}; appends
 * `value` at log[*length] and increments *length (the caller sizes the log). */
typedef struct {
    int64_t *log;
    int64_t *length;
    int64_t value;
} hf_test_append_args;

void hf_test_append(void *user_data) {
    hf_test_append_args *a = user_data;
    int64_t at = __atomic_fetch_add(a->length, 1, __ATOMIC_SEQ_CST);
    a->log[at] = a->value;
}
