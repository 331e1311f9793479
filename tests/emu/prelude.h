// stokehold's CUDA emulator, kernel side: CUDA C kernels compiled as host C++.
//
// The emulated NVRTC (nvrtc.cpp) puts this header in front of the kernel source and a
// table of the kernels after it, and builds a shared object; the emulated driver
// (cuda.cpp) loads that as the "module" and calls `emu_run` to execute a launch.
//
// Each block runs on the stream's worker thread. A kernel without `__syncthreads` runs
// its threads one after another; a kernel with it runs them as fibers that switch at
// each barrier, so every thread of the block reaches the barrier before any passes it,
// as on the GPU. `__shared__` is per worker thread, shared by a block's fibers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct dim3 {
    unsigned x, y, z;
};

static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__ static inline
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __launch_bounds__(...)

// glibc declares __expf and __logf without exporting them: map them to the plain ones.
#define __expf(x) expf(x)
#define __logf(x) logf(x)
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
template <class T>
static inline T __ldcg(const T* p) { return *p; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// Atomics are real atomics: kernels on two streams run on two threads at once.
static inline int atomicCAS(int* p, int expected, int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return expected;
}
static inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected,
                                           unsigned long long desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return expected;
}
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class F>
static inline F emu_atomic_add_float(F* p, F v) {
    using U = typename std::conditional<sizeof(F) == 8, uint64_t, uint32_t>::type;
    U* u = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(u, __ATOMIC_SEQ_CST);
    for (;;) {
        F f;
        std::memcpy(&f, &old, sizeof f);
        F n = f + v;
        U nu;
        std::memcpy(&nu, &n, sizeof nu);
        if (__atomic_compare_exchange_n(u, &old, nu, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            return f;
        }
    }
}
static inline float atomicAdd(float* p, float v) { return emu_atomic_add_float(p, v); }
static inline double atomicAdd(double* p, double v) { return emu_atomic_add_float(p, v); }

namespace emu {

// A fiber's saved stack pointer, and whether its thread has returned.
struct Fiber {
    void* sp;
    bool done;
    dim3 tid;
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

static thread_local bool in_fibers = false;
static thread_local Fiber* current = nullptr;
static thread_local void* scheduler_sp = nullptr;
#if !defined(__x86_64__)
static thread_local ucontext_t scheduler_uc;
#endif
static thread_local void (*t_invoke)(void**) = nullptr;
static thread_local void** t_params = nullptr;

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save, switches to `to` and restores its registers (System V x86-64).
extern "C" void emu_swap(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .type emu_swap, @function
emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_swap, .-emu_swap
)");
#endif

static void to_scheduler() {
#if defined(__x86_64__)
    emu_swap(&current->sp, scheduler_sp);
#else
    swapcontext(&current->uc, &scheduler_uc);
#endif
}

static void fiber_main() {
    t_invoke(t_params);
    current->done = true;
    to_scheduler();
    std::abort();  // a finished fiber is never resumed
}

}  // namespace emu

static inline void __syncthreads() {
    if (!emu::in_fibers) {
        std::fprintf(stderr, "stokehold-emu: __syncthreads in a kernel run without fibers\n");
        std::abort();
    }
    emu::to_scheduler();
}

namespace emu {

constexpr size_t kStack = 64 * 1024;

// Under STOKEHOLD_EMU_JITTER_US, blocks run in reverse order, and so do the threads of a
// block (each round of fibers too): a kernel that only works in index order shows it.
static bool reversed() {
    static const bool on = [] {
        const char* j = getenv("STOKEHOLD_EMU_JITTER_US");
        return j && atoi(j) > 0;
    }();
    return on;
}

// Runs one block of `n` threads as fibers, round by round: each round resumes every
// unfinished thread until its next barrier or its end.
static void run_block_fibers(const dim3& block) {
    size_t n = (size_t)block.x * block.y * block.z;
    static thread_local std::vector<unsigned char> stacks;
    static thread_local std::vector<Fiber> fibers;
    if (stacks.size() < n * kStack) {
        stacks.assign(n * kStack, 0);
    }
    fibers.resize(n);
    size_t i = 0;
    for (unsigned z = 0; z < block.z; ++z)
        for (unsigned y = 0; y < block.y; ++y)
            for (unsigned x = 0; x < block.x; ++x, ++i) {
                Fiber& f = fibers[i];
                f.done = false;
                f.tid = dim3{x, y, z};
                unsigned char* top = stacks.data() + (i + 1) * kStack;
                top = (unsigned char*)((uintptr_t)top & ~(uintptr_t)15);
#if defined(__x86_64__)
                // [top-16]: fiber_main as the return address of the first switch, so
                // that it starts with the stack aligned as after a call.
                void** ret = (void**)(top - 16);
                ret[0] = (void*)&fiber_main;
                ret[1] = nullptr;
                void** regs = ret - 6;
                for (int r = 0; r < 6; ++r) regs[r] = nullptr;
                f.sp = regs;
#else
                getcontext(&f.uc);
                f.uc.uc_stack.ss_sp = top - kStack + 16;
                f.uc.uc_stack.ss_size = kStack - 16;
                f.uc.uc_link = nullptr;
                makecontext(&f.uc, (void (*)())fiber_main, 0);
#endif
            }
    in_fibers = true;
    bool left = true;
    while (left) {
        left = false;
        for (size_t r = 0; r < n; ++r) {
            Fiber& f = fibers[reversed() ? n - 1 - r : r];
            if (f.done) continue;
            current = &f;
            threadIdx = f.tid;
#if defined(__x86_64__)
            emu_swap(&scheduler_sp, f.sp);
#else
            swapcontext(&scheduler_uc, &f.uc);
#endif
            if (!f.done) left = true;
        }
    }
    in_fibers = false;
    current = nullptr;
}

struct Entry {
    const char* name;
    void (*invoke)(void**);
    bool barriers;
    size_t nparams;
    const size_t* sizes;
    const unsigned char* kinds;
    unsigned max_threads;  // per block: `__launch_bounds__`'s, or 1024
};

// A parameter's kind, for the driver's stream-order checks: 0 not a pointer, 1 a
// pointer to const (read), 2 any other pointer (written).
template <class A>
constexpr unsigned char kind() {
    return std::is_pointer<A>::value ? (std::is_const<typename std::remove_pointer<A>::type>::value ? 1 : 2)
                                     : 0;
}

template <class F>
struct Invoker;
template <class... A>
struct Invoker<void (*)(A...)> {
    static constexpr size_t count = sizeof...(A);
    static constexpr size_t sizes[sizeof...(A) + 1] = {sizeof(A)..., 0};
    static constexpr unsigned char kinds[sizeof...(A) + 1] = {kind<A>()..., 0};
    template <void (*F)(A...), size_t... I>
    static void call(void** p, std::index_sequence<I...>) {
        F(*static_cast<typename std::remove_cv<A>::type*>(p[I])...);
    }
    template <void (*F)(A...)>
    static void run(void** p) {
        call<F>(p, std::index_sequence_for<A...>{});
    }
};

}  // namespace emu

// `prefix` is "" for a kernel with C linkage, "_Z" for one without: a real module names
// those by their C++ mangled names, which a lookup by the plain name does not find.
#define EMU_ENTRY(name, barriers, prefix, max_threads)                                 \
    emu::Entry {                                                                       \
        prefix #name, &emu::Invoker<decltype(&name)>::template run<&name>, barriers,   \
            emu::Invoker<decltype(&name)>::count, emu::Invoker<decltype(&name)>::sizes, \
            emu::Invoker<decltype(&name)>::kinds, max_threads                          \
    }

// Defined after the kernels by the generated table.
extern const emu::Entry emu_entries[];
extern const int emu_entry_count;

extern "C" int emu_find(const char* name) {
    for (int i = 0; i < emu_entry_count; ++i) {
        if (std::strcmp(emu_entries[i].name, name) == 0) return i;
    }
    return -1;
}

// The size of each parameter of kernel `id` (so the driver can copy them at launch).
extern "C" size_t emu_params(int id, const size_t** sizes) {
    *sizes = emu_entries[id].sizes;
    return emu_entries[id].nparams;
}

// The most threads a block of kernel `id` may have.
extern "C" unsigned emu_max_threads(int id) { return emu_entries[id].max_threads; }

// The kind of each parameter of kernel `id` (see emu::kind).
extern "C" const unsigned char* emu_param_kinds(int id) { return emu_entries[id].kinds; }

static inline unsigned emu_at(unsigned i, unsigned n) { return emu::reversed() ? n - 1 - i : i; }

extern "C" void emu_run(int id, dim3 grid, dim3 block, void** params) {
    const emu::Entry& e = emu_entries[id];
    gridDim = grid;
    blockDim = block;
    emu::t_invoke = e.invoke;
    emu::t_params = params;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = dim3{emu_at(bx, grid.x), emu_at(by, grid.y), emu_at(bz, grid.z)};
                if (e.barriers) {
                    emu::run_block_fibers(block);
                    continue;
                }
                for (unsigned z = 0; z < block.z; ++z)
                    for (unsigned y = 0; y < block.y; ++y)
                        for (unsigned x = 0; x < block.x; ++x) {
                            threadIdx = dim3{emu_at(x, block.x), emu_at(y, block.y), emu_at(z, block.z)};
                            e.invoke(params);
                        }
            }
}
