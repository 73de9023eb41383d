/* kernel_profile.c: a CUPTI injection library (CUDA_INJECTION64_PATH) that records every
 * kernel, memcpy and memset the GPU runs, with device-side timestamps, and prints at exit a
 * per-kernel profile, grouped by CUDA graph replay. See README.md.
 *
 * Kernels of a graph replay carry the graph's id (graphId) and the correlation id of the
 * cuGraphLaunch that launched them: (graphId, correlationId) is one replay. A driver API
 * callback on cuGraphLaunch maps that correlation id to the executable graph's id.
 * The library must never take the host program down: every CUPTI error prints one line and
 * the library carries on with less. */
#define _GNU_SOURCE
#include <cupti.h> /* also cuda.h and generated_cuda_meta.h (the API params structs) */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define BUF_SIZE ((size_t)8 << 20)
#define TOP_GRAPH 25
#define TOP_OTHER 15
#define NAME_W 100

enum { K_KERNEL, K_MEMCPY, K_MEMSET };
typedef struct { uint64_t start, end, bytes; uint32_t graph, exec, corr, name; int kind; } Rec;
typedef struct { uint32_t corr, exec; } Launch;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* records, names, counters */
static pthread_mutex_t launch_mu = PTHREAD_MUTEX_INITIALIZER; /* launches */
static Rec *recs;
static size_t nrecs, cap_recs;
static Launch *launches;
static size_t nlaunch, cap_launch;
static char **names; /* interned names, index = Rec.name */
static size_t nnames, cap_names;
static uint32_t *htab; /* open addressing, name index + 1, 0 = empty */
static size_t hcap;
static uint64_t dropped, no_ts, lost; /* CUPTI dropped, no timestamps, out of memory */

static void cupti_err(const char *what, CUptiResult st)
{
    const char *s = NULL;
    if (cuptiGetResultString(st, &s) != CUPTI_SUCCESS || !s) s = "?";
    fprintf(stderr, "kernel_profile: %s failed: %s (%d)\n", what, s, (int)st);
}
static int ok(const char *what, CUptiResult st)
{
    if (st != CUPTI_SUCCESS) cupti_err(what, st);
    return st == CUPTI_SUCCESS;
}
#define CHECK(call) ok(#call, (call))

/* Returns p grown to hold `need` elements (*cap updated), or NULL with p untouched. */
static void *grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return p;
    size_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void *q = realloc(p, c * elem);
    if (q) *cap = c;
    return q;
}

static uint64_t fnv(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

/* Under mu. The index of name s, added if new; UINT32_MAX when out of memory. */
static uint32_t intern(const char *s)
{
    if (!s) s = "(unnamed)";
    if ((nnames + 1) * 2 > hcap) {
        size_t nc = hcap ? hcap * 2 : 1024;
        uint32_t *nt = calloc(nc, sizeof *nt);
        if (!nt) return UINT32_MAX;
        for (size_t i = 0; i < nnames; i++) {
            size_t j = fnv(names[i]) & (nc - 1);
            while (nt[j]) j = (j + 1) & (nc - 1);
            nt[j] = (uint32_t)i + 1;
        }
        free(htab), htab = nt, hcap = nc;
    }
    size_t j = fnv(s) & (hcap - 1);
    for (; htab[j]; j = (j + 1) & (hcap - 1))
        if (!strcmp(names[htab[j] - 1], s)) return htab[j] - 1;
    char **nn = grow(names, &cap_names, nnames + 1, sizeof *names);
    char *copy = nn ? strdup(s) : NULL;
    if (nn) names = nn;
    if (!copy) return UINT32_MAX;
    names[nnames] = copy;
    htab[j] = (uint32_t)nnames + 1;
    return (uint32_t)nnames++;
}

static void add_locked(int kind, const char *name, uint64_t start, uint64_t end, uint64_t bytes,
                       uint32_t graph, uint32_t corr)
{
    if (end < start || (start == 0 && end == 0)) { no_ts++; return; }
    uint32_t n = intern(name);
    Rec *r = grow(recs, &cap_recs, nrecs + 1, sizeof *recs);
    if (n == UINT32_MAX || !r) { lost++; return; }
    recs = r;
    recs[nrecs++] = (Rec){ start, end, bytes, graph, 0, corr, n, kind };
}

/* Exported for the self-test: one record, as the buffer callback would add it. */
EXPORT void kernel_profile_add(int kind, const char *name, uint64_t start, uint64_t end,
                               uint64_t bytes, uint32_t graph, uint32_t corr)
{
    pthread_mutex_lock(&mu);
    add_locked(kind, name, start, end, bytes, graph, corr);
    pthread_mutex_unlock(&mu);
}

/* One cuGraphLaunch seen by the API callback (exported for the self-test too). */
EXPORT void kernel_profile_add_launch(uint32_t corr, uint32_t exec)
{
    pthread_mutex_lock(&launch_mu);
    Launch *l = grow(launches, &cap_launch, nlaunch + 1, sizeof *launches);
    if (l) launches = l, launches[nlaunch++] = (Launch){ corr, exec };
    pthread_mutex_unlock(&launch_mu);
}

static const char *memcpy_name(uint8_t kind)
{
    switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "[memcpy DtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "[memcpy HtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "[memcpy PtoP]";
    default: return "[memcpy other]";
    }
}

static void CUPTIAPI buf_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    void *p = NULL;
    if (posix_memalign(&p, 8, BUF_SIZE)) p = NULL;
    *buf = p, *size = p ? BUF_SIZE : 0, *max_records = 0;
}

