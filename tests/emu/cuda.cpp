// stokehold's CUDA emulator, driver side: a libcuda that runs on the CPU.
//
// It exists so that the CUDA path (cudarc's calls, stokehold's streams, events, pinned
// buffers, feeder, device cache and kernels) runs in CI, where there is no GPU. It is no
// GPU model: it checks ordering, arguments and results, not speed.
//
// - One device, "stokehold CUDA emulator (CPU)", compute capability 9.0. Device memory is
//   host memory; device addresses are host addresses. Every copy and memset is checked
//   to lie inside one live allocation (CUDA_ERROR_INVALID_VALUE otherwise).
// - Each stream is a thread running its queue in order. Events carry a sequence number
//   per record, so cuStreamWaitEvent waits for the record that preceded it, as on the
//   GPU. Asynchronous copies read their host source when they run, not when they are
//   enqueued: a buffer reused before its copy completes is caught by the results.
//   STOKEHOLD_EMU_JITTER_US=N sleeps up to N us before each operation to shake out races.
//   Whether operations are ordered is also checked from the calls alone, with vector
//   clocks ("stream order" below): a race fails every run, however the threads ran.
// - STOKEHOLD_EMU_FAIL_HTOD=N makes the Nth asynchronous host-to-device copy (from 1)
//   fail when enqueued with CUDA_ERROR_INVALID_VALUE (as a bad argument is refused; the
//   context goes on), for the callers' error paths.
//   STOKEHOLD_EMU_FAIL_HTOD_LATE=N enqueues it, and it faults when it runs on its stream,
//   as a copy from a bad address does on a GPU: the context is then unusable, and every
//   later call that does CUDA work (the synchronisations once the work before them has
//   run) returns CUDA_ERROR_ILLEGAL_ADDRESS, as the driver's sticky errors do.
//   STOKEHOLD_EMU_FAULT_LAUNCH=N does the same with the Nth kernel launch (a training
//   step reading out of bounds), in place of running the kernel.
// - Kernels come from the emulated NVRTC (nvrtc.cpp) as shared objects; a launch copies
//   its parameters (their sizes come from the kernel's C++ signature) and checks its
//   configuration against the limits of a real device.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct Ctx {
    int unused;
};
struct Stream;
struct Event;
struct Module;
struct Function;
typedef Ctx* CUcontext;
typedef Stream* CUstream;
typedef Event* CUevent;
typedef Module* CUmodule;
typedef Function* CUfunction;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

struct dim3 {
    unsigned x, y, z;
};

namespace {

Ctx g_ctx;
bool g_init = false;
thread_local CUcontext t_current = nullptr;
// The emulator's globals are never destroyed: stream threads may still use them while the
// process exits (destroying a condition variable with waiters would hang the exit).
std::mutex& g_mu = *new std::mutex;  // allocations, streams, modules
// A device allocation. One made by cuMemAllocAsync is `ready` only once its stream has
// reached the allocation: touching it before then, from another stream, is an error.
struct Alloc {
    size_t bytes;
    bool ready;
};
std::map<uintptr_t, Alloc>& g_device = *new std::map<uintptr_t, Alloc>;  // by start
std::map<uintptr_t, size_t>& g_host = *new std::map<uintptr_t, size_t>;  // pinned: start -> bytes
size_t g_used = 0;
// The sticky error of a fault in work run on a stream (STOKEHOLD_EMU_FAIL_HTOD_LATE,
// STOKEHOLD_EMU_FAULT_LAUNCH).
std::atomic<int> g_sticky{0};

size_t total_memory() {
    const char* mb = getenv("STOKEHOLD_EMU_MEM_MB");
    return (mb ? strtoull(mb, nullptr, 10) : 16384ull) << 20;
}

bool logging() {
    static bool on = getenv("STOKEHOLD_EMU_LOG") != nullptr;
    return on;
}

#define LOG(...)                                    \
    do {                                            \
        if (logging()) {                            \
            fprintf(stderr, "stokehold-emu: " __VA_ARGS__); \
            fputc('\n', stderr);                    \
        }                                           \
    } while (0)

// Returns the context's sticky error, once a fault left one, from a call that does CUDA
// work.
#define STICKY()                                             \
    do {                                                     \
        if (int sticky_ = g_sticky.load()) return sticky_; \
    } while (0)

// Work, frees and copies need a current context on the calling thread, as the driver's
// do (CUDA_ERROR_INVALID_CONTEXT): a call that forgot to make its context current, or a
// thread left with none, fails here as on a GPU.
#define NEED_CONTEXT()                                          \
    do {                                                        \
        if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;      \
    } while (0)

// The entry of `m` (ranges by their start, each `len(entry)` bytes long) whose range
// holds [p, p + n), or `m.end()`.
template <class M, class Len>
typename M::iterator containing(M& m, uintptr_t p, size_t n, Len len) {
    auto it = m.upper_bound(p);
    if (it == m.begin()) return m.end();
    --it;
    return p >= it->first && p + n <= it->first + len(it->second) ? it : m.end();
}

size_t alloc_len(const Alloc& a) { return a.bytes; }
size_t range_len(size_t n) { return n; }

// The allocation holding [p, p + n), if one does (call with g_mu held).
Alloc* find_alloc(CUdeviceptr p, size_t n) {
    auto it = containing(g_device, (uintptr_t)p, n, alloc_len);
    return it == g_device.end() ? nullptr : &it->second;
}

// Freed device memory, kept poisoned (0xa5 bytes) for a while instead of given back, by
// start, with its length, oldest first in `g_freed_order`: a kernel handed a pointer into
// it (used after a free, by a stream that did not wait for the free) is caught at once,
// not left reading stale heap that looks fine. Up to 256 MiB; older ranges are freed.
std::map<uintptr_t, size_t>& g_freed = *new std::map<uintptr_t, size_t>;
std::deque<uintptr_t>& g_freed_order = *new std::deque<uintptr_t>;
size_t g_freed_bytes = 0;
const size_t kQuarantine = 256u << 20;

// Keeps [p, p + n) poisoned as freed (call with g_mu held).
void quarantine(uintptr_t p, size_t n) {
    memset((void*)p, 0xa5, n);
    g_freed[p] = n;
    g_freed_order.push_back(p);
    g_freed_bytes += n;
    while (g_freed_bytes > kQuarantine && !g_freed_order.empty()) {
        uintptr_t old = g_freed_order.front();
        g_freed_order.pop_front();
        g_freed_bytes -= g_freed[old];
        g_freed.erase(old);
        free((void*)old);
    }
}

// Whether `p` lies in freed memory still kept (call with g_mu held).
bool in_freed(uintptr_t p) { return containing(g_freed, p, 1, range_len) != g_freed.end(); }

// Whether [p, p + n) lies inside one live device allocation.
bool in_device(CUdeviceptr p, size_t n) {
    std::lock_guard<std::mutex> g(g_mu);
    return find_alloc(p, n) != nullptr;
}

// Checked again when a copy or memset runs: the memory may have been freed (by a
// cuMemFreeAsync that ran first on another stream), or not yet be allocated in stream
// order. On a GPU either is undefined behaviour; here it stops the process, loudly.
void check_live(const char* what, CUdeviceptr p, size_t n) {
    std::lock_guard<std::mutex> g(g_mu);
    Alloc* a = find_alloc(p, n);
    if (!a || !a->ready) {
        fprintf(stderr, "stokehold-emu: %s of %zu bytes at 0x%llx runs on memory that is %s\n", what, n,
                (unsigned long long)p, a ? "not yet allocated in stream order (cuMemAllocAsync)" : "freed");
        abort();
    }
}

// Whether [p, p + n) lies inside one pinned host allocation. Copies from or to other
// (pageable) memory are synchronous in the ways the CUDA documentation gives.
bool pinned(const void* p, size_t n) {
    std::lock_guard<std::mutex> g(g_mu);
    return containing(g_host, (uintptr_t)p, n, range_len) != g_host.end();
}

// ---- stream order -------------------------------------------------------------------
//
// Whether two operations on device (or pinned) memory are ordered is decided when they
// are enqueued, from the calls alone, never from when they happen to run: a missing
// event wait fails every run, not the unlucky ones. Each stream is an agent with a
// vector clock, and so is the host (one agent for all its threads: their own
// synchronisation, channels and locks, is out of the emulator's sight and taken as
// given). An operation enqueued on a stream comes after the stream's earlier ones and
// after everything the host had seen finish; an event record carries its stream's
// clock, a stream wait joins it; a host synchronisation (a stream or event synchronise,
// a successful query, a context synchronise, a device-to-host copy to pageable memory
// or a synchronous one, as far as CUDA promises) joins what it waited for into the
// host's clock. A host function is no synchronisation: what it tells the host's threads
// is out of sight, and an edge taken when it ran would depend on timing. Every access to device memory
// (copies, memsets, kernels, asynchronous allocations and frees) and every device access
// to pinned memory is checked against the earlier accesses to the same allocation: two
// that overlap, one of them a write, on different streams, neither ordered before the
// other, are a race, reported with both operations, and the process aborts. A kernel's
// pointer arguments are accesses from where they point to the end of their allocation:
// reads for `const T*`, writes otherwise. STOKEHOLD_EMU_RACES=0 turns the checks off.

// FNV-1a of `n` bytes at `p`, with 0 taken as 1: an access's hash 0 means none.
uint64_t fnv1a(const void* p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) h = (h ^ ((const unsigned char*)p)[i]) * 0x100000001b3ull;
    return h ? h : 1;
}

