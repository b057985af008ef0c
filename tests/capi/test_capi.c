/*
 * A C test of libstitch_alloc.so through include/stitch_alloc.h, run by tests/capi.rs.
 *
 *   test_capi main      STITCH_ALLOC_CONF=backend:host,capacity_bytes:256MiB,devices:2,...
 *       normal use through the returned pointers (host memory is real), then every bad
 *       input: size 0, size near SIZE_MAX, NULL/unknown/interior/double free, bad device,
 *       wrong device, late memory fraction, record_stream of an unknown pointer; threads.
 *       Prints the stats JSON of device 0 on a line "STATS_JSON {...}" for the Rust side
 *       to parse.
 *   test_capi sim       with backend:sim: accounting-only allocations of tens of GiB, an
 *       out-of-memory failure, the stats; with on_oom:abort the process aborts at the
 *       last allocation.
 *   test_capi badconf NEEDLE   with an invalid STITCH_ALLOC_CONF: every call fails cleanly
 *       and the last error contains NEEDLE.
 *   test_capi ipc       CUDA IPC on the host backend: shares a 9 MiB allocation made of
 *       several handles (max_handle:4MiB) and runs itself again (fork + exec: a fresh process)
 *       as "ipc_child MESSAGE-HEX OFFSET", which opens it, checks the parent's bytes, writes
 *       its own, opens it twice more (the same base), closes it; the parent then reads the
 *       child's bytes. Also the bad inputs of stitch_share / stitch_ipc_open / _close.
 *   test_capi fork      forks (20 times) while another thread allocates and frees without
 *       pause; in each child every call must fail at once with "forked child" (a 10 s alarm
 *       turns a hang into a failure).
 *
 * Prints one line per check and "N passed, N failed"; exits 0 only if none failed.
 */
#include "stitch_alloc.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int passed = 0;
static int failed = 0;

#define CHECK(cond, what)                                                                  \
    do {                                                                                   \
        if (cond) {                                                                        \
            passed++;                                                                      \
            printf("ok   %s\n", what);                                                     \
        } else {                                                                           \
            failed++;                                                                      \
            printf("FAIL %s (line %d; last error: \"%s\")\n", what, __LINE__,              \
                   stitch_last_error());                                                   \
        }                                                                                  \
    } while (0)

#define MIB ((size_t)1 << 20)

/* Whether the last error contains `needle`. */
static int error_has(const char* needle) {
    const char* e = stitch_last_error();
    return e != NULL && strstr(e, needle) != NULL;
}

static int error_empty(void) {
    const char* e = stitch_last_error();
    return e != NULL && e[0] == '\0';
}

static void fill(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        p[i] = (unsigned char)((i * 31u + seed) & 0xff);
    }
}

static int verify(const unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != (unsigned char)((i * 31u + seed) & 0xff)) {
            return 0;
        }
    }
    return 1;
}

/* --- threads ------------------------------------------------------------------------ */

#define THREADS 4
#define ROUNDS 500

struct worker {
    int id;
    int ok;
};

static void* work(void* arg) {
    struct worker* w = (struct worker*)arg;
    w->ok = 1;
    void* held[8] = {0};
    for (int r = 0; r < ROUNDS; r++) {
        int slot = r % 8;
        if (held[slot] != NULL) {
            if (!verify((unsigned char*)held[slot], 64, (unsigned)(w->id * 1000 + slot))) {
                w->ok = 0;
            }
            stitch_free(held[slot], 0, 0, NULL);
        }
        size_t size = (size_t)(512 + (r * 7919 + w->id * 104729) % (3 * MIB));
        held[slot] = stitch_malloc(size, 0, NULL);
        if (held[slot] == NULL) {
            w->ok = 0;
            continue;
        }
        fill((unsigned char*)held[slot], 64, (unsigned)(w->id * 1000 + slot));
    }
    for (int i = 0; i < 8; i++) {
        if (held[i] != NULL) {
            stitch_free(held[i], 0, 0, NULL);
        }
    }
    /* An error on this thread is not visible on others. */
    if (stitch_malloc(SIZE_MAX, 0, NULL) != NULL || !error_has("too large")) {
        w->ok = 0;
    }
    return NULL;
}

/* --- the normal configuration --------------------------------------------------------- */

