// stokehold's training step on the GPU: a one-hidden-layer MLP classifier.
//
// Compiled at run time by NVRTC (no headers needed), cached on disk by stokehold keyed by
// this source, the options, the architecture and the NVRTC version.
//
// Layout: row-major float matrices, x (n x d, u8), W1 (d x h), W2 (h x c); the same math
// as the CPU backend (src/train/mlp.rs), which the GPU results are checked against.

// The step is three launches per batch, with the input normalisation fused into both
// products that read the u8 batch:
//   forward_partial  split-K, register-blocked: part[s] = norm(x) W1 over k-chunk s
//   row_tail         per sample: h = relu(b1 + sum_s part[s]), z = h W2 + b2, softmax
//                    cross-entropy, dz = (softmax - onehot) / n, dh = (dz W2^T) masked
//   update           W1 -= lr norm(x)^T dh (register-blocked tiles, samples split, the
//                    splits added by the tile's last block), and in the same launch
//                    b1 -= lr sum dh, W2 -= lr h^T dz, b2 -= lr sum dz
// Every sum is taken in a fixed order (partial sums are added by one thread, in split
// order), so a step is deterministic but for the epoch's loss total, which is
// accumulated with atomics.

// Both products use 64 x 64 output tiles per block of 256 threads (two blocks per SM:
// at most 128 registers a thread, so that one wave of blocks fills an H100), 4 x 4 outputs per
// thread read from shared memory as 16-byte vectors, up to KT values of the summed
// dimension per shared-memory stage. The host keeps each block's share of the summed
// dimension within one stage, so a block loads everything it needs at once (one memory
// round trip, not one per stage). Shared rows are padded to 68 floats (16-byte
// multiples, and the transposed stores spread over the banks).
#define TILE 64
#define KT 64
#define PAD 68
// Elements of a 64 x 64 stage each of 256 threads loads.
#define LOADS (KT * TILE / 256)

struct alignas(16) Stage {
    float v[KT][PAD];
};

// Sixteen bytes, for 16-byte loads and stores.
struct alignas(16) u128 {
    unsigned long long lo, hi;
};

// Staging a stage: every global load of a thread is issued before the first is used, so
// a block pays one memory round trip per stage. Each tile comes in two halves, `load_*`
// into registers and `store_*` into shared memory, and the kernels call both loads
// before either store. Tiles outside the matrices read as zeros (x as its mean, which
// normalises to zero).

// x, 16 bytes a thread: rows [row0, row_end) x inputs [col0, col_end), 64 x 64 at most;
// d, col0 and col_end multiples of 16, x 16-byte aligned.
struct X16 {
    u128 v;
    bool ok;
};

__device__ X16 load_x16(const unsigned char* __restrict__ x, int row0, int row_end, int col0,
                        int col_end, int d, int t)
{
    const int gr = row0 + t / 4, gc = col0 + 16 * (t % 4);
    X16 out = {{0ULL, 0ULL}, gr < row_end && gc < col_end};
    if (out.ok) {
        out.v = *(const u128*)(x + (long long)gr * d + gc);
    }
    return out;
}

// Normalised into st.v[input][row] when `transposed` (the forward product), else
// st.v[row][input].
__device__ void store_x16(Stage& st, X16 in, float mean, float inv_std, bool transposed,
                          int t)
{
    const int r = t / 4, seg = t % 4;
#pragma unroll
    for (int b = 0; b < 16; ++b) {
        unsigned long long word = b < 8 ? in.v.lo : in.v.hi;
        float byte = (float)((word >> (8 * (b % 8))) & 0xff);
        float f = in.ok ? (byte - mean) * inv_std : 0.0f;
        if (transposed) {
            st.v[16 * seg + b][r] = f;
        } else {
            st.v[r][16 * seg + b] = f;
        }
    }
}