// A vector clock, by agent: 0 is the host, streams are numbered from 1.
typedef std::vector<uint64_t> Clock;

void join(Clock& into, const Clock& from) {
    if (into.size() < from.size()) into.resize(from.size(), 0);
    for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

// One access to memory: [lo, hi), by an operation of `agent` at `epoch` of its clock.
struct Access {
    uintptr_t lo, hi;
    bool write;
    int agent;
    uint64_t epoch;
    // The pinned bytes' hash when a copy from them was enqueued (0: not such a copy).
    uint64_t hash;
    std::string what;
};

// An operation and the accesses it makes (epochs set when it is enqueued).
struct Op {
    std::function<void()> run;
    std::vector<Access> acc;
};

std::mutex& g_order_mu = *new std::mutex;  // clocks, events' clocks, the shadow
Clock& g_host_clock = *new Clock(1, 0);
std::atomic<int> g_agents{1};
// The accesses to each allocation (device or pinned) not yet known to be superseded,
// by the allocation's start.
std::map<uintptr_t, std::vector<Access>>& g_shadow = *new std::map<uintptr_t, std::vector<Access>>;

// The allocation (device, or pinned host) holding `p`: its start and end.
bool region(uintptr_t p, uintptr_t* start, uintptr_t* end) {
    std::lock_guard<std::mutex> g(g_mu);
    if (auto d = containing(g_device, p, 1, alloc_len); d != g_device.end()) {
        *start = d->first;
        *end = d->first + d->second.bytes;
        return true;
    }
    auto h = containing(g_host, p, 1, range_len);
    if (h == g_host.end()) return false;
    *start = h->first;
    *end = h->first + h->second;
    return true;
}

// Forgets the accesses to the allocation at `start` (made or freed).
void forget(uintptr_t start) {
    std::lock_guard<std::mutex> g(g_order_mu);
    g_shadow.erase(start);
}

const char* agent_name(int agent, char* buf, size_t n) {
    if (agent == 0) return "the host";
    snprintf(buf, n, "stream #%d", agent);
    return buf;
}

bool races_checked() {
    static const bool on = [] {
        const char* v = getenv("STOKEHOLD_EMU_RACES");
        return !(v && strcmp(v, "0") == 0);
    }();
    return on;
}

// Whether clock `c` has seen access `p`: its operation, or a later one of its agent.
bool saw(const Clock& c, const Access& p) { return (size_t)p.agent < c.size() && p.epoch <= c[p.agent]; }

bool overlap(const Access& a, const Access& b) { return a.lo < b.hi && b.lo < a.hi; }

// Checks `a`, of an operation whose clock is `c`, against the earlier accesses to its
// allocation, and keeps it (call with g_order_mu held).
//
// A pinned source about to be copied (its hash set): an earlier copy from bytes it
// overlaps, not yet seen finished by the host, must find them as they were when it was
// enqueued, or the host wrote them while (as far as it knew) that copy could still be
// reading them.
void check(const Access& a, const Clock& c) {
    uintptr_t start, end;
    if (!races_checked() || !region(a.lo, &start, &end)) return;
    std::vector<Access>& seen = g_shadow[start];
    for (Access& p : seen) {
        if (!a.hash || !p.hash || !overlap(a, p) || saw(g_host_clock, p)) continue;
        if (fnv1a((const void*)p.lo, p.hi - p.lo) == p.hash) continue;
        char y[32];
        fprintf(stderr,
                "stokehold-emu: race: the host rewrote the pinned bytes [0x%llx, 0x%llx) that %s "
                "on %s reads, before it synchronised with that copy (an event synchronise or "
                "query, a stream synchronise), and copies them again\n",
                (unsigned long long)a.lo, (unsigned long long)a.hi, p.what.c_str(),
                agent_name(p.agent, y, sizeof y));
        abort();
    }
    for (Access& p : seen) {
        bool ordered = p.agent == a.agent || saw(c, p);
        // Bytes a copy read from pinned memory, written since by the device (in order):
        // no longer the host's to be checked against their hash.
        if (ordered && a.write && p.hash && overlap(a, p)) p.hash = 0;
        if (ordered || !(a.write || p.write) || !overlap(a, p)) continue;
        char x[32], y[32];
        fprintf(stderr,
                "stokehold-emu: race: %s on %s %s [0x%llx, 0x%llx), which %s on %s %s "
                "[0x%llx, 0x%llx), and nothing orders the two (no event recorded after one and "
                "waited for before the other, no host synchronisation between them)\n",
                a.what.c_str(), agent_name(a.agent, x, sizeof x), a.write ? "writes" : "reads",
                (unsigned long long)a.lo, (unsigned long long)a.hi, p.what.c_str(),
                agent_name(p.agent, y, sizeof y), p.write ? "writes" : "reads",
                (unsigned long long)p.lo, (unsigned long long)p.hi);
        abort();
    }
    // A write supersedes what it covers, and so does a read the reads of its own stream
    // it covers: whatever comes after it in order comes after them, and whatever does
    // not (and conflicted with them) conflicts with it too.
    seen.erase(std::remove_if(seen.begin(), seen.end(),
                              [&](const Access& p) {
                                  bool covered = p.lo >= a.lo && p.hi <= a.hi;
                                  return covered && (a.write || (!p.write && p.agent == a.agent));
                              }),
               seen.end());
    seen.push_back(a);
    // Bounded: the oldest reads are dropped (a race with them goes unseen), never a write.
    if (seen.size() > 1024) {
        size_t dropped = 0;
        seen.erase(std::remove_if(seen.begin(), seen.end(),
                                  [&](const Access& p) { return !p.write && dropped++ < 512; }),
                   seen.end());
    }
}

// An access of [p, p + n) for an operation named `what`.
Access access(const char* what, uintptr_t p, size_t n, bool write, uint64_t hash = 0) {
    return Access{p, p + n, write, 0, 0, hash, what};
}

// ---- events ------------------------------------------------------------------------

std::mutex& g_ev_mu = *new std::mutex;
std::condition_variable& g_ev_cv = *new std::condition_variable;

}  // namespace