static int run_main(void) {
    const char* v = stitch_version();
    CHECK(v != NULL && v[0] != '\0', "version string is not empty");
    printf("     version %s\n", v);
    CHECK(error_empty(), "no error before any failure");

    stitch_init(2);
    CHECK(error_empty(), "init with a valid configuration sets no error");

    /* Memory fraction before the first allocation of device 1: half of 256 MiB. */
    stitch_memory_fraction(0.5, 1);
    CHECK(error_empty(), "memory fraction before first use is accepted");

    /* Normal use: the memory is real and keeps its bytes. */
    unsigned char* a = (unsigned char*)stitch_malloc(MIB, 0, NULL);
    CHECK(a != NULL, "malloc 1 MiB");
    CHECK(((uintptr_t)a % 512) == 0, "pointer is 512-byte aligned");
    unsigned char* b = (unsigned char*)stitch_malloc(10 * MIB + 3, 0, NULL);
    CHECK(b != NULL && b != a, "malloc 10 MiB + 3");
    unsigned char* c = (unsigned char*)stitch_malloc(100, 0, (void*)0x10);
    CHECK(c != NULL, "malloc 100 bytes on another stream");
    if (a == NULL || b == NULL || c == NULL) {
        return 1;
    }
    fill(a, MIB, 1);
    fill(b, 10 * MIB + 3, 2);
    fill(c, 100, 3);
    CHECK(verify(a, MIB, 1) && verify(b, 10 * MIB + 3, 2) && verify(c, 100, 3),
          "bytes written through the pointers read back");
    stitch_free(b, 10 * MIB + 3, 0, NULL);
    CHECK(error_empty(), "free with the right size sets no error");
    stitch_record_stream(a, (void*)0x20);
    CHECK(error_empty(), "record_stream of a live pointer");

    /* Fragment, then ask for more than any hole: stitching makes it contiguous. */
    void* frag[12];
    for (int i = 0; i < 12; i++) {
        frag[i] = stitch_malloc(16 * MIB, 0, NULL);
    }
    for (int i = 0; i < 12; i += 2) {
        stitch_free(frag[i], 16 * MIB, 0, NULL);
    }
    unsigned char* big = (unsigned char*)stitch_malloc(80 * MIB, 0, NULL);
    CHECK(big != NULL, "an 80 MiB block fits in holes of 16 MiB");
    if (big != NULL) {
        fill(big, 80 * MIB, 4);
        CHECK(verify(big, 80 * MIB, 4), "the stitched block is writable end to end");
        stitch_free(big, 80 * MIB, 0, NULL);
    }
    for (int i = 1; i < 12; i += 2) {
        stitch_free(frag[i], 16 * MIB, 0, NULL);
    }
    CHECK(verify(a, MIB, 1) && verify(c, 100, 3), "older allocations kept their bytes");
    CHECK(error_empty(), "no error during normal use");

    /* Bad inputs. Each leaves a last error and changes nothing. */
    stitch_clear_error();
    CHECK(stitch_malloc(0, 0, NULL) == NULL && error_empty(),
          "size 0 gives NULL and sets no error");
    stitch_clear_error();
    CHECK(stitch_malloc(SIZE_MAX, 0, NULL) == NULL && error_has("too large"),
          "size SIZE_MAX gives NULL and \"too large\"");
    CHECK(stitch_malloc(0, 0, NULL) == NULL && error_has("too large"),
          "size 0 leaves the last error (the diagnosis to read) alone");
    stitch_clear_error();
    CHECK(stitch_malloc(SIZE_MAX - 4095, 0, NULL) == NULL && error_has("too large"),
          "size SIZE_MAX - 4095 gives NULL and \"too large\"");
    stitch_clear_error();
    CHECK(stitch_malloc(257 * MIB, 0, NULL) == NULL && error_has("too large"),
          "size above the capacity gives NULL and \"too large\"");
    stitch_clear_error();
    stitch_free(NULL, 0, 0, NULL);
    CHECK(error_has("null pointer"), "free(NULL) is reported");
    stitch_clear_error();
    stitch_free((void*)0x1234, 16, 0, NULL);
    CHECK(error_has("invalid pointer") && error_has("not inside memory"),
          "free of an unknown pointer is reported");
    /* A pointer freed just before (b's memory may since have been released and re-created
       by a stitch, and an address no longer mapped is only "not inside memory"). */
    void* df = stitch_malloc(10 * MIB + 3, 0, NULL);
    stitch_free(df, 0, 0, NULL);
    stitch_clear_error();
    stitch_free(df, 0, 0, NULL);
    CHECK(error_has("double free"), "double free is reported");
    unsigned char* d = (unsigned char*)stitch_malloc(4 * MIB, 0, NULL);
    CHECK(d != NULL, "malloc 4 MiB");
    stitch_clear_error();
    stitch_free(d + 4096, 0, 0, NULL);
    CHECK(error_has("inside a live allocation"), "free of an interior pointer is reported");
    fill(d, 4 * MIB, 5);
    CHECK(verify(d, 4 * MIB, 5), "the allocation survives the bad free");
    stitch_clear_error();
    stitch_free(d, 8 * MIB, 0, NULL);
    CHECK(error_has("exceeds"), "a size larger than the allocation is reported");
    stitch_clear_error();
    stitch_free(d, 0, 0, NULL);
    CHECK(error_has("double free"), "... and the pointer was freed anyway");

    stitch_clear_error();
    CHECK(stitch_malloc(1024, 2, NULL) == NULL && error_has("out of range"),
          "device 2 of 2 is out of range");
    stitch_clear_error();
    CHECK(stitch_malloc(1024, -1, NULL) == NULL && error_has("out of range"),
          "device -1 is out of range");
    stitch_clear_error();
    stitch_free(a, MIB, 7, NULL);
    CHECK(error_has("out of range"), "free on a bad device is reported");
    CHECK(verify(a, MIB, 1), "... and frees nothing");
    stitch_clear_error();
    CHECK(stitch_empty_cache(99) == -1 && error_has("out of range"),
          "empty_cache of a bad device is -1");
    stitch_clear_error();
    CHECK(stitch_stats_json(-3) == NULL && error_has("out of range"),
          "stats of a bad device is NULL");

    /* Device 1 is an independent allocator, limited to half by the memory fraction. */
    stitch_clear_error();
    CHECK(stitch_malloc(200 * MIB, 1, NULL) == NULL && error_has("too large"),
          "device 1 holds at most its memory fraction (128 MiB)");
    void* e = stitch_malloc(100 * MIB, 1, NULL);
    CHECK(e != NULL, "device 1 serves 100 MiB");
    stitch_clear_error();
    stitch_free(e, 100 * MIB, 0, NULL);
    CHECK(error_has("belongs to device 1"), "free on the wrong device is reported");
    stitch_clear_error();
    stitch_free(e, 100 * MIB, 1, NULL);
    CHECK(error_empty(), "free on the right device");
    /* Issue #12: a late memory fraction changes the capacity at once. */
    struct stitch_device_stats ds;
    CHECK(stitch_device_stats(1, &ds, sizeof ds) == (ptrdiff_t)sizeof ds, "typed stats size");
    CHECK(ds.capacity == 128 * MIB, "device 1 has half of 256 MiB");
    stitch_memory_fraction(0.25, 1);
    CHECK(error_empty(), "a late memory fraction is accepted");
    CHECK(stitch_device_stats(1, &ds, sizeof ds) > 0 && ds.capacity == 64 * MIB,
          "the capacity is lowered at once");
    CHECK(stitch_get_memory_fraction(1) == 0.25, "get_memory_fraction");
    CHECK(stitch_malloc(100 * MIB, 1, NULL) == NULL, "an allocation beyond it fails");
    CHECK(stitch_set_memory_fraction(1, 1.0) == 0, "raised again");
    CHECK(stitch_set_memory_fraction(1, 0.0) == -1 && error_has("(0, 1]"), "0 is refused");
    stitch_clear_error();

    /* Typed statistics follow the allocations; resets. */
    void* t1 = stitch_malloc(3 * MIB, 1, NULL);
    void* t2 = stitch_malloc(5 * MIB, 1, NULL);
    CHECK(stitch_device_stats(1, &ds, sizeof ds) > 0, "typed stats");
    CHECK(ds.initialized == 1 && ds.allocated_current == 8 * MIB &&
              ds.requested_current == 8 * MIB && ds.allocations_current == 2 &&
              ds.reserved_current >= 8 * MIB,
          "typed stats: live bytes and counts");
    stitch_free(t2, 0, 1, NULL);
    CHECK(stitch_device_stats(1, &ds, sizeof ds) > 0 && ds.allocated_peak >= 8 * MIB &&
              ds.allocated_current == 3 * MIB,
          "typed stats: peak kept after a free");
    CHECK(stitch_reset_peak_stats(1) == 0, "reset_peak_stats");
    CHECK(stitch_device_stats(1, &ds, sizeof ds) > 0 && ds.allocated_peak == 3 * MIB,
          "the peak restarts from the current value");
    CHECK(stitch_reset_accumulated_stats(1) == 0, "reset_accumulated_stats");
    CHECK(stitch_device_stats(1, &ds, sizeof ds) > 0 && ds.allocations_allocated == 0 &&
              ds.allocations_freed == 0 && ds.allocations_current == 1,
          "accumulated counters zeroed, gauges kept");
    uint64_t first[2] = {7, 7};
    CHECK(stitch_device_stats(1, (struct stitch_device_stats*)first, 8) > 0 && first[0] == 1 &&
              first[1] == 7,
          "a smaller (older) struct is filled only as far as it goes");
    CHECK(stitch_device_stats(9, &ds, sizeof ds) == -1 && error_has("out of range"),
          "typed stats of a bad device");
    CHECK(stitch_device_stats(1, NULL, 0) == -1, "typed stats into NULL");
    stitch_free(t1, 0, 1, NULL);

    /* The segment log: maps of an allocation made while it records, then the unmaps of
       empty_cache, balancing; -1 for a bad device or a NULL buffer. */
    CHECK(stitch_empty_cache(1) == 0, "empty_cache before the segment log");
    CHECK(stitch_segment_log(1, 1) == 0, "segment log on");
    {
        struct stitch_segment_event ev[64];
        void* sp = stitch_malloc(48 * MIB, 1, (void*)0x40);
        CHECK(sp != NULL, "malloc with the segment log on");
        ptrdiff_t n = stitch_segment_events(1, ev, 64);
        uint64_t mapped = 0;
        int covers = 0;
        for (ptrdiff_t i = 0; i < n; i++) {
            if (ev[i].action == 1) {
                mapped += ev[i].size;
                covers |= ev[i].addr <= (uint64_t)(uintptr_t)sp &&
                          (uint64_t)(uintptr_t)sp < ev[i].addr + ev[i].size;
            }
        }
        CHECK(n > 0 && covers, "a map event covers the new allocation");
        stitch_free(sp, 0, 1, (void*)0x40);
        CHECK(stitch_empty_cache(1) == 0, "empty_cache");
        /* Everything still mapped on the device is unmapped by empty_cache, including what
           was mapped before the log was on: at least the bytes mapped above come back. */
        n = stitch_segment_events(1, ev, 64);
        uint64_t unmapped = 0;
        for (ptrdiff_t i = 0; i < n; i++) {
            if (ev[i].action == 2) {
                unmapped += ev[i].size;
            }
        }
        CHECK(unmapped >= mapped, "unmap events after empty_cache");
    }
    CHECK(stitch_segment_log(1, 0) == 0, "segment log off");
    CHECK(stitch_segment_log(100000, 1) == -1, "segment log of a bad device");
    CHECK(stitch_segment_events(1, NULL, 4) == -1, "segment events into NULL");
    CHECK(stitch_segment_events(1, NULL, 0) == 0, "no segment events once off");

    /* One physical handle per buffer (NCCL registration): usable memory, the handle count
       goes up by exactly one, freed with stitch_free; zero bytes is NULL. */
    stitch_clear_error();
    uint64_t handles_before = 0;
    {
        struct stitch_device_stats hs;
        CHECK(stitch_device_stats(1, &hs, sizeof hs) > 0, "stats before one_handle");
        handles_before = hs.segments_allocated;
    }
    void* oh = stitch_malloc_one_handle(5 * MIB + 3, 1, NULL);
    CHECK(oh != NULL, "malloc_one_handle");
    memset(oh, 0x33, 5 * MIB + 3);
    {
        struct stitch_device_stats hs;
        CHECK(stitch_device_stats(1, &hs, sizeof hs) > 0 && hs.segments_allocated == handles_before + 1,
              "one handle created for it");
    }
    stitch_free(oh, 0, 1, NULL);
    CHECK(stitch_last_error()[0] == 0, "freed with stitch_free");
    CHECK(stitch_malloc_one_handle(0, 1, NULL) == NULL, "malloc_one_handle of 0 bytes is NULL");

    /* Graph-pool allocation (no capture on the host backend: the path is the same). */
    stitch_clear_error();
    void* g = stitch_malloc_graph(2 * MIB, 1, (void*)0x30);
    CHECK(g != NULL, "malloc_graph");
    memset(g, 0x5a, 2 * MIB);
    CHECK(stitch_free_graph(g, 1) == 0, "free_graph");
    CHECK(stitch_free_graph(g, 1) == -1 && error_has("double free"), "free_graph twice");
    CHECK(stitch_malloc_graph(0, 1, NULL) == NULL, "malloc_graph of 0 bytes is NULL");
    stitch_clear_error();
    stitch_memory_fraction(1.5, 0);
    CHECK(error_has("(0, 1]"), "a fraction above 1 is reported");

    /* Retiring a stream: frees made on it are fenced and waited for; then it may go. */
    stitch_clear_error();
    void* r = stitch_malloc(3 * MIB, 0, (void*)0x30);
    CHECK(r != NULL, "malloc on a stream about to be retired");
    stitch_free(r, 3 * MIB, 0, (void*)0x30);
    CHECK(stitch_retire_stream(0, (void*)0x30) == 0 && error_empty(), "retire a stream");
    CHECK(stitch_retire_stream(0, (void*)0x31) == 0, "retire a stream nothing was freed on");
    CHECK(stitch_retire_stream(99, (void*)0x30) == -1 && error_has("device"),
          "retire on a device out of range is an error");

    stitch_clear_error();
    stitch_record_stream((void*)0x5000, (void*)0x20);
    CHECK(error_has("not a live allocation"), "record_stream of an unknown pointer");
    stitch_clear_error();
    stitch_record_stream(b, NULL);
    CHECK(error_has("not a live allocation"), "record_stream of a freed pointer");

    /* Threads. */
    pthread_t t[THREADS];
    struct worker w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i].id = i;
        w[i].ok = 0;
        pthread_create(&t[i], NULL, work, &w[i]);
    }
    int all_ok = 1;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        all_ok = all_ok && w[i].ok;
    }
    stitch_clear_error();
    CHECK(all_ok, "4 threads x 500 malloc/free with data checks");
    CHECK(error_empty(), "errors stay on their own thread");

    stitch_free(a, MIB, 0, NULL);
    stitch_free(c, 100, 0, (void*)0x10);
    CHECK(error_empty(), "last frees");

    /* Release the cache; the statistics show nothing live and nothing held. */
    CHECK(stitch_empty_cache(0) == 0, "empty_cache(0)");
    CHECK(stitch_empty_cache(1) == 0, "empty_cache(1)");
    stitch_reset();
    CHECK(error_empty(), "reset");
    const char* js = stitch_stats_json(0);
    CHECK(js != NULL && js[0] == '{' && js[strlen(js) - 1] == '}', "stats JSON is an object");
    CHECK(js != NULL && strstr(js, "\"allocated_bytes.all.current\":0") != NULL,
          "stats JSON: nothing allocated");
    if (js != NULL) {
        printf("STATS_JSON %s\n", js);
    }
    const char* js1 = stitch_stats_json(1);
    CHECK(js1 != NULL && strstr(js1, "\"initialized\":true") != NULL, "stats JSON of device 1");
    return 0;
}

