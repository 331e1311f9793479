// stokehold's image augmentation on the GPU: the raw uint8 images of a batch, copied to
// the device, cropped, flipped and normalised into the batch's slot, by the per-sample
// draws the host computed (stokehold::Augment::draw). Byte for byte what the loader's
// workers write on the CPU (src/augment/host.rs): the same draws, and the same table of
// 256 floats a channel for the normalisation.
//
// A draw is packed in 32 bits: dy + 4096 in bits 0..14, dx + 4096 in bits 14..28, the
// flip in bit 28.

#define AUG_PAD 4096

extern "C" __global__ void augment_images(
    const unsigned char* __restrict__ raw,  // n images, as stored
    void* __restrict__ out,                 // n images, uint8 or float32
    const unsigned int* __restrict__ draws,  // one a sample
    const float* __restrict__ table,        // channels * 256 floats, or null
    unsigned int n, unsigned int channels, unsigned int height, unsigned int width,
    unsigned int channels_last, unsigned int fill) {
    const unsigned long long image = (unsigned long long)channels * height * width;
    const unsigned long long total = image * n;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         e < total; e += stride) {
        const unsigned long long k = e / image;
        const unsigned long long at = e - k * image;
        unsigned int c, y, x;
        if (channels_last) {
            c = (unsigned int)(at % channels);
            x = (unsigned int)(at / channels % width);
            y = (unsigned int)(at / channels / width);
        } else {
            x = (unsigned int)(at % width);
            y = (unsigned int)(at / width % height);
            c = (unsigned int)(at / width / height);
        }
        const unsigned int d = draws[k];
        const int dy = (int)(d & 0x3fff) - AUG_PAD;
        const int dx = (int)((d >> 14) & 0x3fff) - AUG_PAD;
        const int flip = (d >> 28) & 1;
        const long long sy = (long long)y + dy;
        const long long sx = (long long)(flip ? width - 1 - x : x) + dx;
        unsigned int v = fill;
        if (sy >= 0 && sy < height && sx >= 0 && sx < width) {
            const unsigned long long from = channels_last
                ? ((unsigned long long)sy * width + sx) * channels + c
                : ((unsigned long long)c * height + sy) * width + sx;
            v = raw[k * image + from];
        }
        if (table) {
            ((float*)out)[e] = table[c * 256 + v];
        } else {
            ((unsigned char*)out)[e] = (unsigned char)v;
        }
    }
}