struct Event {
    unsigned flags;
    uint64_t recorded = 0;   // records enqueued
    uint64_t completed = 0;  // the newest record run
    // Records enqueued and not yet run: a wait is for one record, which a later record
    // of the event on another stream, run first, does not stand in for.
    std::set<uint64_t> pending;

    bool done(uint64_t seq) const { return !pending.count(seq); }
    std::chrono::steady_clock::time_point at;
    Clock clock;  // its stream's at the last record (under g_order_mu)
};

// ---- streams -----------------------------------------------------------------------

// The legacy default stream (handles 0 and CU_STREAM_LEGACY) and every blocking stream
// (made without CU_STREAM_NON_BLOCKING, and the per-thread default streams), under
// g_order_mu: work on the legacy stream waits for the work enqueued before it on every
// blocking stream, and work on a blocking stream for the work enqueued before it on the
// legacy stream, as CUDA's implicit synchronisation has it.
static Stream* g_legacy = nullptr;
static std::vector<Stream*>& g_blocking = *new std::vector<Stream*>;

struct Stream {
    // How it synchronises with the legacy default stream.
    enum Kind { non_blocking, blocking, legacy };
    Kind kind;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> ops;
    uint64_t enqueued = 0, done = 0;
    bool stop = false;
    std::thread worker;
    unsigned jitter_us = 0;
    // While capturing (cuStreamBeginCapture), work goes here instead of the queue, with
    // the events recorded so far in the capture.
    std::vector<Op>* capture = nullptr;
    std::set<Event*> captured_events;
    // Its agent and clock in the stream order (under g_order_mu).
    int agent;
    Clock clock;
    // The streams, and how much of each one's work, that the operation being enqueued
    // waits for implicitly (from `tick` to `enqueue`, under g_order_mu).
    std::vector<std::pair<Stream*, uint64_t>> implicit;

    explicit Stream(Kind k) : kind(k) {
        const char* j = getenv("STOKEHOLD_EMU_JITTER_US");
        jitter_us = j ? (unsigned)strtoul(j, nullptr, 10) : 0;
        agent = g_agents++;
        worker = std::thread([this] { run(); });
    }

    void run() {
        std::minstd_rand rng((unsigned)(uintptr_t)this);
        for (;;) {
            std::function<void()> op;
            {
                std::unique_lock<std::mutex> g(mu);
                cv.wait(g, [&] { return stop || !ops.empty(); });
                // Destroyed and drained: the thread ends, the stream stays (never freed:
                // a context synchronise may still look at it).
                if (ops.empty()) return;
                op = std::move(ops.front());
                ops.pop_front();
            }
            if (jitter_us) std::this_thread::sleep_for(std::chrono::microseconds(rng() % jitter_us));
            op();
            {
                std::lock_guard<std::mutex> g(mu);
                ++done;
            }
            cv.notify_all();
        }
    }

    // Enqueues `op` after checking its accesses in the stream order (in a capture, keeps
    // it for the graph's launches, which check them).
    void push(std::function<void()> op, std::vector<Access> acc = {}) {
        if (capture) {  // only the capturing thread enqueues on a capturing stream
            capture->push_back(Op{std::move(op), std::move(acc)});
            return;
        }
        std::lock_guard<std::mutex> order(g_order_mu);
        tick(acc);
        enqueue(std::move(op));
    }