/* --- the simulator: accounting only, pointers never dereferenced ------------------------ */

#define GIB ((size_t)1 << 30)

static int run_sim(void) {
    void* p = stitch_malloc(64 * GIB, 0, NULL);
    void* q = stitch_malloc(64 * GIB, 0, NULL);
    CHECK(p != NULL && q != NULL && p != q, "two 64 GiB blocks on a simulated H200");
    stitch_clear_error();
    /* With on_oom:abort the process ends inside this call. */
    CHECK(stitch_malloc(64 * GIB, 0, NULL) == NULL && error_has("out of memory"),
          "a third one is out of memory, with a diagnosis");
    stitch_free(p, 64 * GIB, 0, NULL);
    stitch_free(q, 64 * GIB, 0, NULL);
    void* r = stitch_malloc(120 * GIB, 0, NULL);
    CHECK(r != NULL, "120 GiB after freeing both");
    stitch_free(r, 0, 0, NULL);
    const char* js = stitch_stats_json(0);
    CHECK(js != NULL && strstr(js, "\"backend\":\"sim\"") != NULL, "stats name the backend");
    CHECK(js != NULL && strstr(js, "\"num_ooms\":1") != NULL, "stats count the OOM");
    void* big = stitch_malloc(100 * GIB, 0, NULL);
    void* more = stitch_malloc(100 * GIB, 0, NULL);
    CHECK(big != NULL && more == NULL, "100 GiB twice: the second fails");
    return 0;
}