// x for any shape, one byte a load.
__device__ void load_x1(float v[LOADS], const unsigned char* __restrict__ x, int row0,
                        int row_end, int col0, int col_end, int d, float mean, int t)
{
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
        int i = t + u * 256, gr = row0 + i / TILE, gc = col0 + i % TILE;
        v[u] = (gr < row_end && gc < col_end) ? (float)x[(long long)gr * d + gc] : mean;
    }
}

__device__ void store_x1(Stage& st, const float v[LOADS], float mean, float inv_std,
                         bool transposed, int t)
{
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
        int i = t + u * 256, r = i / TILE, c = i % TILE;
        float f = (v[u] - mean) * inv_std;
        if (transposed) {
            st.v[c][r] = f;
        } else {
            st.v[r][c] = f;
        }
    }
}

// A row-major float matrix of h columns, 16 bytes a load: rows [row0, row_end) x columns
// [col0, col0 + 64); h a multiple of 4, m 16-byte aligned.
__device__ void load_f4(float4 v[4], const float* __restrict__ m, int row0, int row_end,
                        int col0, int h, int t)
{
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        int i = t + 256 * u, gr = row0 + i / 16, gc = col0 + (i % 16) * 4;
        v[u] = (gr < row_end && gc < h) ? *(const float4*)(m + (long long)gr * h + gc)
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

__device__ void store_f4(Stage& st, const float4 v[4], int t)
{
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        int i = t + 256 * u;
        *(float4*)&st.v[i / 16][(i % 16) * 4] = v[u];
    }
}

// The same for any h, one float a load.
__device__ void load_f1(float v[LOADS], const float* __restrict__ m, int row0, int row_end,
                        int col0, int h, int t)
{
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
        int i = t + u * 256, gr = row0 + i / TILE, gc = col0 + i % TILE;
        v[u] = (gr < row_end && gc < h) ? m[(long long)gr * h + gc] : 0.0f;
    }
}

__device__ void store_f1(Stage& st, const float v[LOADS], int t)
{
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
        int i = t + u * 256;
        st.v[i / TILE][i % TILE] = v[u];
    }
}

// Whether a product's tiles can move 16 bytes a thread: rows of x a multiple of 16
// bytes, rows of the float matrix a multiple of 4 floats (the host aligns chunks to 16).
__device__ bool wide_tiles(int d, int h)
{
    return (d & 15) == 0 && (h & 3) == 0;
}

// One stage of either product: x's rows [row0, row_end) x inputs [col0, col_end) into
// `xs` (transposed for the forward product), rows [mrow0, mrow_end) x columns
// [j0, j0 + 64) of the h-column matrix m into `ms`.
__device__ void stage(Stage& xs, Stage& ms, bool wide, const unsigned char* __restrict__ x,
                      int row0, int row_end, int col0, int col_end, int d, float mean,
                      float inv_std, bool transposed, const float* __restrict__ m,
                      int mrow0, int mrow_end, int j0, int h, int t)
{
    if (wide) {
        X16 xv = load_x16(x, row0, row_end, col0, col_end, d, t);
        float4 mv[4];
        load_f4(mv, m, mrow0, mrow_end, j0, h, t);
        store_x16(xs, xv, mean, inv_std, transposed, t);
        store_f4(ms, mv, t);
    } else {
        float xv[LOADS], mv[LOADS];
        load_x1(xv, x, row0, row_end, col0, col_end, d, mean, t);
        load_f1(mv, m, mrow0, mrow_end, j0, h, t);
        store_x1(xs, xv, mean, inv_std, transposed, t);
        store_f1(ms, mv, t);
    }
}

