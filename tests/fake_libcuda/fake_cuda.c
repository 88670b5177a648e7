/* A fake libcuda.so.1 for testing hostfunc's CUDA call sequence on machines without a GPU.
 *
 * cuda.bindings resolves every driver entry point through cuGetProcAddress_v2, so this library
 * exports that (plus cuDriverGetVersion and cuInit) and hands out the handful of functions the
 * hostfunc CUDA backend calls. Each of them appends one line to a text log that the test reads
 * ("name key=value ..."), including whether the caller held the GIL (looked up in the running
 * Python process with dlsym, so the library needs no Python headers).
 *
 * The fake models just enough of the driver:
 *   - streams are opaque integers; fake_begin_capture(stream, graph) / fake_end_capture()
 *     switch a stream into and out of capture mode, starting from one root dependency node;
 *   - cuGraphAddHostNode stores (fn, userData) in the graph; fake_replay(graph, n) calls every
 *     host node of the graph in insertion order, n times, on a fresh pthread (like a driver thread);
 *   - cuUserObjectCreate / cuGraphRetainUserObject(MOVE) give a user object to a graph;
 *     fake_destroy_graph(graph) calls the destructors of the graph's user objects on a pthread,
 *     as does cuUserObjectRelease when the count reaches zero;
 *   - cuLaunchHostFunc runs fn(userData) on a pthread that first joins the previous one, so
 *     eager callbacks keep stream order; cuStreamSynchronize joins the last of them;
 *   - fake_fail(name, code) makes the next call of one entry point fail with `code`;
 *   - cuGetProcAddress is itself resolvable (as on a real driver), so that code can look up the
 *     raw cuLaunchHostFunc through driver.cuGetProcAddress;
 *   - fake_probe_call / fake_probe_retain / fake_probe_release are native host functions for
 *     tests: each adds one to its counter in the FakeProbe at user_data, and fake_probe_call
 *     also counts the calls made while the calling thread held the GIL.
 * Build: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_cuda.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void (*CUhostFn)(void *);
typedef struct { CUhostFn fn; void *userData; } HostNodeParams;
typedef struct { unsigned char from_port, to_port, type, reserved[5]; } EdgeData;

enum { OK = 0, ERR_INVALID_VALUE = 1, ERR_NOT_READY = 600, ERR_NOT_FOUND = 500,
       ERR_ILLEGAL_STATE = 401 };
enum { MAX_ITEMS = 4096 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *log_buf;
static size_t log_len, log_cap;

static int gil_held(void) {
    int (*check)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    return check ? check() : -1;
}

static void logf_(const char *fmt, ...);

/* fake_fail(name, code): the next call of entry point `name` returns `code` and does nothing. */
static char fail_name[64];
static int fail_code;

static int injected_failure(const char *name) {
    int code = 0;
    pthread_mutex_lock(&lock);
    if (fail_name[0] && strcmp(fail_name, name) == 0) {
        code = fail_code;
        fail_name[0] = '\0';
    }
    pthread_mutex_unlock(&lock);
    return code;
}

#define FAIL_IF_INJECTED(name)                                                      \
    do {                                                                            \
        int code_ = injected_failure(name);                                         \
        if (code_) { logf_("%s injected_failure=%d", name, code_); return code_; }  \
    } while (0)

static void logf_(const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    pthread_mutex_lock(&lock);
    if (log_len + (size_t)n + 1 > log_cap) {
        log_cap = (log_cap + (size_t)n + 1) * 2;
        log_buf = realloc(log_buf, log_cap);
    }
    memcpy(log_buf + log_len, line, (size_t)n);
    log_len += (size_t)n;
    log_buf[log_len] = '\0';
    pthread_mutex_unlock(&lock);
}

/* ---- model state ---- */
typedef struct { uintptr_t graph; CUhostFn fn; void *user_data; } Node;
typedef struct { uintptr_t graph; CUhostFn destroy; void *ptr; int refs; int destroyed; } UserObj;

static Node nodes[MAX_ITEMS];
static size_t n_nodes;
static UserObj uobjs[MAX_ITEMS];
static size_t n_uobjs;

static uintptr_t cap_stream, cap_graph;   /* one capturing stream at a time is enough */
static uintptr_t cap_deps[8];
static size_t n_cap_deps;
static EdgeData cap_edges[8];