/* --- an invalid configuration --------------------------------------------------------- */

static int run_badconf(const char* needle) {
    CHECK(stitch_version()[0] != '\0', "version works without a configuration");
    stitch_init(1);
    CHECK(error_has(needle), "init reports the configuration error");
    stitch_clear_error();
    CHECK(stitch_malloc(1024, 0, NULL) == NULL, "malloc returns NULL");
    CHECK(error_has("STITCH_ALLOC_CONF") && error_has(needle), "the error names the problem");
    stitch_clear_error();
    CHECK(stitch_malloc(1024, 0, NULL) == NULL && error_has(needle), "... every time");
    stitch_clear_error();
    stitch_free((void*)0x1000, 0, 0, NULL);
    CHECK(error_has(needle), "free reports it too");
    stitch_clear_error();
    CHECK(stitch_stats_json(0) == NULL && error_has(needle), "stats JSON is NULL");
    CHECK(stitch_empty_cache(0) == -1, "empty_cache is -1");
    stitch_reset();
    stitch_memory_fraction(0.5, 0);
    stitch_record_stream((void*)0x1000, NULL);
    CHECK(1, "hooks return without crashing");
    return 0;
}

/* --- fork: a child must fail every call at once, never hang ----------------------------- */

static volatile int stop_busy = 0;