    // `tick` for an operation that touches no memory (an event record or wait).
    void tick() {
        std::vector<Access> none;
        tick(none);
    }

    // Advances the clock for one operation enqueued now and checks its accesses (call
    // with g_order_mu held).
    void tick(std::vector<Access>& acc) {
        join(clock, g_host_clock);
        // (A stream idle now has nothing to wait for; its clock still counts.)
        if (kind == legacy) {
            for (Stream* b : g_blocking) {
                if (b->capture) {
                    // A real driver refuses it (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT).
                    fprintf(stderr,
                            "stokehold-emu: work on the legacy stream while a blocking stream "
                            "captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)\n");
                    abort();
                }
                join(clock, b->clock);
                if (uint64_t n = b->outstanding()) implicit.emplace_back(b, n);
            }
        } else if (kind == blocking && g_legacy) {
            join(clock, g_legacy->clock);
            if (uint64_t n = g_legacy->outstanding()) implicit.emplace_back(g_legacy, n);
        }
        if (clock.size() <= (size_t)agent) clock.resize(agent + 1, 0);
        ++clock[agent];
        for (Access& a : acc) {
            a.agent = agent;
            a.epoch = clock[agent];
            check(a, clock);
        }
    }

    void enqueue(std::function<void()> op) {
        if (!implicit.empty()) {
            op = [waits = std::move(implicit), op = std::move(op)] {
                for (auto& [other, target] : waits) other->reach(target);
                op();
            };
            implicit.clear();
        }
        {
            std::lock_guard<std::mutex> g(mu);
            ops.push_back(std::move(op));
            ++enqueued;
        }
        cv.notify_all();
    }

    void sync() {
        std::unique_lock<std::mutex> g(mu);
        uint64_t target = enqueued;
        cv.wait(g, [&] { return done >= target; });
    }

    // The operations enqueued so far, if some have not run yet; 0 if all have.
    uint64_t outstanding() {
        std::lock_guard<std::mutex> g(mu);
        return done < enqueued ? enqueued : 0;
    }

    // Waits until `target` operations have run.
    void reach(uint64_t target) {
        std::unique_lock<std::mutex> g(mu);
        cv.wait(g, [&] { return done >= target; });
    }

    bool idle() {
        std::lock_guard<std::mutex> g(mu);
        return done == enqueued;
    }

    // Returns at once, as cuStreamDestroy does: the worker finishes the queue, then ends.
    void shut() {
        worker.detach();
        std::lock_guard<std::mutex> g(mu);
        stop = true;
        cv.notify_all();
    }
};

namespace {

std::set<Stream*>& g_streams = *new std::set<Stream*>;  // live ones
// Every stream ever made, destroyed ones too (their queued work still runs, and a
// context synchronise waits for it).
std::vector<Stream*>& g_every_stream = *new std::vector<Stream*>;

thread_local Stream* t_per_thread = nullptr;

// A new stream of `kind`, known to the context (never freed: see Stream::run).
Stream* make_stream(Stream::Kind kind) {
    Stream* st = new Stream(kind);
    {
        std::lock_guard<std::mutex> order(g_order_mu);
        if (kind == Stream::legacy) g_legacy = st;
        if (kind == Stream::blocking) g_blocking.push_back(st);
    }
    std::lock_guard<std::mutex> g(g_mu);
    g_every_stream.push_back(st);
    if (kind != Stream::legacy) g_streams.insert(st);
    return st;
}

// The stream a handle names: null and CU_STREAM_LEGACY (1) the legacy default stream,
// CU_STREAM_PER_THREAD (2) the calling thread's own default stream (a blocking one).
Stream* stream_of(CUstream s) {
    if ((uintptr_t)s == 2) {
        if (!t_per_thread) t_per_thread = make_stream(Stream::blocking);
        return t_per_thread;
    }
    if ((uintptr_t)s <= 1) {
        static std::once_flag made;
        static Stream* legacy = nullptr;
        std::call_once(made, [] { legacy = make_stream(Stream::legacy); });
        return legacy;
    }
    std::lock_guard<std::mutex> g(g_mu);
    return g_streams.count(s) ? s : nullptr;
}

// The clock of `st` as it is now, for the host to join once it has seen the stream
// reach this point.
Clock clock_of(Stream* st) {
    std::lock_guard<std::mutex> g(g_order_mu);
    return st->clock;
}

// The host has seen the work of clock `c` finish.
void host_saw(const Clock& c) {
    std::lock_guard<std::mutex> g(g_order_mu);
    join(g_host_clock, c);
}

// Waits for `st`'s work enqueued so far; the host has then seen it finish.
void sync_stream(Stream* st) {
    Clock c = clock_of(st);
    st->sync();
    host_saw(c);
}

void sync_all() {
    std::vector<Stream*> all;
    {
        std::lock_guard<std::mutex> g(g_mu);
        all = g_every_stream;
    }
    for (Stream* s : all) sync_stream(s);
}

}  // namespace

// ---- modules -----------------------------------------------------------------------

struct Module {
    void* handle;
    int (*find)(const char*);
    size_t (*params)(int, const size_t**);
    void (*run)(int, dim3, dim3, void**);
    // Each parameter's kind: 0 not a pointer, 1 `const T*`, 2 `T*`.
    const unsigned char* (*kinds)(int);
    // The most threads a block may have (`__launch_bounds__`).
    unsigned (*max_threads)(int);
};

struct Function {
    Module* module;
    int id;
    std::string name;
};