/* May run on CUPTI's own thread. */
static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                   size_t valid)
{
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *a = NULL;
    pthread_mutex_lock(&mu);
    for (;;) {
        CUptiResult st = cuptiActivityGetNextRecord(buf, valid, &a);
        if (st == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
        if (st != CUPTI_SUCCESS) { cupti_err("cuptiActivityGetNextRecord", st); break; }
        if (a->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || a->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const void *)a;
            add_locked(K_KERNEL, k->name, k->start, k->end, 0, k->graphId, k->correlationId);
        } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const void *)a;
            add_locked(K_MEMCPY, memcpy_name(m->copyKind), m->start, m->end, m->bytes, m->graphId,
                       m->correlationId);
        } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const void *)a;
            add_locked(K_MEMSET, "[memset]", m->start, m->end, m->bytes, m->graphId, m->correlationId);
        } /* other kinds: skipped */
    }
    size_t d = 0;
    if (cuptiActivityGetNumDroppedRecords(NULL, 0, &d) == CUPTI_SUCCESS) dropped += d;
    pthread_mutex_unlock(&mu);
    free(buf);
}

/* Driver API callback, on the launching thread: cuGraphLaunch{,_ptsz} at its exit. */
static void CUPTIAPI on_api(void *user, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    const CUpti_CallbackData *cb = data;
    (void)user;
    if (dom != CUPTI_CB_DOMAIN_DRIVER_API || cb->callbackSite != CUPTI_API_EXIT) return;
    CUgraphExec g = NULL;
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch)
        g = ((const cuGraphLaunch_params *)cb->functionParams)->hGraph;
    else if (cbid == CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz)
        g = ((const cuGraphLaunch_ptsz_params *)cb->functionParams)->hGraphExec;
    else return;
    if (cb->functionReturnValue && *(const CUresult *)cb->functionReturnValue != CUDA_SUCCESS) return;
    uint32_t exec = 0;
    if (g && cuptiGetGraphExecId(g, &exec) != CUPTI_SUCCESS) exec = 0;
    kernel_profile_add_launch(cb->correlationId, exec);
}

/* ---- report ---- */
static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}
static int cmp_launch(const void *a, const void *b)
{
    uint32_t x = ((const Launch *)a)->corr, y = ((const Launch *)b)->corr;
    return (x > y) - (x < y);
}
static int cmp_rec(const void *a, const void *b)
{
    const Rec *x = a, *y = b;
#define C(f) if (x->f != y->f) return x->f < y->f ? -1 : 1
    C(graph); C(exec); C(corr); C(start);
#undef C
    return 0;
}
static const Launch *find_launch(uint32_t corr)
{
    Launch key = { corr, 0 };
    return nlaunch ? bsearch(&key, launches, nlaunch, sizeof key, cmp_launch) : NULL;
}
/* Median in ns (sorts v). */
static double median(uint64_t *v, size_t n)
{
    if (!n) return 0;
    qsort(v, n, sizeof *v, cmp_u64);
    return n % 2 ? (double)v[n / 2] : ((double)v[n / 2 - 1] + (double)v[n / 2]) / 2;
}