static void* busy(void* arg) {
    (void)arg;
    while (!stop_busy) {
        void* p = stitch_malloc(3 * MIB, 0, NULL);
        void* q = stitch_malloc(5 * MIB, 0, NULL);
        stitch_free(p, 0, 0, NULL);
        stitch_empty_cache(0);
        stitch_free(q, 0, 0, NULL);
    }
    return NULL;
}

/* In the child: 0 when every call failed with the fork error. */
static int child_calls(void* parent_block) {
    alarm(10);
    int bad = 0;
    stitch_clear_error();
    bad |= stitch_malloc(MIB, 0, NULL) != NULL || !error_has("forked child");
    stitch_clear_error();
    stitch_free(parent_block, 0, 0, NULL);
    bad |= !error_has("forked child");
    stitch_clear_error();
    bad |= stitch_stats_json(0) != NULL || !error_has("forked child");
    stitch_clear_error();
    bad |= stitch_empty_cache(0) != -1 || !error_has("forked child");
    stitch_reset();
    stitch_record_stream(parent_block, NULL);
    bad |= !error_has("forked child");
    return bad;
}

static int run_ipc_child(const char* hex, const char* off) {
    size_t len = strlen(hex) / 2;
    uint8_t* msg = malloc(len);
    for (size_t i = 0; i < len; i++) {
        unsigned v = 0;
        sscanf(hex + 2 * i, "%2x", &v);
        msg[i] = (uint8_t)v;
    }
    uint64_t offset = strtoull(off, NULL, 10);
    void* base = NULL;
    CHECK(stitch_ipc_open(0, msg, len, &base) == 0 && base != NULL, "child: ipc_open");
    if (base == NULL) {
        return 1;
    }
    unsigned char* p = (unsigned char*)base + offset;
    CHECK(verify(p, 9 * MIB, 11), "child: sees the parent's bytes");
    fill(p, 9 * MIB, 42);
    void* again = NULL;
    CHECK(stitch_ipc_open(0, msg, len, &again) == 0 && again == base,
          "child: the same message gives the same base");
    CHECK(stitch_ipc_close(base) == 0, "child: close (one user left)");
    CHECK(verify(p, 9 * MIB, 42), "child: still mapped for the other user");
    CHECK(stitch_ipc_close(base) == 0, "child: close (the last user unmaps)");
    CHECK(stitch_ipc_close(base) == -1 && error_has("not a mapping"),
          "child: a third close is refused");
    msg[3] ^= 0xff;
    void* bad = NULL;
    CHECK(stitch_ipc_open(0, msg, len, &bad) == -1 && bad == NULL && error_has("IPC handle"),
          "child: a corrupted message is refused");
    CHECK(stitch_ipc_open(0, msg, 10, &bad) == -1, "child: a truncated message is refused");
    free(msg);
    return 0;
}