// acc[i][j] += sum over k < n of a.v[k][4 ty + i] * b.v[k][4 tx + j]: the 4 x 4 outputs of
// thread (tx, ty), both operands read from shared memory 16 bytes at a time.
__device__ void accumulate(const Stage& a, const Stage& b, int n, int tx, int ty,
                           float acc[4][4])
{
#pragma unroll 8
    for (int k = 0; k < n; ++k) {
        float4 av4 = *(const float4*)&a.v[k][4 * ty];
        float4 bv4 = *(const float4*)&b.v[k][4 * tx];
        float av[4] = {av4.x, av4.y, av4.z, av4.w}, bv[4] = {bv4.x, bv4.y, bv4.z, bv4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
}

// row[col..col + 4] = v, as one 16-byte store where the row allows (h a multiple of 4:
// then col, a multiple of 4, is 16-byte aligned and col < h means all four fit), else
// element by element up to h.
__device__ void store4(float* row, int col, int h, const float v[4])
{
    if ((h & 3) == 0) {
        if (col < h) {
            *(float4*)(row + col) = make_float4(v[0], v[1], v[2], v[3]);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (col + j < h) row[col + j] = v[j];
    }
}

// v[0..4] += row[col..col + 4] (as `store4`), read past L1: other SMs wrote it.
__device__ void add4_cg(const float* row, int col, int h, float v[4])
{
    if ((h & 3) == 0) {
        if (col < h) {
            float4 a = __ldcg((const float4*)(row + col));
            v[0] += a.x;
            v[1] += a.y;
            v[2] += a.z;
            v[3] += a.w;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (col + j < h) v[j] += __ldcg(row + col + j);
    }
}

// row[col..col + 4] -= lr * g (as `store4`).
__device__ void sgd4(float* row, int col, int h, float lr, const float g[4])
{
    if ((h & 3) == 0) {
        if (col < h) {
            float4 w = *(float4*)(row + col);
            w.x -= lr * g[0];
            w.y -= lr * g[1];
            w.z -= lr * g[2];
            w.w -= lr * g[3];
            *(float4*)(row + col) = w;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (col + j < h) row[col + j] -= lr * g[j];
    }
}

// part[s][r][j] = sum over k in [s * chunk, (s + 1) * chunk) of
// ((x[r][k] - mean) * inv_std) * w1[k][j]. Grid: (ceil(h / 64), ceil(n / 64), splits).
extern "C" __global__ void __launch_bounds__(256, 2) forward_partial(
    const unsigned char* __restrict__ x, const float* __restrict__ w1,
    float* __restrict__ part, int n, int d, int h, int chunk, float mean, float inv_std)
{
    __shared__ Stage xs;  // xs.v[k][r]
    __shared__ Stage ws;  // ws.v[k][j]
    const int t = threadIdx.x, tx = t % 16, ty = t / 16;
    const int r0 = blockIdx.y * TILE, j0 = blockIdx.x * TILE, s = blockIdx.z;
    const int k_begin = s * chunk;
    const int k_end = min(d, k_begin + chunk);
    float acc[4][4] = {};
    const bool wide = wide_tiles(d, h);
    for (int k0 = k_begin; k0 < k_end; k0 += KT) {
        const int k_stop = min(k_end, k0 + KT);
        stage(xs, ws, wide, x, r0, n, k0, k_stop, d, mean, inv_std, true, w1, k0, k_stop, j0,
              h, t);
        __syncthreads();
        accumulate(xs, ws, k_stop - k0, tx, ty, acc);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = r0 + 4 * ty + i;
        if (r < n) {
            store4(part + ((long long)s * n + r) * h, j0 + 4 * tx, h, acc[i]);
        }
    }
}

// row_tail: one block of TAIL threads per sample; logits reduced CC classes at a time.
#define TAIL 256
#define GROUPS (TAIL / 64)
#define CC 16

// Sample r = blockIdx.x: hid = relu(b1 + sum_s part[s][r]); z = hid W2 + b2; softmax
// cross-entropy against y[r] (loss and correct predictions accumulated on the device; a
// label outside 0..c contributes nothing; the first such sample to get there sets bad[0]
// to 1 + r and bad[1] to its label); z becomes dz =
// (softmax - onehot) / n; dh = (dz W2^T) where hid > 0, else 0.
extern "C" __global__ void row_tail(
    const float* __restrict__ part, int splits, const float* __restrict__ b1,
    const float* __restrict__ w2, const float* __restrict__ b2,
    const long long* __restrict__ y, float* __restrict__ hid, float* __restrict__ z,
    float* __restrict__ dh, int n, int h, int c,
    double* __restrict__ loss_sum, unsigned long long* __restrict__ correct,
    unsigned long long* __restrict__ bad)
{
    __shared__ float red[CC][TAIL];
    __shared__ float group[GROUPS][64];
    const int r = blockIdx.x, t = threadIdx.x;
    if (r >= n) {
        return;  // the whole block: r is the block's
    }
    const long long label = y[r];  // needed last, loaded first
    const long long split_stride = (long long)n * h;
    float* hr = hid + (long long)r * h;
    float* zr = z + (long long)r * c;
    // Hidden units 64 at a time; the GROUPS groups of 64 threads each sum every
    // GROUPS-th split (all their loads in flight at once), then group 0 adds the groups'
    // sums in group order.
    const int lane64 = t % 64, g = t / 64;
    for (int j0 = 0; j0 < h; j0 += 64) {
        const int j = j0 + lane64;
        float v = 0.0f;
        if (j < h) {
            const float* p = part + (long long)r * h + j;
            for (int s0 = g; s0 < splits; s0 += GROUPS * 16) {
                float pv[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    int sp = s0 + u * GROUPS;
                    pv[u] = sp < splits ? p[sp * split_stride] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 16; ++u) v += pv[u];
            }
        }
        group[g][lane64] = v;
        __syncthreads();
        if (g == 0 && j < h) {
            float sum = b1[j];
#pragma unroll
            for (int q = 0; q < GROUPS; ++q) sum += group[q][lane64];
            hr[j] = sum > 0.0f ? sum : 0.0f;
        }
        __syncthreads();
    }
    for (int c0 = 0; c0 < c; c0 += CC) {
        float acc[CC];
#pragma unroll
        for (int q = 0; q < CC; ++q) acc[q] = 0.0f;
        const int cn = min(CC, c - c0);
        for (int j = t; j < h; j += TAIL) {
            float hv = hr[j];
            const float* wrow = w2 + (long long)j * c + c0;
#pragma unroll
            for (int q = 0; q < CC; ++q) {
                if (q < cn) acc[q] += hv * wrow[q];
            }
        }
#pragma unroll
        for (int q = 0; q < CC; ++q) red[q][t] = acc[q];
        __syncthreads();
        for (int half = TAIL / 2; half > 0; half /= 2) {
            for (int i = t; i < CC * half; i += TAIL) {
                int q = i / half, u = i % half;
                red[q][u] += red[q][u + half];
            }
            __syncthreads();
        }
        if (t < cn) {
            zr[c0 + t] = red[t][0] + b2[c0 + t];
        }
        __syncthreads();
    }
    if (t == 0) {
        if (label < 0 || label >= c) {
            if (atomicCAS(bad, 0ull, (unsigned long long)(r + 1)) == 0ull) {
                bad[1] = (unsigned long long)label;
            }
            for (int q = 0; q < c; ++q) zr[q] = 0.0f;
        } else {
            float mx = zr[0];
            int arg = 0;
            for (int q = 1; q < c; ++q) {
                if (zr[q] > mx) {
                    mx = zr[q];
                    arg = q;
                }
            }
            // log softmax of the label, taken before exponentiation so that a very
            // negative logit gives a large finite loss rather than log(0).
            float z_label = zr[label] - mx;
            float sum = 0.0f;
            for (int q = 0; q < c; ++q) {
                zr[q] = __expf(zr[q] - mx);
                sum += zr[q];
            }
            atomicAdd(loss_sum, (double)(logf(sum) - z_label));
            if (arg == label) {
                atomicAdd(correct, 1ULL);
            }
            float scale = 1.0f / ((float)n * sum);
            for (int q = 0; q < c; ++q) zr[q] *= scale;
            zr[label] -= 1.0f / (float)n;
        }
    }
    __syncthreads();
    float* dr = dh + (long long)r * h;
    for (int j = t; j < h; j += TAIL) {
        float v = 0.0f;
        if (hr[j] > 0.0f) {
            const float* wrow = w2 + (long long)j * c;
            for (int q = 0; q < c; ++q) v += zr[q] * wrow[q];
        }
        dr[j] = v;
    }
}

// update, small part: SMALL outputs per block of 8 warps, one per lane (so 32).
#define SMALL 32

// Blocks [0, w1_blocks): the W1 step, W1[k][j] -= lr * sum_r norm(x[r][k]) * dh[r][j],
// in 64 x 64 tiles (ceil(h / 64) per row of tiles), each tile's samples split in
// `row_splits` runs of `rows_per` (block = tile * row_splits + split). Each block writes
// its partial sums to gpart[split][k][j]; the last block of a tile to finish (counted in
// ticket[tile], which it resets) adds the partials in split order and updates W1, so the
// result does not depend on which block ran first.
// Blocks after those: 32 outputs each, in the order b1 (h), W2 (h x c, row-major),
// b2 (c):
//   b1[j]    -= lr * sum_r dh[r][j]
//   W2[j][q] -= lr * sum_r hid[r][j] * dz[r][q]
//   b2[q]    -= lr * sum_r dz[r][q]
extern "C" __global__ void __launch_bounds__(256, 2) update(
    const unsigned char* __restrict__ x, const float* __restrict__ hid,
    const float* __restrict__ dz, const float* __restrict__ dh,
    float* __restrict__ w1, float* __restrict__ b1, float* __restrict__ w2,
    float* __restrict__ b2, float* __restrict__ gpart, unsigned int* __restrict__ ticket, int n, int d, int h, int c,
    float mean, float inv_std, float lr, int w1_blocks, int row_splits, int rows_per)
{
    __shared__ Stage xs;  // xs.v[r][k]
    __shared__ Stage gs;  // gs.v[r][j]
    __shared__ float sums[8][33];
    __shared__ unsigned int last;
    const int t = threadIdx.x;
    const int block = blockIdx.x;
    if (block < w1_blocks) {
        const int tiles_j = (h + TILE - 1) / TILE;
        const int tile = block / row_splits, split = block % row_splits;
        const int k0 = (tile / tiles_j) * TILE, j0 = (tile % tiles_j) * TILE;
        const int tx = t % 16, ty = t / 16;
        const int r_begin = split * rows_per, r_end = min(n, r_begin + rows_per);
        float acc[4][4] = {};
        const bool wide = wide_tiles(d, h);
        for (int r0 = r_begin; r0 < r_end; r0 += KT) {
            const int r_stop = min(r_end, r0 + KT);
            stage(xs, gs, wide, x, r0, r_stop, k0, d, d, mean, inv_std, false, dh, r0, r_stop,
                  j0, h, t);
            __syncthreads();
            accumulate(xs, gs, r_stop - r0, tx, ty, acc);
            __syncthreads();
        }
        if (row_splits == 1) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int k = k0 + 4 * ty + i;
                if (k < d) sgd4(w1 + (long long)k * h, j0 + 4 * tx, h, lr, acc[i]);
            }
            return;  // the whole block
        }
        const long long plane = (long long)d * h;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int k = k0 + 4 * ty + i;
            if (k < d) store4(gpart + split * plane + (long long)k * h, j0 + 4 * tx, h, acc[i]);
        }
        // Publish the partials, then take a ticket: the tile's last block applies them.
        __threadfence();
        __syncthreads();
        if (t == 0) {
            unsigned int done = atomicAdd(&ticket[tile], 1u);
            last = done == (unsigned int)row_splits - 1;
            if (last) {
                ticket[tile] = 0;  // ready for the next step
            }
        }
        __syncthreads();
        if (last) {
            __threadfence();
            // The tile's partials, added in split order.
            float g[4][4] = {};
#pragma unroll 8
            for (int q = 0; q < row_splits; ++q) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int k = k0 + 4 * ty + i;
                    if (k < d) add4_cg(gpart + q * plane + (long long)k * h, j0 + 4 * tx, h, g[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int k = k0 + 4 * ty + i;
                if (k < d) sgd4(w1 + (long long)k * h, j0 + 4 * tx, h, lr, g[i]);
            }
        }
        return;  // the whole block: `block` is the block's
    }
    // 32 consecutive outputs per block, one per lane; the 8 warps split the samples and
    // their sums are added in warp order.
    const long long outputs = (long long)h + (long long)h * c + c;
    const long long o = (long long)(block - w1_blocks) * SMALL + t % SMALL;
    const int lane = t % 32, warp = t / 32;
    float v = 0.0f;
    if (o < outputs) {
        if (o < h) {
#pragma unroll 8
            for (int r = warp; r < n; r += 8) v += dh[(long long)r * h + o];
        } else if (o < h + (long long)h * c) {
            int j = (int)((o - h) / c), q = (int)((o - h) % c);
#pragma unroll 8
            for (int r = warp; r < n; r += 8) {
                v += hid[(long long)r * h + j] * dz[(long long)r * c + q];
            }
        } else {
            int q = (int)(o - h - (long long)h * c);
#pragma unroll 8
            for (int r = warp; r < n; r += 8) v += dz[(long long)r * c + q];
        }
    }
    sums[warp][lane] = v;
    __syncthreads();
    if (warp == 0 && o < outputs) {
        float g = 0.0f;
        for (int w = 0; w < 8; ++w) g += sums[w][lane];
        g *= lr;
        if (o < h) {
            b1[o] -= g;
        } else if (o < h + (long long)h * c) {
            w2[o - h] -= g;
        } else {
            b2[o - h - (long long)h * c] -= g;
        }
    }
}

// The device cache moves rows in units of 16, 8 or 1 bytes (`unit`, chosen by the host:
// the largest that divides the row size; every base address is 256-byte aligned).

// Copies `unit` bytes (16, 8 or 1) from element `from` of `src` to element `to` of `dst`.
__device__ void copy_unit(const unsigned char* __restrict__ src, long long from,
                          unsigned char* __restrict__ dst, long long to, int unit)
{
    if (unit == 16) {
        ((u128*)dst)[to] = ((const u128*)src)[from];
    } else if (unit == 8) {
        ((unsigned long long*)dst)[to] = ((const unsigned long long*)src)[from];
    } else {
        dst[to] = src[from];
    }
}

// Device cache: copy row k of a batch column into the dataset-sized cache at idx[k],
// `unit` bytes per thread (rows * row_bytes / unit threads).
extern "C" __global__ void scatter_rows(
    const unsigned char* __restrict__ batch, unsigned char* __restrict__ cache,
    const unsigned long long* __restrict__ idx, int rows, long long row_bytes, int unit)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long units = row_bytes / unit;
    if (i < rows * units) {
        copy_unit(batch, i, cache, (long long)idx[i / units] * units + i % units, unit);
    }
}

// Device cache: the inverse, assembling a batch column from the cache by sample index.
extern "C" __global__ void gather_rows(
    const unsigned char* __restrict__ cache, unsigned char* __restrict__ batch,
    const unsigned long long* __restrict__ idx, int rows, long long row_bytes, int unit)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long units = row_bytes / unit;
    if (i < rows * units) {
        copy_unit(cache, (long long)idx[i / units] * units + i % units, batch, i, unit);
    }
}