typedef struct { uint32_t name; uint64_t count, bytes; double ns; } Agg;
static int cmp_agg(const void *a, const void *b)
{
    double x = ((const Agg *)a)->ns, y = ((const Agg *)b)->ns;
    return (x < y) - (x > y);
}

typedef char *(*demangle_fn)(const char *, char *, size_t *, int *);
static demangle_fn demangler(void)
{
    void *f = dlsym(RTLD_DEFAULT, "__cxa_demangle");
    void *h = f ? NULL : dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_LOCAL);
    if (h) f = dlsym(h, "__cxa_demangle");
    demangle_fn fn;
    memcpy(&fn, &f, sizeof fn);
    return fn;
}
static void put_name(FILE *f, const char *n, demangle_fn dm)
{
    int st = -1;
    char *d = dm && !strncmp(n, "_Z", 2) ? dm(n, NULL, NULL, &st) : NULL;
    const char *s = d && st == 0 ? d : n;
    if (!strncmp(s, "void ", 5)) s += 5;
    fprintf(f, "%.*s%s\n", NAME_W, s, strlen(s) > NAME_W ? "..." : "");
    free(d);
}

/* Aggregates recs[a, b) by name into *out (sorted by time, heaviest first); returns the count. */
static size_t aggregate(size_t a, size_t b, int kind, Agg **out)
{
    Agg *all = calloc(nnames ? nnames : 1, sizeof *all);
    size_t n = 0;
    if (!all) return *out = NULL, 0;
    for (size_t i = a; i < b; i++) {
        if (kind >= 0 && recs[i].kind != kind) continue;
        Agg *g = &all[recs[i].name];
        g->name = recs[i].name, g->count++, g->bytes += recs[i].bytes;
        g->ns += (double)(recs[i].end - recs[i].start);
    }
    for (size_t i = 0; i < nnames; i++) if (all[i].count) all[n++] = all[i];
    qsort(all, n, sizeof *all, cmp_agg);
    return *out = all, n;
}

/* One graph (one executable graph): recs[a, b), sorted by replay (corr), then start. */
static void report_graph(FILE *sum, FILE *det, size_t a, size_t b, size_t skip, demangle_fn dm)
{
    size_t nrep = 0, used = 0, matched = 0, overlap = 0, first = a;
    for (size_t i = a; i < b; i++) nrep += i == a || recs[i].corr != recs[i - 1].corr;
    uint64_t *v = calloc(6 * (nrep + 1), sizeof *v);
    if (!v) return;
    uint64_t *span = v, *busy = v + nrep, *gap = v + 2 * nrep, *nk = v + 3 * nrep, *nm = v + 4 * nrep;
    uint64_t *starts = v + 5 * nrep;
    size_t r = 0;
    for (size_t i = a; i < b;) {
        size_t j = i;
        uint64_t s = recs[i].start, e = 0, sum_ns = 0, k = 0;
        for (; j < b && recs[j].corr == recs[i].corr; j++) {
            if (recs[j].start < e) overlap++;
            if (recs[j].end > e) e = recs[j].end;
            sum_ns += recs[j].end - recs[j].start;
            k += recs[j].kind == K_KERNEL;
        }
        if (r++ < skip) { i = first = j; continue; } /* warm-up replay */
        matched += find_launch(recs[i].corr) != NULL;
        span[used] = e - s, busy[used] = sum_ns, gap[used] = e - s > sum_ns ? e - s - sum_ns : 0;
        nk[used] = k, nm[used] = (j - i) - k, starts[used] = s, used++;
        i = j;
    }
    uint64_t *period = starts; /* in place: intervals between consecutive replays' starts */
    for (size_t i = 0; i + 1 < used; i++) period[i] = starts[i + 1] > starts[i] ? starts[i + 1] - starts[i] : 0;
    double m_period = used > 1 ? median(period, used - 1) : 0;
    double m_k = median(nk, used), m_span = median(span, used), m_busy = median(busy, used);
    double m_gap = median(gap, used), m_m = median(nm, used); /* median() sorts: span[0] = min */
    fprintf(sum, "%6u %6u %8zu %6zu %9.0f %9.0f %12.1f %12.1f %12.1f %6.1f%% %12.1f\n",
            recs[a].graph, recs[a].exec, nrep, used, m_k, m_m,
            m_span / 1e3, m_busy / 1e3, m_gap / 1e3, m_span > 0 ? 100 * m_gap / m_span : 0, m_period / 1e3);
    fprintf(det, "\n-- graph %u (exec %u): %zu replays, %zu used (first %zu skipped), %zu matched to a "
            "cuGraphLaunch callback\n", recs[a].graph, recs[a].exec, nrep, used, nrep - used, matched);
    if (!used) { free(v); return; }
    fprintf(det, "   per replay, median: %.0f kernels, span %.1f us, busy %.1f us, gaps %.1f us; span min %.1f "
            "max %.1f us\n", m_k, m_span / 1e3, m_busy / 1e3, m_gap / 1e3, span[0] / 1e3, span[used - 1] / 1e3);
    if (recs[a].corr == 0)
        fprintf(det, "   note: correlation id 0: this CUPTI does not tell this graph's replays apart\n");
    if (overlap)
        fprintf(det, "   note: %zu ops overlap an earlier one of their replay: busy (a sum) then "
                "exceeds the covered time, and gaps are clamped at 0\n", overlap);
    Agg *g;
    size_t n = aggregate(first, b, -1, &g);
    double total = 0;
    for (size_t i = 0; i < n; i++) total += g[i].ns;
    fprintf(det, "   %9s %11s %7s  %s\n", "n/replay", "us/replay", "share", "name (mean over replays)");
    double rest = 0, rest_n = 0;
    for (size_t i = 0; i < n; i++) {
        double c = (double)g[i].count / used, us = g[i].ns / used / 1e3, sh = total > 0 ? 100 * g[i].ns / total : 0;
        if (i >= TOP_GRAPH) { rest += us, rest_n += c; continue; }
        fprintf(det, "   %9.2f %11.1f %6.1f%%  ", c, us, sh);
        put_name(det, names[g[i].name], dm);
    }
    if (n > TOP_GRAPH)
        fprintf(det, "   %9.2f %11.1f %6.1f%%  (%zu other names)\n", rest_n, rest,
                total > 0 ? 100 * rest * 1e3 * used / total : 0, n - TOP_GRAPH);
    free(g), free(v);
}