static int run_ipc(const char* self) {
    void* block = stitch_malloc(9 * MIB, 0, NULL);
    CHECK(block != NULL, "parent: a 9 MiB allocation");
    fill(block, 9 * MIB, 11);
    uint64_t offset = 77;
    ptrdiff_t need = stitch_share(block, NULL, 0, &offset);
    CHECK(need > 18 && offset == 77, "parent: share with no room says the length, writes nothing");
    uint8_t msg[4096];
    ptrdiff_t n = stitch_share(block, msg, sizeof msg, &offset);
    CHECK(n == need && offset < 4 * MIB, "parent: share");
    CHECK((n - 18) / 12 >= 3, "parent: the block spans several handles");
    CHECK(stitch_share((char*)block + 512, msg, sizeof msg, NULL) == -1 &&
              error_has("not the start of a live allocation"),
          "parent: share of an interior pointer is refused");
    CHECK(stitch_share(NULL, msg, sizeof msg, NULL) == -1, "parent: share of NULL is refused");
    char* hex = malloc(2 * (size_t)n + 1);
    for (ptrdiff_t i = 0; i < n; i++) {
        sprintf(hex + 2 * i, "%02x", msg[i]);
    }
    char off[32];
    snprintf(off, sizeof off, "%llu", (unsigned long long)offset);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execl(self, self, "ipc_child", hex, off, (char*)NULL);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child process passed");
    CHECK(verify(block, 9 * MIB, 42), "parent: sees the child's bytes");
    free(hex);
    stitch_free(block, 0, 0, NULL);
    CHECK(stitch_empty_cache(0) == 0, "parent: free and empty_cache after sharing");
    return 0;
}