extern "C" {

CUresult cuGetErrorName(CUresult e, const char** s) {
    switch (e) {
        case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case CUDA_ERROR_NO_BINARY_FOR_GPU: *s = "CUDA_ERROR_NO_BINARY_FOR_GPU"; break;
        case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: *s = "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"; break;
        case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case CUDA_ERROR_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
        case CUDA_ERROR_ILLEGAL_STATE: *s = "CUDA_ERROR_ILLEGAL_STATE"; break;
        case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: *s = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
        case CUDA_ERROR_STREAM_CAPTURE_ISOLATION: *s = "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *s = "CUDA_ERROR_UNKNOWN"; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char** s) { return cuGetErrorName(e, s); }

CUresult cuInit(unsigned) {
    g_init = true;
    return CUDA_SUCCESS;
}

// The CUDA version the emulated driver supports: 12.8.
const int kDriverVersion = 12080;

// STOKEHOLD_EMU_CC: the device's compute capability, "MAJOR.MINOR" (default 9.0), as
// major * 10 + minor.
static int compute_capability() {
    const char* v = getenv("STOKEHOLD_EMU_CC");
    int major = 9, minor = 0;
    if (v && *v) sscanf(v, "%d.%d", &major, &minor);
    return major * 10 + minor;
}

CUresult cuDriverGetVersion(int* v) {
    *v = kDriverVersion;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* n) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    *n = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", "stokehold CUDA emulator (CPU)");
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_memory();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attr) {
        case 1: *v = 1024; break;        // max threads per block
        case 2: case 3: *v = 1024; break;  // max block x, y
        case 4: *v = 64; break;           // max block z
        case 5: *v = 2147483647; break;   // max grid x
        case 6: case 7: *v = 65535; break;  // max grid y, z
        case 8: *v = 49152; break;        // shared memory per block
        case 10: *v = 32; break;          // warp size
        case 16: *v = 4; break;           // multiprocessors
        case 41: *v = 1; break;           // unified addressing
        case 75: *v = compute_capability() / 10; break;  // compute capability major
        case 76: *v = compute_capability() % 10; break;  // minor
        case 115: *v = 1; break;          // memory pools supported
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *c = &g_ctx;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }

CUresult cuCtxSetCurrent(CUcontext c) {
    if (c && c != &g_ctx) return CUDA_ERROR_INVALID_CONTEXT;
    t_current = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = t_current;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* d) {
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize() {
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    sync_all();
    STICKY();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = 0;
    return CUDA_SUCCESS;
}

// ---- memory ------------------------------------------------------------------------

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    std::lock_guard<std::mutex> g(g_mu);
    *total = total_memory();
    *free_bytes = *total - g_used;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t rounded = (n + 255) / 256 * 256;
    std::lock_guard<std::mutex> g(g_mu);
    if (g_used + rounded > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    // Exactly n bytes (aligned like cudaMalloc's), so that an address sanitizer sees the
    // real end of the allocation.
    void* m = nullptr;
    if (posix_memalign(&m, 256, n) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    g_device[(uintptr_t)m] = Alloc{n, true};
    g_used += rounded;
    *p = (CUdeviceptr)(uintptr_t)m;
    LOG("cuMemAlloc %zu -> %p", n, m);
    return CUDA_SUCCESS;
}

// cuMemAlloc_v2, with no access recorded of an earlier allocation at the same address.
CUresult alloc_fresh(CUdeviceptr* p, size_t n) {
    CUresult r = cuMemAlloc_v2(p, n);
    if (r == CUDA_SUCCESS) forget((uintptr_t)*p);
    return r;
}

// Frees device memory and forgets its accesses, together: the address may be handed
// out again at once (from any thread: cuMemFreeAsync's runs on its stream's).
CUresult free_device(CUdeviceptr p) {
    std::lock_guard<std::mutex> order(g_order_mu);
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_device.find((uintptr_t)p);
    if (it == g_device.end()) return CUDA_ERROR_INVALID_VALUE;
    g_used -= (it->second.bytes + 255) / 256 * 256;
    size_t bytes = it->second.bytes;
    g_device.erase(it);
    g_shadow.erase((uintptr_t)p);
    quarantine((uintptr_t)p, bytes);
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    STICKY();
    NEED_CONTEXT();
    return free_device(p);
}

CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = alloc_fresh(p, n);
    if (r != CUDA_SUCCESS) return r;
    CUdeviceptr at = *p;
    {
        std::lock_guard<std::mutex> g(g_mu);
        g_device[(uintptr_t)at].ready = false;
    }
    // Allocated in stream order: a use on another stream must be ordered after it.
    st->push(
        [at] {
            std::lock_guard<std::mutex> g(g_mu);
            auto it = g_device.find((uintptr_t)at);
            if (it != g_device.end()) it->second.ready = true;
        },
        {access("cuMemAllocAsync", at, n, true)});
    return CUDA_SUCCESS;
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    size_t bytes;
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_device.find((uintptr_t)p);
        if (it == g_device.end()) return CUDA_ERROR_INVALID_VALUE;
        bytes = it->second.bytes;
    }
    // Freed in stream order: every use on another stream must be ordered before it.
    st->push([p] { free_device(p); }, {access("cuMemFreeAsync", p, bytes, true)});
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** pp, size_t n, unsigned) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    size_t rounded = (n + 4095) / 4096 * 4096;
    void* m = nullptr;
    if (posix_memalign(&m, 4096, rounded ? rounded : 4096) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    {
        std::lock_guard<std::mutex> g(g_mu);
        g_host[(uintptr_t)m] = n;
    }
    forget((uintptr_t)m);
    *pp = m;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* p) {
    STICKY();
    NEED_CONTEXT();
    std::lock_guard<std::mutex> order(g_order_mu);
    std::lock_guard<std::mutex> g(g_mu);
    if (!g_host.erase((uintptr_t)p)) return CUDA_ERROR_INVALID_VALUE;
    g_shadow.erase((uintptr_t)p);
    free(p);
    return CUDA_SUCCESS;
}

// Enqueues, in place of `what`, a fault on `st`: when it runs, the context's sticky
// error is set, as `why` (the variable that asked) says in the log.
void fault_when_run(Stream* st, std::string what, const char* why) {
    st->push([what, why] {
        LOG("%s: faulting as %s asks", what.c_str(), why);
        g_sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    });
}

// How the host-to-device copy at hand fails: as STOKEHOLD_EMU_FAIL_HTOD (at once) or
// STOKEHOLD_EMU_FAIL_HTOD_LATE (when it runs) names it, or not at all.
enum class Fails { no, now, late };
Fails htod_fails() {
    static const char* now = getenv("STOKEHOLD_EMU_FAIL_HTOD");
    static const char* late = getenv("STOKEHOLD_EMU_FAIL_HTOD_LATE");
    static std::atomic<unsigned long long> calls{0};
    unsigned long long call = ++calls;
    if (now && call == strtoull(now, nullptr, 10)) return Fails::now;
    if (late && call == strtoull(late, nullptr, 10)) return Fails::late;
    return Fails::no;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    Fails fails = htod_fails();
    if (fails == Fails::now) {
        // Refused when enqueued, as the driver refuses a bad argument: the context goes
        // on (a fault on the device is STOKEHOLD_EMU_FAIL_HTOD_LATE's).
        LOG("cuMemcpyHtoDAsync: failing as STOKEHOLD_EMU_FAIL_HTOD asks");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (fails == Fails::late) {
        fault_when_run(st, "cuMemcpyHtoDAsync", "STOKEHOLD_EMU_FAIL_HTOD_LATE");
        return CUDA_SUCCESS;
    }
    if (!in_device(dst, n)) {
        LOG("cuMemcpyHtoDAsync: %zu bytes at %llx outside any allocation", n, dst);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (pinned(src, n)) {
        // Read when the copy runs: the buffer must stay untouched until then. A host write
        // to it in between (a buffer refilled before its copy ran) is caught by its hash,
        // whatever bytes were written. (Not in a capture: a graph's copy reads the buffer
        // as it is at each replay.)
        bool hashed = st->capture == nullptr;
        uint64_t before = hashed ? fnv1a(src, n) : 0;
        st->push(
            [=] {
                check_live("cuMemcpyHtoDAsync", dst, n);
                if (hashed && fnv1a(src, n) != before) {
                    fprintf(stderr,
                            "stokehold-emu: the host wrote the %zu pinned bytes at %p after their "
                            "cuMemcpyHtoDAsync was enqueued and before it ran\n",
                            n, src);
                    abort();
                }
                memcpy((void*)(uintptr_t)dst, src, n);
            },
            {access("cuMemcpyHtoDAsync", (uintptr_t)src, n, false, before),
             access("cuMemcpyHtoDAsync", dst, n, true)});
        return CUDA_SUCCESS;
    }
    // Pageable: returns once the source is staged; the copy itself runs in stream order.
    auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                               (const unsigned char*)src + n);
    st->push(
        [=] {
            check_live("cuMemcpyHtoDAsync", dst, n);
            memcpy((void*)(uintptr_t)dst, staged->data(), n);
        },
        {access("cuMemcpyHtoDAsync", dst, n, true)});
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (!in_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
    st->push(
        [=] {
            check_live("cuMemcpyDtoHAsync", src, n);
            memcpy(dst, (const void*)(uintptr_t)src, n);
        },
        {access("cuMemcpyDtoHAsync", src, n, false), access("cuMemcpyDtoHAsync", (uintptr_t)dst, n, true)});
    // Pageable: returns only once the copy has completed.
    if (!pinned(dst, n)) sync_stream(st);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (!in_device(src, n) || !in_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    st->push(
        [=] {
            check_live("cuMemcpyDtoDAsync", src, n);
            check_live("cuMemcpyDtoDAsync", dst, n);
            memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
        },
        {access("cuMemcpyDtoDAsync", src, n, false), access("cuMemcpyDtoDAsync", dst, n, true)});
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (!in_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    st->push(
        [=] {
            check_live("cuMemsetD8Async", dst, n);
            memset((void*)(uintptr_t)dst, v, n);
        },
        {access("cuMemsetD8Async", dst, n, true)});
    return CUDA_SUCCESS;
}

// The synchronous calls run on the default stream and return once done, but the host
// is told only what CUDA promises: a host-to-device copy synchronises the stream before
// it starts (its own copy may still be under way when it returns), a device-to-host copy
// is done when it returns, and a memset or a device-to-device copy promises nothing.
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    Stream* st = stream_of(nullptr);
    sync_stream(st);
    CUresult r = cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
    if (r == CUDA_SUCCESS) st->sync();
    return r;
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    CUresult r = cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
    if (r == CUDA_SUCCESS) sync_stream(stream_of(nullptr));
    return r;
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    CUresult r = cuMemcpyDtoDAsync_v2(dst, src, n, nullptr);
    if (r == CUDA_SUCCESS) stream_of(nullptr)->sync();
    return r;
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    CUresult r = cuMemsetD8Async(dst, v, n, nullptr);
    if (r == CUDA_SUCCESS) stream_of(nullptr)->sync();
    return r;
}

// ---- streams and events ------------------------------------------------------------

CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    // CU_STREAM_NON_BLOCKING (1): no implicit synchronisation with the legacy stream.
    *s = make_stream(flags & 1 ? Stream::non_blocking : Stream::blocking);
    return CUDA_SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) { return cuStreamCreate(s, flags); }

// One context here: every stream is the primary context's.
CUresult cuStreamGetCtx(CUstream s, CUcontext* c) {
    STICKY();
    if (!stream_of(s)) return CUDA_ERROR_INVALID_HANDLE;
    *c = &g_ctx;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream s) {
    STICKY();
    {
        std::lock_guard<std::mutex> g(g_mu);
        if ((uintptr_t)s <= 2 || !g_streams.erase(s)) return CUDA_ERROR_INVALID_HANDLE;
    }
    // Work already enqueued still runs, as on the GPU, and the call returns at once.
    s->shut();
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s) {
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    sync_stream(st);
    STICKY();
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream s) {
    STICKY();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    Clock c = clock_of(st);
    if (!st->idle()) return CUDA_ERROR_NOT_READY;
    host_saw(c);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned flags) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    *e = new Event{flags};
    return CUDA_SUCCESS;
}

// Returns at once, as the driver's does. The event is never freed: records and waits
// still queued on streams refer to it (an event is a few dozen bytes).
CUresult cuEventDestroy_v2(CUevent e) {
    STICKY();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st || !e) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capture) {
        // In a capture a record is a node of the graph, for waits inside it only (an
        // event to time or to wait on from outside needs CU_EVENT_RECORD_EXTERNAL).
        st->captured_events.insert(e);
        return CUDA_SUCCESS;
    }
    // The record, its sequence number and its clock are taken together, in stream order.
    std::lock_guard<std::mutex> order(g_order_mu);
    st->tick();
    e->clock = st->clock;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> g(g_ev_mu);
        seq = ++e->recorded;
        e->pending.insert(seq);
    }
    st->enqueue([e, seq] {
        {
            std::lock_guard<std::mutex> g(g_ev_mu);
            e->pending.erase(seq);
            if (seq > e->completed) {
                e->completed = seq;
                e->at = std::chrono::steady_clock::now();
            }
        }
        g_ev_cv.notify_all();
    });
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st || !e) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capture) {
        // Only on an event recorded in the same capture (the emulator captures one
        // stream: such a wait orders nothing more).
        return st->captured_events.count(e) ? CUDA_SUCCESS : CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
    }
    std::lock_guard<std::mutex> order(g_order_mu);
    uint64_t target;
    {
        std::lock_guard<std::mutex> g(g_ev_mu);
        target = e->recorded;  // the last record before this call; none: no wait
    }
    // What comes after the wait on this stream comes after what came before the record.
    join(st->clock, e->clock);
    st->tick();
    st->enqueue([e, target] {
        std::unique_lock<std::mutex> g(g_ev_mu);
        g_ev_cv.wait(g, [&] { return e->done(target); });
    });
    return CUDA_SUCCESS;
}