static void report_outside(FILE *f, size_t b, demangle_fn dm)
{
    Agg *g;
    size_t n = aggregate(0, b, K_KERNEL, &g);
    double total = 0, rest = 0;
    uint64_t cnt = 0, rest_n = 0, mem = 0;
    for (size_t i = 0; i < b; i++) mem += recs[i].kind != K_KERNEL;
    for (size_t i = 0; i < n; i++) total += g[i].ns, cnt += g[i].count;
    fprintf(f, "\n== outside graphs: %llu kernels, %.1f us of kernel time, %zu names ==\n",
            (unsigned long long)cnt, total / 1e3, n);
    fprintf(f, "   %9s %11s %9s %7s  %s\n", "count", "total us", "mean us", "share", "name");
    for (size_t i = 0; i < n; i++) {
        if (i >= TOP_OTHER) { rest += g[i].ns, rest_n += g[i].count; continue; }
        fprintf(f, "   %9llu %11.1f %9.2f %6.1f%%  ", (unsigned long long)g[i].count, g[i].ns / 1e3,
                g[i].ns / 1e3 / g[i].count, total > 0 ? 100 * g[i].ns / total : 0);
        put_name(f, names[g[i].name], dm);
    }
    if (n > TOP_OTHER)
        fprintf(f, "   %9llu %11.1f %9.2f %6.1f%%  (%zu other names)\n", (unsigned long long)rest_n,
                rest / 1e3, rest / 1e3 / rest_n, total > 0 ? 100 * rest / total : 0, n - TOP_OTHER);
    free(g);
    fprintf(f, "   memcpy/memset outside graphs:%s\n", mem ? "" : " none");
    for (int kind = K_MEMCPY; kind <= K_MEMSET; kind++) {
        n = aggregate(0, b, kind, &g);
        for (size_t i = 0; i < n; i++)
            fprintf(f, "   %-15s %9llu ops %12.3f MB %11.1f us\n", names[g[i].name],
                    (unsigned long long)g[i].count, g[i].bytes / 1e6, g[i].ns / 1e3);
        free(g);
    }
}