#define NODE_HANDLE(i) ((uintptr_t)0x20000 + (uintptr_t)(i))
#define UOBJ_HANDLE(i) ((uintptr_t)0x30000 + (uintptr_t)(i))
#define ROOT_NODE ((uintptr_t)0x1f000)

/* ---- entry points resolved by cuda.bindings ---- */
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }

static CUresult f_cuInit(unsigned flags) { logf_("cuInit flags=%u gil=%d", flags, gil_held()); return OK; }

static CUresult f_cuStreamIsCapturing(uintptr_t s, int *status) {
    *status = (cap_graph && s == cap_stream) ? 1 : 0;
    logf_("cuStreamIsCapturing stream=%#lx status=%d gil=%d", (unsigned long)s, *status, gil_held());
    return OK;
}

static CUresult f_cuStreamGetCaptureInfo_v3(uintptr_t s, int *status, uint64_t *id, uintptr_t *graph,
                                            const uintptr_t **deps, const EdgeData **edges,
                                            size_t *n_deps) {
    int active = cap_graph && s == cap_stream;
    *status = active ? 1 : 0;
    if (id) *id = active ? 77 : 0;
    if (graph) *graph = active ? cap_graph : 0;
    if (deps) *deps = active ? cap_deps : NULL;
    if (edges) *edges = active ? cap_edges : NULL;
    if (n_deps) *n_deps = active ? n_cap_deps : 0;
    logf_("cuStreamGetCaptureInfo_v3 stream=%#lx status=%d ndeps=%zu gil=%d", (unsigned long)s,
          *status, active ? n_cap_deps : (size_t)0, gil_held());
    return OK;
}

static CUresult f_cuStreamGetCaptureInfo_v2(uintptr_t s, int *status, uint64_t *id, uintptr_t *graph,
                                            const uintptr_t **deps, size_t *n_deps) {
    logf_("cuStreamGetCaptureInfo_v2 (unexpected)");
    return f_cuStreamGetCaptureInfo_v3(s, status, id, graph, deps, NULL, n_deps);
}

static CUresult f_cuGraphAddHostNode(uintptr_t *node_out, uintptr_t graph, const uintptr_t *deps,
                                     size_t n_deps, const HostNodeParams *p) {
    FAIL_IF_INJECTED("cuGraphAddHostNode");
    char dep_text[128] = "";
    for (size_t i = 0; i < n_deps && i < 4; i++) {
        size_t used = strlen(dep_text);
        snprintf(dep_text + used, sizeof dep_text - used, "%s%#lx", i ? "," : "",
                 (unsigned long)deps[i]);
    }
    pthread_mutex_lock(&lock);
    if (n_nodes >= MAX_ITEMS) { pthread_mutex_unlock(&lock); return ERR_INVALID_VALUE; }
    size_t i = n_nodes++;
    nodes[i] = (Node){graph, p->fn, p->userData};
    pthread_mutex_unlock(&lock);
    *node_out = NODE_HANDLE(i);
    logf_("cuGraphAddHostNode graph=%#lx node=%#lx ndeps=%zu deps=[%s] fn=%#lx userData=%lu gil=%d",
          (unsigned long)graph, (unsigned long)*node_out, n_deps, dep_text,
          (unsigned long)(uintptr_t)p->fn, (unsigned long)(uintptr_t)p->userData, gil_held());
    return OK;
}

static CUresult f_cuStreamUpdateCaptureDependencies_v2(uintptr_t s, const uintptr_t *deps,
                                                       const EdgeData *edge_data, size_t n,
                                                       unsigned flags) {
    FAIL_IF_INJECTED("cuStreamUpdateCaptureDependencies");
    if (!(cap_graph && s == cap_stream)) return ERR_ILLEGAL_STATE;
    if (n > 8) return ERR_INVALID_VALUE;
    if (flags == 1) n_cap_deps = 0;                  /* CU_STREAM_SET_CAPTURE_DEPENDENCIES */
    for (size_t i = 0; i < n && n_cap_deps < 8; i++) cap_deps[n_cap_deps++] = deps[i];
    logf_("cuStreamUpdateCaptureDependencies_v2 stream=%#lx n=%zu first=%#lx edge_data=%d flags=%u gil=%d",
          (unsigned long)s, n, (unsigned long)(n ? deps[0] : 0), edge_data != NULL, flags, gil_held());
    return OK;
}