// The clock of `e`'s last record, and that record's number.
std::pair<Clock, uint64_t> last_record(CUevent e) {
    std::lock_guard<std::mutex> order(g_order_mu);
    std::lock_guard<std::mutex> g(g_ev_mu);
    return {e->clock, e->recorded};
}

CUresult cuEventQuery(CUevent e) {
    STICKY();
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    auto [c, target] = last_record(e);
    {
        std::lock_guard<std::mutex> g(g_ev_mu);
        if (!e->done(target)) return CUDA_ERROR_NOT_READY;
    }
    host_saw(c);
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    auto [c, target] = last_record(e);
    {
        std::unique_lock<std::mutex> g(g_ev_mu);
        g_ev_cv.wait(g, [&] { return e->done(target); });
    }
    STICKY();
    host_saw(c);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    STICKY();
    if (!a || !b) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> g(g_ev_mu);
    if ((a->flags | b->flags) & 2) return CUDA_ERROR_INVALID_HANDLE;  // timing disabled
    if (a->recorded == 0 || b->recorded == 0) return CUDA_ERROR_INVALID_HANDLE;
    if (!a->done(a->recorded) || !b->done(b->recorded)) return CUDA_ERROR_NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

// ---- modules and launches ----------------------------------------------------------

// Loads the image at `path`, given as PTX or as a cubin, checked as the driver checks
// them against the device: a cubin for sm_XY runs on compute capability X.Z for Z >= Y
// only (Tegra ones on the same architecture only), PTX for compute_XY on any device of
// X.Y or newer (of its kind, Tegra or not), and PTX from an NVRTC newer
// than the driver does not load (its PTX ISA is unknown to the driver's JIT).
static CUresult load_so(CUmodule* m, const std::string& path, bool ptx) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        LOG("dlopen %s: %s", path.c_str(), dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    const int* target = (const int*)dlsym(h, "emu_target");
    const int* nvrtc = (const int*)dlsym(h, "emu_nvrtc");
    int cc = compute_capability();
    if (target) {
        // Integrated (Tegra) architectures: a cubin runs on the same one only, and their
        // images run on no other kind of GPU.
        auto tegra = [](int a) { return a == 53 || a == 62 || a == 72 || a == 87 || a == 101 || a == 110; };
        bool runs;
        if (tegra(*target) && !tegra(cc)) {
            runs = false;
        } else if (ptx) {
            runs = *target <= cc;
        } else {
            runs = tegra(cc) ? *target == cc : *target / 10 == cc / 10 && *target % 10 <= cc % 10;
        }
        if (!runs) {
            LOG("an image for %s_%d on a device of compute capability %d.%d", ptx ? "compute" : "sm",
                *target, cc / 10, cc % 10);
            return CUDA_ERROR_NO_BINARY_FOR_GPU;
        }
    }
    if (ptx && nvrtc && *nvrtc > kDriverVersion) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    Module* mod = new Module{h, (int (*)(const char*))dlsym(h, "emu_find"),
                             (size_t(*)(int, const size_t**))dlsym(h, "emu_params"),
                             (void (*)(int, dim3, dim3, void**))dlsym(h, "emu_run"),
                             (const unsigned char* (*)(int))dlsym(h, "emu_param_kinds"),
                             (unsigned (*)(int))dlsym(h, "emu_max_threads")};
    if (!mod->find || !mod->params || !mod->run || !mod->kinds || !mod->max_threads) {
        delete mod;
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *m = mod;
    return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    STICKY();
    if (!t_current) return CUDA_ERROR_INVALID_CONTEXT;
    const char* p = (const char*)image;
    static const char kPtx[] = "// stokehold-emu .entry ";
    if (strncmp(p, kPtx, sizeof kPtx - 1) == 0) {
        const char* path = p + sizeof kPtx - 1;
        return load_so(m, std::string(path, strcspn(path, "\n")), true);
    }
    if (memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2) return CUDA_ERROR_INVALID_IMAGE;
    // An ELF64 file ends with its section or program header table: that gives its
    // length (the driver is not told it).
    uint64_t shoff, phoff;
    uint16_t shentsize, shnum, phentsize, phnum;
    memcpy(&shoff, p + 0x28, 8);
    memcpy(&shentsize, p + 0x3A, 2);
    memcpy(&shnum, p + 0x3C, 2);
    memcpy(&phoff, p + 0x20, 8);
    memcpy(&phentsize, p + 0x36, 2);
    memcpy(&phnum, p + 0x38, 2);
    size_t len = std::max(shoff + (size_t)shentsize * shnum, phoff + (size_t)phentsize * phnum);
    if (len < 64 || len > (1ull << 30)) return CUDA_ERROR_INVALID_IMAGE;
    const char* tmp = getenv("TMPDIR");
    std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/stokehold-emu-module-XXXXXX";
    std::vector<char> name(path.begin(), path.end());
    name.push_back(0);
    int fd = mkstemp(name.data());
    if (fd < 0) return CUDA_ERROR_INVALID_IMAGE;
    bool ok = write(fd, p, len) == (ssize_t)len;
    close(fd);
    CUresult r = ok ? load_so(m, name.data(), false) : CUDA_ERROR_INVALID_IMAGE;
    unlink(name.data());
    return r;
}

// Modules stay mapped until exit: work enqueued before an unload may still run their code.
CUresult cuModuleUnload(CUmodule m) { return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    STICKY();
    if (!m) return CUDA_ERROR_INVALID_HANDLE;
    int id = m->find(name);
    if (id < 0) return CUDA_ERROR_NOT_FOUND;
    *f = new Function{m, id, name};
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int* v, int attr, CUfunction f) {
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    *v = attr == 0 ? (int)f->module->max_threads(f->id) : 0;  // max threads per block
    return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction f, int, int) { return f ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream s, void** params, void** extra) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st || !f) return CUDA_ERROR_INVALID_HANDLE;
    if (extra) return CUDA_ERROR_NOT_SUPPORTED;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || gy > 65535 || gz > 65535 ||
        gx > 2147483647u || bx > 1024 || by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024 ||
        shared > 49152) {
        LOG("%s: bad launch <<<(%u,%u,%u), (%u,%u,%u), %u>>>", f->name.c_str(), gx, gy, gz, bx, by, bz,
            shared);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // More threads than the kernel's `__launch_bounds__` allow: too many resources.
    unsigned most = f->module->max_threads(f->id);
    if ((uint64_t)bx * by * bz > most) {
        LOG("%s: %u threads a block, over its launch bounds (%u)", f->name.c_str(), bx * by * bz, most);
        return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
    }
    const size_t* sizes;
    size_t n = f->module->params(f->id, &sizes);
    const unsigned char* kinds = f->module->kinds(f->id);
    // The driver copies the arguments at launch: the caller's storage may go right after.
    auto storage = std::make_shared<std::vector<std::vector<unsigned char>>>();
    // What the kernel may touch: from each pointer argument to the end of its allocation.
    std::vector<Access> acc;
    std::string what = "kernel " + f->name;
    for (size_t i = 0; i < n; ++i) {
        const unsigned char* a = (const unsigned char*)params[i];
        storage->emplace_back(a, a + sizes[i]);
        uintptr_t v, start, end;
        if (kinds[i] == 0 || sizes[i] != sizeof v) continue;
        memcpy(&v, a, sizeof v);
        if (v && region(v, &start, &end)) acc.push_back(access(what.c_str(), v, end - v, kinds[i] == 2));
    }
    Module* mod = f->module;
    int id = f->id;
    dim3 grid{gx, gy, gz}, block{bx, by, bz};
    LOG("launch %s <<<(%u,%u,%u), (%u,%u,%u)>>>", f->name.c_str(), gx, gy, gz, bx, by, bz);
    std::string name = f->name;
    static const char* fault = getenv("STOKEHOLD_EMU_FAULT_LAUNCH");
    static std::atomic<unsigned long long> launches{0};
    if (++launches == (fault ? strtoull(fault, nullptr, 10) : 0)) {
        fault_when_run(st, "launch " + name, "STOKEHOLD_EMU_FAULT_LAUNCH");
        return CUDA_SUCCESS;
    }
    st->push([mod, id, grid, block, storage, name] {
        std::vector<void*> ptrs;
        for (auto& a : *storage) {
            ptrs.push_back(a.data());
            // A pointer argument into memory not yet allocated in stream order.
            if (a.size() == 8) {
                uint64_t v;
                memcpy(&v, a.data(), 8);
                std::lock_guard<std::mutex> g(g_mu);
                Alloc* al = find_alloc(v, 1);
                if (al && !al->ready) {
                    fprintf(stderr, "stokehold-emu: %s reads 0x%llx before its cuMemAllocAsync ran\n",
                            name.c_str(), (unsigned long long)v);
                    abort();
                }
                if (!al && in_freed((uintptr_t)v)) {
                    fprintf(stderr, "stokehold-emu: %s uses 0x%llx after it was freed\n", name.c_str(),
                            (unsigned long long)v);
                    abort();
                }
            }
        }
        mod->run(id, grid, block, ptrs.data());
    }, std::move(acc));
    return CUDA_SUCCESS;
}

