/*
 * virtgpu_matmul.c: a small ggml program on the ggml-virtgpu backend (the C guest), run against
 * apir's host through apir_drm_shim.so.
 *
 * It finds the virtgpu registry and device through the ggml_backend_reg / dev API, reports the
 * device, allocates a buffer on its buffer type, round-trips a tensor through set/get, then
 * computes out = mul_mat(a, b) + c on the virtgpu backend and on ggml's CPU backend from the same
 * inputs. Output is "key=value" lines, then the virtgpu and CPU results as "out_virtgpu=" /
 * "out_cpu=" lines of %a floats, for the test to compare (exactly, and against numpy).
 * Exit status: 0 when everything ran, 1 on any failure (printed as "error=...").
 *
 * usage: virtgpu_matmul [K M N]   (a: K x M, b: K x N, c and out: M x N in ggml's ne order)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define FAIL(...) do { printf("error="); printf(__VA_ARGS__); printf("\n"); return 1; } while (0)

static float value_at(int seed, int i) {
    /* small exact values (multiples of 1/8 in [-2, 2)) keep float sums order-independent */
    return (float) (((seed * 7919 + i * 104729) % 32) - 16) / 8.0f;
}

static void fill(struct ggml_tensor *t, int seed, float *host) {
    int64_t n = ggml_nelements(t);
    for (int64_t i = 0; i < n; i++)
        host[i] = value_at(seed, (int) i);
    ggml_backend_tensor_set(t, host, 0, ggml_nbytes(t));
}

/* builds and runs out = mul_mat(a, b) + c on `backend`; writes out's values to `result` */
static int run(ggml_backend_t backend, int K, int M, int N, float *result, int report) {
    struct ggml_init_params params = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
    struct ggml_tensor *b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, N);
    struct ggml_tensor *c = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, M, N);
    struct ggml_tensor *out = ggml_add(ctx, ggml_mul_mat(ctx, a, b), c);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf)
        FAIL("alloc_ctx_tensors failed on %s", ggml_backend_name(backend));
    if (report) {
        printf("buffer_name=%s\n", ggml_backend_buffer_name(buf));
        printf("buffer_size=%zu\n", ggml_backend_buffer_get_size(buf));
    }
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf))
        FAIL("gallocr_alloc_graph failed on %s", ggml_backend_name(backend));

    float *host = malloc(sizeof(float) * (size_t) (K * M + K * N + M * N));
    fill(a, 1, host);
    fill(b, 2, host);
    fill(c, 3, host);
    if (report) { /* set/get round trip of a */
        float *back = malloc(ggml_nbytes(a));
        fill(a, 1, host);
        ggml_backend_tensor_get(a, back, 0, ggml_nbytes(a));
        printf("roundtrip_equal=%d\n", memcmp(back, host, ggml_nbytes(a)) == 0);
        free(back);
    }
    enum ggml_status st = ggml_backend_graph_compute(backend, gf);
    if (report)
        printf("graph_compute_status=%d\n", (int) st);
    if (st != GGML_STATUS_SUCCESS)
        FAIL("graph compute failed on %s: %d", ggml_backend_name(backend), (int) st);
    ggml_backend_tensor_get(out, result, 0, ggml_nbytes(out));

    free(host);
    ggml_gallocr_free(galloc);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return 0;
}

int main(int argc, char **argv) {
    int K = argc > 3 ? atoi(argv[1]) : 64, M = argc > 3 ? atoi(argv[2]) : 16, N = argc > 3 ? atoi(argv[3]) : 8;

    ggml_backend_reg_t reg = ggml_backend_reg_by_name("ggml-virtgpu");
    if (!reg)
        FAIL("no ggml-virtgpu registry");
    printf("reg_name=%s\n", ggml_backend_reg_name(reg));
    printf("reg_dev_count=%zu\n", ggml_backend_reg_dev_count(reg));
    if (ggml_backend_reg_dev_count(reg) < 1)
        FAIL("the virtgpu registry has no device");
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    size_t mem_free = 0, mem_total = 0;
    ggml_backend_dev_memory(dev, &mem_free, &mem_total);
    printf("dev_name=%s\n", ggml_backend_dev_name(dev));
    printf("dev_description=%s\n", ggml_backend_dev_description(dev));
    printf("dev_type=%d\n", (int) ggml_backend_dev_type(dev));
    printf("dev_memory_total=%zu\n", mem_total);
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    printf("buft_name=%s\n", ggml_backend_buft_name(buft));
    printf("buft_alignment=%zu\n", ggml_backend_buft_get_alignment(buft));

    ggml_backend_t vbk = ggml_backend_dev_init(dev, NULL);
    if (!vbk)
        FAIL("ggml_backend_dev_init failed");
    printf("backend_name=%s\n", ggml_backend_name(vbk));
    ggml_backend_t cpu = ggml_backend_cpu_init();

    size_t n = (size_t) M * N;
    float *out_v = calloc(n, sizeof(float)), *out_c = calloc(n, sizeof(float));
    if (run(vbk, K, M, N, out_v, 1) || run(cpu, K, M, N, out_c, 0))
        return 1;
    printf("bitwise_equal=%d\n", memcmp(out_v, out_c, n * sizeof(float)) == 0);
    printf("shape=%d %d %d\n", K, M, N);
    printf("out_virtgpu=");
    for (size_t i = 0; i < n; i++)
        printf("%a%s", out_v[i], i + 1 < n ? " " : "\n");
    printf("out_cpu=");
    for (size_t i = 0; i < n; i++)
        printf("%a%s", out_c[i], i + 1 < n ? " " : "\n");

    ggml_backend_free(vbk);
    ggml_backend_free(cpu);
    free(out_v);
    free(out_c);
    return 0;
}