/* Exported for the self-test: the whole report, on f. */
EXPORT void kernel_profile_report(FILE *f)
{
    const char *e = getenv("KERNEL_PROFILE_SKIP_REPLAYS");
    size_t skip = e ? strtoul(e, NULL, 10) : 0;
    pthread_mutex_lock(&mu);
    pthread_mutex_lock(&launch_mu);
    if (nlaunch) qsort(launches, nlaunch, sizeof *launches, cmp_launch);
    for (size_t i = 0; i < nrecs; i++) {
        const Launch *l = recs[i].graph ? find_launch(recs[i].corr) : NULL;
        recs[i].exec = l ? l->exec : 0;
    }
    if (nrecs) qsort(recs, nrecs, sizeof *recs, cmp_rec); /* graph 0 (outside graphs) first */
    size_t b = 0, ngraph = 0;
    while (b < nrecs && recs[b].graph == 0) b++;
    for (size_t i = b; i < nrecs; i++)
        ngraph += i == b || recs[i].graph != recs[i - 1].graph || recs[i].exec != recs[i - 1].exec;
    fprintf(f, "\n== kernel_profile (pid %d): %zu ops recorded (device-side timestamps), %llu dropped by "
            "CUPTI, %llu without timestamps, %llu lost (out of memory); %zu cuGraphLaunch calls seen; "
            "%zu graphs ==\n", (int)getpid(), nrecs, (unsigned long long)dropped,
            (unsigned long long)no_ts, (unsigned long long)lost, nlaunch, ngraph);
    demangle_fn dm = demangler();
    if (ngraph) {
        char *text = NULL;
        size_t len = 0;
        FILE *det = open_memstream(&text, &len);
        fprintf(f, "per graph, medians over the replays used (first %zu of each skipped: "
                "KERNEL_PROFILE_SKIP_REPLAYS); gaps = span - busy; period = start to next replay's start\n", skip);
        fprintf(f, "%6s %6s %8s %6s %9s %9s %12s %12s %12s %7s %12s\n", "graph", "exec", "replays", "used",
                "kernels", "+mem ops", "span us", "busy us", "gaps us", "gaps", "period us");
        for (size_t i = b, j; i < nrecs; i = j) {
            for (j = i + 1; j < nrecs && recs[j].graph == recs[i].graph && recs[j].exec == recs[i].exec;) j++;
            report_graph(f, det ? det : f, i, j, skip, dm);
        }
        if (det) fclose(det), fputs(text, f), free(text);
    }
    report_outside(f, b, dm);
    fflush(f);
    pthread_mutex_unlock(&launch_mu);
    pthread_mutex_unlock(&mu);
}

static void at_exit(void)
{
    CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    const char *path = getenv("KERNEL_PROFILE_OUT");
    FILE *f = NULL;
    char buf[4096];
    if (path && *path) {
        const char *p = strstr(path, "%p");
        if (p) snprintf(buf, sizeof buf, "%.*s%d%s", (int)(p - path), path, (int)getpid(), p + 2);
        else snprintf(buf, sizeof buf, "%s", path);
        if (!(f = fopen(buf, p ? "w" : "a"))) fprintf(stderr, "kernel_profile: cannot open %s\n", buf);
    }
    kernel_profile_report(f ? f : stderr);
    if (f) fclose(f), fprintf(stderr, "kernel_profile: report written to %s\n", buf);
}

/* Called by the CUDA driver in cuInit when CUDA_INJECTION64_PATH names this library. */
EXPORT int InitializeInjection(void)
{
    static int done;
    if (done++) return 1;
    if (!CHECK(cuptiActivityRegisterCallbacks(buf_requested, buf_completed))) return 1;
    int on = CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    on += CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    on += CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    CUpti_SubscriberHandle sub;
    int cb = 0;
    if (CHECK(cuptiSubscribe(&sub, on_api, NULL))) { /* fails if another CUPTI client subscribed */
        cb = CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch));
        cb += CHECK(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz));
    }
    atexit(at_exit); /* after CUPTI's own set-up, so it runs before CUPTI's teardown */
    fprintf(stderr, "kernel_profile: %d of 3 activity kinds (kernel, memcpy, memset) and %d of 2 cuGraphLaunch "
            "callbacks enabled; report at exit\n", on, cb);
    return 1;
}