// ---- graphs, from stream capture: a graph is the captured work, replayed in order on
// the stream it is launched on. One stream per capture (no forked captures).

struct Graph {
    std::vector<Op> ops;
};
typedef Graph* CUgraph;
typedef Graph* CUgraphExec;

CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    STICKY();
    Stream* st = stream_of(s);
    if (!st || (uintptr_t)s <= 1) return CUDA_ERROR_INVALID_HANDLE;  // not the legacy stream
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    if (st->capture) return CUDA_ERROR_ILLEGAL_STATE;
    std::lock_guard<std::mutex> order(g_order_mu);  // the legacy stream looks at it
    st->capture = new std::vector<Op>();
    st->captured_events.clear();
    return CUDA_SUCCESS;
}

CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
    STICKY();
    Stream* st = stream_of(s);
    if (!st || !g) return CUDA_ERROR_INVALID_HANDLE;
    if (!st->capture) return CUDA_ERROR_ILLEGAL_STATE;
    *g = new Graph{std::move(*st->capture)};
    std::lock_guard<std::mutex> order(g_order_mu);
    delete st->capture;
    st->capture = nullptr;
    st->captured_events.clear();
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream s, int* status) {
    Stream* st = stream_of(s);
    if (!st || !status) return CUDA_ERROR_INVALID_HANDLE;
    *status = st->capture ? 1 : 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE : _NONE
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* e, CUgraph g, unsigned long long) {
    STICKY();
    if (!e || !g) return CUDA_ERROR_INVALID_VALUE;
    *e = new Graph{g->ops};
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
    STICKY();
    Stream* st = stream_of(s);
    if (!st || !e) return CUDA_ERROR_INVALID_HANDLE;
    if (st->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    // Each replayed operation is checked in the stream order where it is enqueued.
    for (auto& op : e->ops) st->push(op.run, op.acc);
    return CUDA_SUCCESS;
}

CUresult cuGraphUpload(CUgraphExec e, CUstream s) {
    STICKY();
    return e && stream_of(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// The ops are copied into the streams they were launched on: freeing is safe at once.
CUresult cuGraphExecDestroy(CUgraphExec e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    delete e;
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph g) {
    if (!g) return CUDA_ERROR_INVALID_HANDLE;
    delete g;
    return CUDA_SUCCESS;
}

typedef void (*CUhostFn)(void*);
CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
    STICKY();
    NEED_CONTEXT();
    Stream* st = stream_of(s);
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    // No edge to the host: what a host function tells the host's threads is out of
    // the emulator's sight, and an edge taken when it ran would depend on timing.
    st->push([fn, data] { fn(data); });
    return CUDA_SUCCESS;
}

}  // extern "C"
