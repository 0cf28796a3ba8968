/* Paged decode attention for CPUs: one query token per request, keys and values read in
 * place from the paged KV cache (no gather, no padding).
 *
 * Cache layout per layer (see tokenos/layers/attention.py): page b starts at element
 * b * page_stride; its K rows are [block_size, num_kv_heads, head_size], its V rows follow
 * at + block_size * num_kv_heads * head_size. Work is split over (request, kv head) pairs;
 * each pair scores all query heads of its group against its keys in one pass (two-pass
 * softmax: scores, then max/exp/sum, then the weighted sum of values). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)h) << 16;
    return x.f;
}

#define DEFINE_DECODE(NAME, T, LOAD)                                                            \
void NAME(const float *q, const T *cache, int64_t page_stride, int block_size,                 \
          const int32_t *block_table, int max_blocks, const int32_t *seq_lens, int num_reqs,   \
          int num_heads, int num_kv_heads, int head_size, float scale, int window,             \
          float *out) {                                                                         \
    const int group = num_heads / num_kv_heads;                                                 \
    const int64_t row = (int64_t)num_kv_heads * head_size;                                      \
    const int64_t v_offset = (int64_t)block_size * row;                                         \
    _Pragma("omp parallel")                                                                     \
    {                                                                                           \
        int max_len = 0;                                                                        \
        for (int r = 0; r < num_reqs; r++) if (seq_lens[r] > max_len) max_len = seq_lens[r];   \
        float *scores = (float *)malloc(sizeof(float) * (size_t)group * (max_len + 1));        \
        float *acc = (float *)malloc(sizeof(float) * (size_t)group * head_size);               \
        float *kbuf = (float *)malloc(sizeof(float) * (size_t)head_size);                      \
        _Pragma("omp for schedule(dynamic, 1) collapse(2)")                                     \
        for (int r = 0; r < num_reqs; r++) {                                                    \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                         \
                const int len = seq_lens[r];                                                    \
                const int start = (window > 0 && len > window) ? len - window : 0;              \
                const int n = len - start;                                                      \
                const int32_t *blocks = block_table + (int64_t)r * max_blocks;                  \
                const float *qh = q + ((int64_t)r * num_heads + (int64_t)kh * group) * head_size; \
                for (int i = 0; i < n; i++) {                                                   \
                    const int pos = start + i;                                                  \
                    const T *k = cache + (int64_t)blocks[pos / block_size] * page_stride        \
                                 + (int64_t)(pos % block_size) * row + (int64_t)kh * head_size; \
                    for (int d = 0; d < head_size; d++) kbuf[d] = LOAD(k[d]);                   \
                    for (int g = 0; g < group; g++) {                                           \
                        const float *qg = qh + (int64_t)g * head_size;                          \
                        float s = 0.f;                                                          \
                        for (int d = 0; d < head_size; d++) s += qg[d] * kbuf[d];               \
                        scores[(int64_t)g * n + i] = s * scale;                                 \
                    }                                                                           \
                }                                                                               \
                for (int g = 0; g < group; g++) {                                               \
                    float *sg = scores + (int64_t)g * n;                                        \
                    float m = -INFINITY;                                                        \
                    for (int i = 0; i < n; i++) if (sg[i] > m) m = sg[i];                       \
                    float sum = 0.f;                                                            \
                    for (int i = 0; i < n; i++) { sg[i] = expf(sg[i] - m); sum += sg[i]; }       \
                    const float inv = 1.f / sum;                                                \
                    for (int i = 0; i < n; i++) sg[i] *= inv;                                   \
                }                                                                               \
                memset(acc, 0, sizeof(float) * (size_t)group * head_size);                     \
                for (int i = 0; i < n; i++) {                                                   \
                    const int pos = start + i;                                                  \
                    const T *v = cache + (int64_t)blocks[pos / block_size] * page_stride        \
                                 + v_offset + (int64_t)(pos % block_size) * row                 \
                                 + (int64_t)kh * head_size;                                     \
                    for (int d = 0; d < head_size; d++) kbuf[d] = LOAD(v[d]);                   \
                    for (int g = 0; g < group; g++) {                                           \
                        const float p = scores[(int64_t)g * n + i];                             \
                        float *ag = acc + (int64_t)g * head_size;                               \
                        for (int d = 0; d < head_size; d++) ag[d] += p * kbuf[d];               \
                    }                                                                           \
                }                                                                               \
                float *o = out + ((int64_t)r * num_heads + (int64_t)kh * group) * head_size;    \
                memcpy(o, acc, sizeof(float) * (size_t)group * head_size);                      \
            }                                                                                   \
        }                                                                                       \
        free(scores); free(acc); free(kbuf);                                                    \
    }                                                                                           \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_DECODE(paged_decode_f32, float, LOAD_F32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, LOAD_BF16)
