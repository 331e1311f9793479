// A bare host-to-device bandwidth probe in plain CUDA C, independent of stokehold: the
// reference its own copy figures are read against. Built by nvcc on the GPU machine
// (`.ci/gpu/env.sh`):
//
//   nvcc -O2 -o /tmp/h2d_probe benches/h2d_probe.cu && /tmp/h2d_probe
//
// For each size (one batch of the default dataset, 788,480 B; 8 MB; 64 MB) and each host
// memory kind (pinned, pinned write-combined, pageable) it times 32 back-to-back
// cudaMemcpyAsync calls between two events, and then the same copies each bracketed by its
// own event pair (as the feeder times them), and prints GB/s (1e9 B/s) for both. Then, at
// one batch's size, the same from a ring of 48 pinned buffers taken in turn (as a loader's
// pool is), first untouched since the last copy and then each rewritten by the CPU just
// before its copy (as a loader worker does).

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(call)                                                                    \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,         \
                         cudaGetErrorString(e_));                                      \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

static const int REPS = 32;
static const int RING = 48;

// Back-to-back: one event pair around all copies.
static double loop_gbs(void* dst, const void* src, size_t n, cudaStream_t s) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));  // untimed first copy
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < REPS; ++i) {
        CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
    }
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return (double)n * REPS / (ms / 1e3) / 1e9;
}

// Each copy between its own event pair; the sum of the pairs' times.
static double bracketed_gbs(void* dst, const void* src, size_t n, cudaStream_t s) {
    cudaEvent_t ev[2 * REPS];
    for (int i = 0; i < 2 * REPS; ++i) {
        CHECK(cudaEventCreate(&ev[i]));
    }
    for (int i = 0; i < REPS; ++i) {
        CHECK(cudaEventRecord(ev[2 * i], s));
        CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
        CHECK(cudaEventRecord(ev[2 * i + 1], s));
    }
    CHECK(cudaStreamSynchronize(s));
    double total = 0;
    for (int i = 0; i < REPS; ++i) {
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        total += ms;
    }
    for (int i = 0; i < 2 * REPS; ++i) {
        CHECK(cudaEventDestroy(ev[i]));
    }
    return (double)n * REPS / (total / 1e3) / 1e9;
}

// Copies from `RING` buffers in turn, each bracketed by events; `touch` rewrites each
// buffer on the CPU just before its copy.
static double ring_gbs(void* dst, void** bufs, size_t n, cudaStream_t s, bool touch) {
    cudaEvent_t ev[2 * RING];
    for (int i = 0; i < 2 * RING; ++i) {
        CHECK(cudaEventCreate(&ev[i]));
    }
    double total = 0;
    for (int pass = 0; pass < 2; ++pass) {  // the first pass is untimed
        for (int i = 0; i < RING; ++i) {
            if (touch) {
                std::memset(bufs[i], pass + i, n);
            }
            CHECK(cudaEventRecord(ev[2 * i], s));
            CHECK(cudaMemcpyAsync(dst, bufs[i], n, cudaMemcpyHostToDevice, s));
            CHECK(cudaEventRecord(ev[2 * i + 1], s));
            // One copy at a time, as a loader-bound feeder issues them.
            CHECK(cudaEventSynchronize(ev[2 * i + 1]));
        }
    }
    for (int i = 0; i < RING; ++i) {
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        total += ms;
    }
    for (int i = 0; i < 2 * RING; ++i) {
        CHECK(cudaEventDestroy(ev[i]));
    }
    return (double)n * RING / (total / 1e3) / 1e9;
}

int main() {
    const size_t sizes[] = {788480, 8u << 20, 64u << 20};
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    int driver = 0, runtime = 0;
    CHECK(cudaDriverGetVersion(&driver));
    CHECK(cudaRuntimeGetVersion(&runtime));
    std::printf("h2d probe: %s, driver API %d, runtime %d\n", p.name, driver, runtime);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void* dst;
    CHECK(cudaMalloc(&dst, sizes[2]));
    std::printf("%-10s %-16s %12s %12s\n", "bytes", "host memory", "loop GB/s", "per-copy GB/s");
    for (size_t n : sizes) {
        void *plain, *wc;
        CHECK(cudaHostAlloc(&plain, n, cudaHostAllocDefault));
        CHECK(cudaHostAlloc(&wc, n, cudaHostAllocWriteCombined));
        void* pageable = std::malloc(n);
        std::memset(plain, 1, n);
        std::memset(wc, 1, n);
        std::memset(pageable, 1, n);
        struct { const char* name; void* ptr; } kinds[] = {
            {"pinned", plain}, {"write-combined", wc}, {"pageable", pageable}};
        for (auto& k : kinds) {
            double l = loop_gbs(dst, k.ptr, n, s);
            double b = bracketed_gbs(dst, k.ptr, n, s);
            std::printf("%-10zu %-16s %12.2f %12.2f\n", n, k.name, l, b);
        }
        CHECK(cudaFreeHost(plain));
        CHECK(cudaFreeHost(wc));
        std::free(pageable);
    }
    const size_t n = sizes[0];
    const unsigned kinds[] = {cudaHostAllocDefault, cudaHostAllocWriteCombined};
    for (unsigned flags : kinds) {
        void* bufs[RING];
        for (int i = 0; i < RING; ++i) {
            CHECK(cudaHostAlloc(&bufs[i], n, flags));
            std::memset(bufs[i], 1, n);
        }
        const char* kind = flags ? "write-combined" : "pinned";
        std::printf("%-10zu %-16s ring of %d, one copy at a time: %.2f GB/s untouched, "
                    "%.2f GB/s rewritten before each copy\n",
                    n, kind, RING, ring_gbs(dst, bufs, n, s, false), ring_gbs(dst, bufs, n, s, true));
        for (int i = 0; i < RING; ++i) {
            CHECK(cudaFreeHost(bufs[i]));
        }
    }
    CHECK(cudaFree(dst));
    CHECK(cudaStreamDestroy(s));
    return 0;
}
