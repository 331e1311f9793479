// stoker's training step on the GPU: a one-hidden-layer MLP classifier.
//
// Compiled at run time by NVRTC (no headers needed), cached on disk by stoker keyed by
// this source, the options, the architecture and the NVRTC version.
//
// Layout: row-major float matrices. The matrix products use one strided kernel,
// C = alpha * A(m x k) B(k x n) + beta * C, where each operand has a row stride and a
// column stride, so transposes cost nothing (the same convention as the CPU backend's
// matrixmultiply::sgemm, which the GPU results are checked against).

#define TILE 16

extern "C" __global__ void sgemm_strided(
    int m, int n, int k, float alpha,
    const float* __restrict__ a, long long rsa, long long csa,
    const float* __restrict__ b, long long rsb, long long csb,
    float beta, float* __restrict__ c, long long rsc)
{
    __shared__ float as[TILE][TILE];
    __shared__ float bs[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < k; t += TILE) {
        int ka = t + threadIdx.x;
        int kb = t + threadIdx.y;
        as[threadIdx.y][threadIdx.x] = (row < m && ka < k) ? a[row * rsa + ka * csa] : 0.0f;
        bs[threadIdx.y][threadIdx.x] = (kb < k && col < n) ? b[kb * rsb + col * csb] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TILE; ++i) {
            acc += as[threadIdx.y][i] * bs[i][threadIdx.x];
        }
        __syncthreads();
    }
    if (row < m && col < n) {
        float* out = &c[row * rsc + col];
        *out = alpha * acc + (beta == 0.0f ? 0.0f : beta * *out);
    }
}

// out[i] = (x[i] - mean) * inv_std, u8 inputs to float.
extern "C" __global__ void normalize_u8(
    const unsigned char* __restrict__ x, float* __restrict__ out, long long count,
    float mean, float inv_std)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < count) {
        out[i] = ((float)x[i] - mean) * inv_std;
    }
}

// Broadcast a bias over rows: m[r * cols + j] = bias[j].
extern "C" __global__ void fill_rows(
    float* __restrict__ m, const float* __restrict__ bias, int rows, int cols)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)rows * cols) {
        m[i] = bias[i % cols];
    }
}

extern "C" __global__ void relu(float* __restrict__ h, long long count)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < count && h[i] < 0.0f) {
        h[i] = 0.0f;
    }
}

// Softmax cross-entropy, one thread per sample. Accumulates the loss and the correct
// predictions on the device (read once per epoch), and turns z into dL/dz =
// (softmax - onehot) / n. A label outside 0..classes sets *bad to 1 + its row and
// contributes nothing.
extern "C" __global__ void softmax_xent(
    float* __restrict__ z, const long long* __restrict__ y, int n, int classes,
    double* __restrict__ loss_sum, unsigned long long* __restrict__ correct,
    int* __restrict__ bad)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) {
        return;
    }
    float* row = z + (long long)r * classes;
    long long label = y[r];
    if (label < 0 || label >= classes) {
        atomicCAS(bad, 0, r + 1);
        for (int j = 0; j < classes; ++j) {
            row[j] = 0.0f;
        }
        return;
    }
    float mx = row[0];
    int arg = 0;
    for (int j = 1; j < classes; ++j) {
        if (row[j] > mx) {
            mx = row[j];
            arg = j;
        }
    }
    // log softmax of the label, taken before exponentiation so that a very negative
    // logit gives a large finite loss rather than log(0).
    float z_label = row[label] - mx;
    float sum = 0.0f;
    for (int j = 0; j < classes; ++j) {
        row[j] = __expf(row[j] - mx);
        sum += row[j];
    }
    atomicAdd(loss_sum, (double)(logf(sum) - z_label));
    if (arg == label) {
        atomicAdd(correct, 1ULL);
    }
    float scale = 1.0f / ((float)n * sum);
    for (int j = 0; j < classes; ++j) {
        row[j] *= scale;
    }
    row[label] -= 1.0f / (float)n;
}

// dh[i] = 0 where the forward activation h[i] was clipped by the ReLU.
extern "C" __global__ void relu_backward(
    float* __restrict__ dh, const float* __restrict__ h, long long count)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < count && h[i] <= 0.0f) {
        dh[i] = 0.0f;
    }
}

// b[j] -= lr * sum_r g[r * cols + j]: the bias gradient and its SGD step, one thread per
// column.
extern "C" __global__ void bias_sgd(
    float* __restrict__ b, const float* __restrict__ g, int rows, int cols, float lr)
{
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) {
        return;
    }
    float s = 0.0f;
    for (int r = 0; r < rows; ++r) {
        s += g[(long long)r * cols + j];
    }
    b[j] -= lr * s;
}

// Device cache: copy row k of a batch column to the dataset-sized cache at idx[k].
extern "C" __global__ void scatter_rows(
    const unsigned char* __restrict__ batch, unsigned char* __restrict__ cache,
    const unsigned long long* __restrict__ idx, int rows, long long row_bytes)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < rows * row_bytes) {
        long long r = i / row_bytes, o = i % row_bytes;
        cache[idx[r] * row_bytes + o] = batch[i];
    }
}

// Device cache: the inverse, assembling a batch column from the cache by sample index.
extern "C" __global__ void gather_rows(
    const unsigned char* __restrict__ cache, unsigned char* __restrict__ batch,
    const unsigned long long* __restrict__ idx, int rows, long long row_bytes)
{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < rows * row_bytes) {
        long long r = i / row_bytes, o = i % row_bytes;
        batch[i] = cache[idx[r] * row_bytes + o];
    }
}