static int run_fork(void) {
    void* block = stitch_malloc(MIB, 0, NULL);
    CHECK(block != NULL, "an allocation in the parent");
    pthread_t t;
    pthread_create(&t, NULL, busy, NULL);
    int clean = 0, hung = 0, wrong = 0;
    for (int i = 0; i < 20; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            _exit(child_calls(block));
        }
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            clean++;
        } else if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
            hung++;
        } else {
            wrong++;
        }
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    stop_busy = 1;
    pthread_join(t, NULL);
    printf("     children: %d clean, %d hung, %d wrong\n", clean, hung, wrong);
    CHECK(clean == 20, "every call in a forked child fails at once with the fork error");
    stitch_clear_error();
    stitch_free(block, 0, 0, NULL);
    CHECK(error_empty(), "the parent goes on unharmed");
    return 0;
}

int main(int argc, char** argv) {
    const char* mode = argc > 1 ? argv[1] : "main";
    int rc;
    if (strcmp(mode, "main") == 0) {
        rc = run_main();
    } else if (strcmp(mode, "sim") == 0) {
        rc = run_sim();
    } else if (strcmp(mode, "fork") == 0) {
        rc = run_fork();
    } else if (strcmp(mode, "ipc") == 0) {
        rc = run_ipc(argv[0]);
    } else if (strcmp(mode, "ipc_child") == 0 && argc > 3) {
        rc = run_ipc_child(argv[2], argv[3]);
    } else if (strcmp(mode, "badconf") == 0 && argc > 2) {
        rc = run_badconf(argv[2]);
    } else {
        fprintf(stderr, "usage: %s main | sim | fork | ipc | badconf NEEDLE\n", argv[0]);
        return 2;
    }
    printf("%d passed, %d failed\n", passed, failed);
    return (rc == 0 && failed == 0) ? 0 : 1;
}