static CUresult f_cuUserObjectCreate(uintptr_t *obj_out, void *ptr, CUhostFn destroy,
                                     unsigned refs, unsigned flags) {
    FAIL_IF_INJECTED("cuUserObjectCreate");
    pthread_mutex_lock(&lock);
    if (n_uobjs >= MAX_ITEMS) { pthread_mutex_unlock(&lock); return ERR_INVALID_VALUE; }
    size_t i = n_uobjs++;
    uobjs[i] = (UserObj){0, destroy, ptr, (int)refs, 0};
    pthread_mutex_unlock(&lock);
    *obj_out = UOBJ_HANDLE(i);
    logf_("cuUserObjectCreate obj=%#lx ptr=%lu destroy=%#lx refs=%u flags=%u gil=%d",
          (unsigned long)*obj_out, (unsigned long)(uintptr_t)ptr, (unsigned long)(uintptr_t)destroy,
          refs, flags, gil_held());
    return OK;
}

static CUresult f_cuGraphRetainUserObject(uintptr_t graph, uintptr_t obj, unsigned count,
                                          unsigned flags) {
    FAIL_IF_INJECTED("cuGraphRetainUserObject");
    size_t i = obj - UOBJ_HANDLE(0);
    if (i >= n_uobjs) return ERR_INVALID_VALUE;
    uobjs[i].graph = graph;
    logf_("cuGraphRetainUserObject graph=%#lx obj=%#lx count=%u flags=%u gil=%d",
          (unsigned long)graph, (unsigned long)obj, count, flags, gil_held());
    return OK;
}

static void *run_destroy_one(void *arg) {
    UserObj *u = arg;
    u->destroy(u->ptr);
    return NULL;
}

static CUresult f_cuUserObjectRelease(uintptr_t obj, unsigned count) {
    size_t i = obj - UOBJ_HANDLE(0);
    if (i >= n_uobjs) return ERR_INVALID_VALUE;
    logf_("cuUserObjectRelease obj=%#lx count=%u gil=%d", (unsigned long)obj, count, gil_held());
    uobjs[i].refs -= (int)count;
    if (uobjs[i].refs <= 0 && !uobjs[i].destroyed) {
        pthread_t t;
        uobjs[i].destroyed = 1;
        if (pthread_create(&t, NULL, run_destroy_one, &uobjs[i]) == 0) pthread_join(t, NULL);
    }
    return OK;
}

/* eager host functions: one pthread each, chained so they run in launch order */
typedef struct Job { CUhostFn fn; void *ud; pthread_t prev; int has_prev; } Job;
static pthread_t last_job;
static int has_last_job;
static volatile int jobs_pending;

static void *run_job(void *arg) {
    Job *job = arg;
    if (job->has_prev) pthread_join(job->prev, NULL);
    job->fn(job->ud);
    __sync_fetch_and_sub(&jobs_pending, 1);
    free(job);
    return NULL;
}

static CUresult f_cuLaunchHostFunc(uintptr_t s, CUhostFn fn, void *ud) {
    FAIL_IF_INJECTED("cuLaunchHostFunc");
    logf_("cuLaunchHostFunc stream=%#lx fn=%#lx userData=%#lx gil=%d", (unsigned long)s,
          (unsigned long)(uintptr_t)fn, (unsigned long)(uintptr_t)ud, gil_held());
    Job *job = malloc(sizeof *job);
    pthread_mutex_lock(&lock);
    *job = (Job){fn, ud, last_job, has_last_job};
    __sync_fetch_and_add(&jobs_pending, 1);
    pthread_create(&last_job, NULL, run_job, job);
    has_last_job = 1;
    pthread_mutex_unlock(&lock);
    return OK;
}

static CUresult f_cuStreamSynchronize(uintptr_t s) {
    FAIL_IF_INJECTED("cuStreamSynchronize");
    logf_("cuStreamSynchronize stream=%#lx gil=%d", (unsigned long)s, gil_held());
    pthread_mutex_lock(&lock);
    int join = has_last_job;
    pthread_t t = last_job;
    has_last_job = 0;
    pthread_mutex_unlock(&lock);
    if (join) pthread_join(t, NULL);
    return OK;
}

static CUresult f_cuStreamQuery(uintptr_t s) {
    (void)s;
    return jobs_pending ? ERR_NOT_READY : OK;
}

/* ---- symbol table ---- */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status);
typedef struct { const char *name; int min_version; void *fn; } Sym;
static const Sym table[] = {
    {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2},
    {"cuInit", 2000, (void *)f_cuInit},
    {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuStreamIsCapturing", 10000, (void *)f_cuStreamIsCapturing},
    {"cuStreamGetCaptureInfo", 12030, (void *)f_cuStreamGetCaptureInfo_v3},
    {"cuStreamGetCaptureInfo", 11030, (void *)f_cuStreamGetCaptureInfo_v2},
    {"cuStreamUpdateCaptureDependencies", 12030, (void *)f_cuStreamUpdateCaptureDependencies_v2},
    {"cuGraphAddHostNode", 10000, (void *)f_cuGraphAddHostNode},
    {"cuUserObjectCreate", 11030, (void *)f_cuUserObjectCreate},
    {"cuGraphRetainUserObject", 11030, (void *)f_cuGraphRetainUserObject},
    {"cuUserObjectRelease", 11030, (void *)f_cuUserObjectRelease},
    {"cuLaunchHostFunc", 10000, (void *)f_cuLaunchHostFunc},
    {"cuStreamSynchronize", 2000, (void *)f_cuStreamSynchronize},
    {"cuStreamQuery", 2000, (void *)f_cuStreamQuery},
};

/* The real driver picks the newest ABI not newer than cudaVersion; so does the fake (the table
 * lists a name's newer ABI first). Names not in the table are reported as not found. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                             int *status) {
    (void)flags;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(symbol, table[i].name) == 0 && version >= table[i].min_version) {
            *pfn = table[i].fn;
            if (status) *status = 0;
            return OK;
        }
    }
    *pfn = NULL;
    if (status) *status = 1;   /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return ERR_NOT_FOUND;
}

/* ---- test controls (called through ctypes) ---- */
const char *fake_log(void) { return log_buf ? log_buf : ""; }

void fake_fail(const char *name, int code) {
    pthread_mutex_lock(&lock);
    snprintf(fail_name, sizeof fail_name, "%s", name);
    fail_code = code;
    pthread_mutex_unlock(&lock);
}

void fake_begin_capture(uintptr_t stream, uintptr_t graph) {
    cap_stream = stream;
    cap_graph = graph;
    cap_deps[0] = ROOT_NODE;
    n_cap_deps = 1;
    memset(cap_edges, 0, sizeof cap_edges);
}

void fake_end_capture(void) { cap_stream = 0; cap_graph = 0; n_cap_deps = 0; }

typedef struct { uintptr_t graph; int times; } ReplayArgs;

static void *run_replay(void *arg) {
    ReplayArgs *r = arg;
    for (int t = 0; t < r->times; t++)
        for (size_t i = 0; i < n_nodes; i++)
            if (nodes[i].graph == r->graph) nodes[i].fn(nodes[i].user_data);
    return NULL;
}

/* Must be called with the GIL released (ctypes.CDLL releases it), since the callbacks take it. */
int fake_replay(uintptr_t graph, int times) {
    ReplayArgs r = {graph, times};
    pthread_t t;
    if (pthread_create(&t, NULL, run_replay, &r)) return -1;
    pthread_join(t, NULL);
    return 0;
}

static void *run_destroy(void *arg) {
    uintptr_t graph = *(uintptr_t *)arg;
    for (size_t i = 0; i < n_uobjs; i++) {
        if (uobjs[i].graph == graph && !uobjs[i].destroyed) {
            uobjs[i].destroyed = 1;
            uobjs[i].destroy(uobjs[i].ptr);
        }
    }
    return NULL;
}

/* Destroys the graph: every user object it owns has its destructor called on a pthread. */
int fake_destroy_graph(uintptr_t graph) {
    pthread_t t;
    if (pthread_create(&t, NULL, run_destroy, &graph)) return -1;
    pthread_join(t, NULL);
    logf_("fake_destroy_graph graph=%#lx", (unsigned long)graph);
    return 0;
}

/* ---- native host functions for tests: counters at user_data ---- */
typedef struct { int64_t calls, calls_with_gil, retains, releases; } FakeProbe;

void fake_probe_call(void *user_data) {
    FakeProbe *p = user_data;
    if (gil_held() != 0) __sync_fetch_and_add(&p->calls_with_gil, 1);
    __sync_fetch_and_add(&p->calls, 1);
}

void fake_probe_retain(void *user_data) {
    __sync_fetch_and_add(&((FakeProbe *)user_data)->retains, 1);
}

void fake_probe_release(void *user_data) {
    __sync_fetch_and_add(&((FakeProbe *)user_data)->releases, 1);
}
