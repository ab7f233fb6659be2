// capture_guest.cpp: drives ggml's C guest (libggml-virtgpu.so) through every APIR command so
// that a recording host (scripts/make-conformance-vectors.py) captures the bytes the C sends.
//
// Every command here is encoded by the C: the guest's own apir_* functions (virtgpu-forward-*.cpp)
// where it has one, otherwise its remote_call_prepare + the apir_cs.h encode helpers (the two
// functions the C guest no longer calls, and the deliberately wrong commands that draw error
// replies). Before each command it prints "STEP <name>" on stdout, so the recorder can name the
// commands it captured, in order; values the recorder cannot see on the wire (the reply the C
// decoded) follow as "GOT <name> <value>".
//
// Built by the generator against the C reference's headers (the C guest's internal headers
// included), run with the apir DRM shim preloaded. APIR_MINOR_0_1 selects the ggml 0.10 guest's
// 4-flag apir_device_get_props. Built against the C guest of patches/ggml-virtgpu-extensions.patch
// (its apir_backend.h defines APIR_COMMAND_TYPE_EXT_QUERY), "ext" runs the extension session
// instead (run_ext, at the end), and "devices" the device selection of a two-device host
// (run_devices).
#include "virtgpu-forward-impl.h"

#include <cinttypes>
#include <cstdio>
#include <cstddef>
#include <cstring>

#include "ggml.h"

static void step(const char * name) {
    printf("STEP %s\n", name);
    fflush(stdout);
}

// A ggml buffer object whose context is the C guest's own buffer context, so the C's tensor
// serializer (apir_serialize_tensor) finds the host handle and base where it looks for them.
struct remote_buffer {
    ggml_backend_remoting_buffer_context ctx;
    ggml_backend_buffer                  buf;
};

static void remote_buffer_init(remote_buffer * rb, virtgpu * gpu, apir_buffer_context_t apir, void * base,
                               size_t size) {
    memset(&rb->buf, 0, sizeof rb->buf);
    rb->ctx.apir_context = apir;
    rb->ctx.gpu          = gpu;
    rb->ctx.base         = base;
    rb->ctx.is_from_ptr  = false;
    rb->buf.context      = &rb->ctx;
    rb->buf.size         = size;
}

static void place(ggml_tensor * t, remote_buffer * rb, size_t offset) {
    t->buffer = &rb->buf;
    t->data   = (char *) rb->ctx.base + offset;
}

static void fill(float * v, int n, float seed) {
    for (int i = 0; i < n; i++) {
        v[i] = (float) (((int) (seed * 7) + i * 5) % 17 - 8) / 4.0f;
    }
}

// One raw Forward call encoded with the C helpers; returns the return code as the guest got it.
typedef void (*encode_fn)(apir_encoder * enc, const void * arg);

static uint32_t raw_forward(virtgpu * gpu, int32_t function, encode_fn encode, const void * arg) {
    apir_encoder * enc = remote_call_prepare(gpu, APIR_COMMAND_TYPE_FORWARD, function);
    apir_decoder * dec = NULL;
    if (encode) {
        encode(enc, arg);
    }
    uint32_t ret = remote_call(gpu, enc, &dec, 5000, NULL);
    remote_call_finish(gpu, enc, dec);
    return ret;
}

static uint32_t raw_command(virtgpu * gpu, ApirCommandType type, encode_fn encode, const void * arg) {
    apir_encoder * enc = remote_call_prepare(gpu, type, 0);
    apir_decoder * dec = NULL;
    if (encode) {
        encode(enc, arg);
    }
    uint32_t ret = remote_call(gpu, enc, &dec, 5000, NULL);
    remote_call_finish(gpu, enc, dec);
    return ret;
}

static void enc_buft(apir_encoder * enc, const void * arg) {
    apir_encode_apir_buffer_type_host_handle(enc, *(const apir_buffer_type_host_handle_t *) arg);
}

static void enc_buffer(apir_encoder * enc, const void * arg) {
    apir_encode_apir_buffer_host_handle_t(enc, (const apir_buffer_host_handle_t *) arg);
}

struct set_tensor_args {
    apir_buffer_host_handle_t buffer;
    const ggml_tensor *       tensor;
    uint32_t                  res_id;
    size_t                    offset, size;
};

static void enc_set_tensor(apir_encoder * enc, const void * arg) {
    const set_tensor_args * a = (const set_tensor_args *) arg;
    apir_encode_apir_buffer_host_handle_t(enc, &a->buffer);
    apir_encode_ggml_tensor(enc, a->tensor);
    apir_encode_virtgpu_shmem_res_id(enc, a->res_id);
    apir_encode_size_t(enc, &a->offset);
    apir_encode_size_t(enc, &a->size);
}

struct graph_args {
    uint32_t res_id;
    size_t   size;
};

static void enc_graph(apir_encoder * enc, const void * arg) {
    const graph_args * a = (const graph_args *) arg;
    apir_encode_virtgpu_shmem_res_id(enc, a->res_id);
    apir_encode_size_t(enc, &a->size);
}

static void enc_version(apir_encoder * enc, const void * arg) {
    const uint32_t * v = (const uint32_t *) arg;
    apir_encode_uint32_t(enc, &v[0]);
    apir_encode_uint32_t(enc, &v[1]);
}

static ggml_cgraph * graph_of(ggml_context * ctx, ggml_tensor * out) {
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    return gf;
}

// The layouts the C compiler gave both records: "LAYOUT <struct> <field> <offset> <size>".
#define LAYOUT(S, F) printf("LAYOUT %s %s %zu %zu\n", #S, #F, offsetof(S, F), sizeof(((S *) 0)->F))

static void print_layouts(void) {
    LAYOUT(apir_rpc_tensor, id);
    LAYOUT(apir_rpc_tensor, type);
    LAYOUT(apir_rpc_tensor, buffer);
    LAYOUT(apir_rpc_tensor, ne);
    LAYOUT(apir_rpc_tensor, nb);
    LAYOUT(apir_rpc_tensor, op);
    LAYOUT(apir_rpc_tensor, op_params);
    LAYOUT(apir_rpc_tensor, flags);
    LAYOUT(apir_rpc_tensor, src);
    LAYOUT(apir_rpc_tensor, view_src);
    LAYOUT(apir_rpc_tensor, view_offs);
    LAYOUT(apir_rpc_tensor, data);
    LAYOUT(apir_rpc_tensor, name);
    LAYOUT(apir_rpc_tensor, padding);
    printf("SIZEOF apir_rpc_tensor %zu\n", sizeof(apir_rpc_tensor));
    LAYOUT(ggml_tensor, type);
    LAYOUT(ggml_tensor, buffer);
    LAYOUT(ggml_tensor, ne);
    LAYOUT(ggml_tensor, nb);
    LAYOUT(ggml_tensor, op);
    LAYOUT(ggml_tensor, op_params);
    LAYOUT(ggml_tensor, flags);
    LAYOUT(ggml_tensor, src);
    LAYOUT(ggml_tensor, view_src);
    LAYOUT(ggml_tensor, view_offs);
    LAYOUT(ggml_tensor, data);
    LAYOUT(ggml_tensor, name);
    LAYOUT(ggml_tensor, extra);
    LAYOUT(ggml_tensor, padding);
    printf("SIZEOF ggml_tensor %zu\n", sizeof(ggml_tensor));
    printf("CONST GGML_TENSOR_FLAG_INPUT %d\nCONST GGML_TENSOR_FLAG_OUTPUT %d\n", GGML_TENSOR_FLAG_INPUT,
           GGML_TENSOR_FLAG_OUTPUT);
    printf("CONST GGML_TENSOR_FLAG_COMPUTE %d\n", GGML_TENSOR_FLAG_COMPUTE);
    printf("CONST APIR_PROTOCOL_MAJOR %d\nCONST APIR_PROTOCOL_MINOR %d\n", APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR);
    printf("CONST GGML_OP_ADD %d\nCONST GGML_OP_MUL %d\nCONST GGML_OP_MUL_MAT %d\nCONST GGML_OP_SCALE %d\n"
           "CONST GGML_OP_VIEW %d\nCONST GGML_OP_NONE %d\nCONST GGML_OP_COUNT %d\n",
           GGML_OP_ADD, GGML_OP_MUL, GGML_OP_MUL_MAT, GGML_OP_SCALE, GGML_OP_VIEW, GGML_OP_NONE, GGML_OP_COUNT);
    printf("CONST GGML_TYPE_F32 %d\nCONST GGML_TYPE_Q4_0 %d\n", GGML_TYPE_F32, GGML_TYPE_Q4_0);
}

#ifdef APIR_COMMAND_TYPE_EXT_QUERY
static int run_ext(void);
#endif
#ifdef APIR_COMMAND_TYPE_DEVICE_SELECT
static int run_devices(void);
#endif

int main(int argc, char ** argv) {
    print_layouts();
#ifdef APIR_COMMAND_TYPE_EXT_QUERY
    if (argc > 1 && strcmp(argv[1], "ext") == 0) {
        return run_ext();
    }
#endif
#ifdef APIR_COMMAND_TYPE_DEVICE_SELECT
    if (argc > 1 && strcmp(argv[1], "devices") == 0) {
        return run_devices();
    }
#endif
    // "short": only HandShake, LoadLibrary and one query (for the Venus capset session; the
    // capset is the environment's choice, GGML_REMOTING_USE_APIR_CAPSET).
    const bool short_session = argc > 1 && strcmp(argv[1], "short") == 0;

    step("handshake");  // create_virtgpu sends both, in this order
    step("load_library");
    virtgpu * gpu = create_virtgpu();
    if (!gpu) {
        return 1;
    }
    step("device_get_count");
    printf("GOT device_count %d\n", apir_device_get_count(gpu));
    if (short_session) {
        return 0;
    }

    step("device_get_device_count");  // no C guest function: remote_call + no arguments
    raw_forward(gpu, APIR_COMMAND_TYPE_DEVICE_GET_DEVICE_COUNT, NULL, NULL);
    step("device_get_name");
    free(apir_device_get_name(gpu));
    step("device_get_description");
    free(apir_device_get_description(gpu));
    step("device_get_type");
    apir_device_get_type(gpu);
    size_t mem_free, mem_total;
    step("device_get_memory");
    apir_device_get_memory(gpu, &mem_free, &mem_total);
    step("device_get_buffer_type");
    apir_buffer_type_host_handle_t buft = apir_device_get_buffer_type(gpu);
    bool async, host_buffer, from_ptr, events;
    step("device_get_props");
#ifdef APIR_MINOR_0_1
    apir_device_get_props(gpu, &async, &host_buffer, &from_ptr, &events);
#else
    bool mmap_support;
    apir_device_get_props(gpu, &async, &host_buffer, &from_ptr, &events, &mmap_support);
#endif

    step("buffer_type_get_name");
    free(apir_buffer_type_get_name(gpu, buft));
    step("buffer_type_get_alignment");
    apir_buffer_type_get_alignment(gpu, buft);
    step("buffer_type_get_max_size");
    apir_buffer_type_get_max_size(gpu, buft);
    step("buffer_type_is_host");  // deprecated in the C guest: remote_call + the C helper
    raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_TYPE_IS_HOST, enc_buft, &buft);

    // two buffers from the buffer type, one shared from a guest blob
    step("buffer_type_alloc_buffer.a");
    apir_buffer_context_t apir_a = apir_buffer_type_alloc_buffer(gpu, buft, 4096);
    step("buffer_type_alloc_buffer.b");
    apir_buffer_context_t apir_b = apir_buffer_type_alloc_buffer(gpu, buft, 1024);
    step("buffer_get_base.a");
    void * base_a = apir_buffer_get_base(gpu, &apir_a);
    step("buffer_get_base.b");
    void * base_b = apir_buffer_get_base(gpu, &apir_b);
    step("device_buffer_from_ptr");
    apir_buffer_context_t apir_p = apir_device_buffer_from_ptr(gpu, 8192, 8192);
    step("buffer_get_base.p");
    void * base_p = apir_buffer_get_base(gpu, &apir_p);
    (void) base_p;

    static remote_buffer A, B;
    remote_buffer_init(&A, gpu, apir_a, base_a, 4096);
    remote_buffer_init(&B, gpu, apir_b, base_b, 1024);

    ggml_init_params params = { 16 * 1024 * 1024, NULL, true };
    ggml_context *   ctx    = ggml_init(params);

    // inputs: x (4x3 f32) and y (4x3 f32) in buffer a, w (4x2 f32) in buffer b
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_tensor * y = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 2);
    ggml_set_name(x, "x");
    ggml_set_name(y, "y");
    ggml_set_name(w, "w");
    place(x, &A, 0);
    place(y, &A, 64);
    place(w, &B, 0);

    float xv[12], yv[12], wv[8];
    fill(xv, 12, 1);
    fill(yv, 12, 2);
    fill(wv, 8, 3);

    step("buffer_set_tensor.x");
    apir_buffer_set_tensor(gpu, &apir_a, x, xv, 0, sizeof xv);
    step("buffer_set_tensor.y");
    apir_buffer_set_tensor(gpu, &apir_a, y, yv, 0, sizeof yv);
    step("buffer_set_tensor.w_row1");  // a partial write: the second row only
    apir_buffer_set_tensor(gpu, &apir_b, w, wv + 4, 16, 16);
    step("buffer_set_tensor.w_row0");
    apir_buffer_set_tensor(gpu, &apir_b, w, wv, 0, 16);
    float back[12];
    step("buffer_get_tensor.x");
    apir_buffer_get_tensor(gpu, &apir_a, x, back, 0, sizeof back);
    printf("GOT get_tensor_equal %d\n", memcmp(back, xv, sizeof xv) == 0);

    // inline tensors (device_supports_op, buffer_type_get_alloc_size): the raw ggml_tensor
    ggml_tensor * x_free = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);  // no buffer
    ggml_tensor * y_free = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_set_name(x_free, "xf");
    ggml_set_name(y_free, "yf");
    ggml_tensor * sum_free = ggml_add(ctx, x_free, y_free);
    ggml_tensor * mm_free  = ggml_mul_mat(ctx, x_free, y_free);
    ggml_tensor * view_free = ggml_view_1d(ctx, x_free, 4, 16);  // view_src, no srcs beyond it
    step("device_supports_op.add");
    printf("GOT supports_add %d\n", apir_device_supports_op(gpu, sum_free));
    step("device_supports_op.mul_mat");
    printf("GOT supports_mul_mat %d\n", apir_device_supports_op(gpu, mm_free));
    step("device_supports_op.view");
    printf("GOT supports_view %d\n", apir_device_supports_op(gpu, view_free));
    step("buffer_type_get_alloc_size.leaf");
    printf("GOT alloc_size_leaf %zu\n", apir_buffer_type_get_alloc_size(gpu, buft, x_free));
    // a tensor with a buffer: the C helper writes the address of its local variable, not the
    // handle (docs/protocol.md, "The inline-tensor quirk")
    ggml_tensor * q = ggml_new_tensor_1d(ctx, GGML_TYPE_Q4_0, 64);
    place(q, &A, 1024);
    step("buffer_type_get_alloc_size.q4_0_with_buffer");
    printf("GOT alloc_size_q4_0 %zu\n", apir_buffer_type_get_alloc_size(gpu, buft, q));

    // graphs
    // 1: one node, two leaves, one buffer
    ggml_tensor * s = ggml_add(ctx, x, y);
    ggml_set_name(s, "s");
    place(s, &A, 128);
    step("backend_graph_compute.add");
    printf("GOT status_add %d\n", (int) apir_backend_graph_compute(gpu, graph_of(ctx, s)));
    float out[12];
    step("buffer_get_tensor.s");
    apir_buffer_get_tensor(gpu, &apir_a, s, out, 0, sizeof out);

    // 2: views: rows 1-2 of x times rows 0-1 of y, elementwise, into buffer b
    ggml_tensor * xv12 = ggml_view_2d(ctx, x, 4, 2, x->nb[1], 1 * x->nb[1]);
    ggml_tensor * yv01 = ggml_view_2d(ctx, y, 4, 2, y->nb[1], 0);
    xv12->buffer = x->buffer;
    yv01->buffer = y->buffer;
    ggml_set_name(xv12, "x[1:3]");
    ggml_set_name(yv01, "y[0:2]");
    ggml_tensor * m = ggml_mul(ctx, xv12, yv01);
    ggml_set_name(m, "m");
    place(m, &B, 64);
    step("backend_graph_compute.views");
    printf("GOT status_views %d\n", (int) apir_backend_graph_compute(gpu, graph_of(ctx, m)));
    step("buffer_get_tensor.m");
    apir_buffer_get_tensor(gpu, &apir_b, m, out, 0, 32);

    // 3: several nodes over two buffers: mm = mul_mat(w, x) (2x3), sc = scale(mm, 0.5),
    //    r = sc + mm (a tensor used by two nodes: emitted once)
    ggml_tensor * mm = ggml_mul_mat(ctx, w, x);
    ggml_set_name(mm, "mm");
    place(mm, &B, 128);
    ggml_tensor * sc = ggml_scale(ctx, mm, 0.5f);
    ggml_set_name(sc, "sc");
    place(sc, &A, 256);
    ggml_tensor * r = ggml_add(ctx, sc, mm);
    ggml_set_name(r, "r");
    place(r, &B, 192);
    step("backend_graph_compute.chain");
    printf("GOT status_chain %d\n", (int) apir_backend_graph_compute(gpu, graph_of(ctx, r)));
    step("buffer_get_tensor.r");
    apir_buffer_get_tensor(gpu, &apir_b, r, out, 0, 24);

    // copy and clear
    ggml_tensor * x2 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_set_name(x2, "x2");
    place(x2, &B, 512);
    step("buffer_cpy_tensor");
    printf("GOT cpy %d\n", apir_buffer_cpy_tensor(gpu, &apir_b, x, x2));
    step("buffer_get_tensor.x2");
    apir_buffer_get_tensor(gpu, &apir_b, x2, out, 0, sizeof out);
    step("buffer_clear");
    apir_buffer_clear(gpu, &apir_b, 0x5a);
    step("buffer_get_tensor.w_cleared");
    apir_buffer_get_tensor(gpu, &apir_b, w, out, 0, 32);

    // error replies: commands the C host refuses (encoded with the C helpers)
    apir_buffer_host_handle_t unknown = 0x7e57ab1e0000ull;
    step("error.function_id_out_of_range");
    printf("GOT rc %u\n", raw_forward(gpu, APIR_BACKEND_DISPATCH_TABLE_COUNT, NULL, NULL));
    step("error.buffer_get_base.unknown_buffer");
    printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_GET_BASE, enc_buffer, &unknown));
    step("error.buffer_get_base.truncated");
    printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_GET_BASE, NULL, NULL));
    step("error.buffer_clear.unknown_buffer");
    {
        struct clear_args { apir_buffer_host_handle_t h; uint8_t v; } ca = { unknown, 1 };
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_CLEAR,
                                          [](apir_encoder * enc, const void * arg) {
                                              const clear_args * c = (const clear_args *) arg;
                                              apir_encode_apir_buffer_host_handle_t(enc, &c->h);
                                              apir_encode_uint8_t(enc, &c->v);
                                          }, &ca));
    }
    step("error.buffer_set_tensor.unknown_res_id");
    {
        set_tensor_args sa = { apir_a.host_handle, x, 0x7fffffffu, 0, 16 };
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_SET_TENSOR, enc_set_tensor, &sa));
    }
    step("error.backend_graph_compute.zero_size");
    {
        graph_args ga = { gpu->data_shmem.res_id, 0 };
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BACKEND_GRAPH_COMPUTE, enc_graph, &ga));
    }
    step("error.buffer_free_buffer.unknown_buffer");
    printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_BUFFER_FREE_BUFFER, enc_buffer, &unknown));
    // component-level (virglrenderer's part; no C build of it here: apir's component answers)
    step("component.load_library.again");
    printf("GOT rc %u\n", raw_command(gpu, APIR_COMMAND_TYPE_LOADLIBRARY, NULL, NULL));
    step("component.handshake.no_version");
    printf("GOT rc %u\n", raw_command(gpu, APIR_COMMAND_TYPE_HANDSHAKE, NULL, NULL));
    step("component.handshake.unknown_version");
    {
        uint32_t v[2] = { 0, 99 };
        printf("GOT rc %u\n", raw_command(gpu, APIR_COMMAND_TYPE_HANDSHAKE, enc_version, v));
    }
    step("component.handshake.again");  // the guest's own version again: later replies follow it
    {
        uint32_t v[2] = { APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR };
        printf("GOT rc %u\n", raw_command(gpu, APIR_COMMAND_TYPE_HANDSHAKE, enc_version, v));
    }

    step("buffer_free_buffer.a");
    apir_buffer_free_buffer(gpu, &apir_a);
    step("buffer_free_buffer.b");
    apir_buffer_free_buffer(gpu, &apir_b);
    step("buffer_free_buffer.p");
    apir_buffer_free_buffer(gpu, &apir_p);
    ggml_free(ctx);
    printf("DONE\n");
    return 0;
}

#ifdef APIR_COMMAND_TYPE_EXT_QUERY
static void enc_u32(apir_encoder * enc, const void * arg) {
    apir_encode_uint32_t(enc, (const uint32_t *) arg);
}

static void enc_u64(apir_encoder * enc, const void * arg) {
    apir_encode_uint64_t(enc, (const uint64_t *) arg);
}

// ggml's set_tensor as the patched guest does it (ggml-backend-buffer.cpp): posted
// buffer_set_tensor_at with ASYNC agreed, else buffer_set_tensor, waited. The step is named
// after what is sent: "buffer_set_tensor_at.<what>" or "buffer_set_tensor.<what>".
static void set_tensor(virtgpu * gpu, apir_buffer_context_t * apir, ggml_tensor * t, const void * data,
                       size_t size, const char * what) {
    char name[64];
#ifdef APIR_COMMAND_TYPE_BUFFER_SET_TENSOR_AT
    const bool posting = gpu->extensions & APIR_EXTENSION_ASYNC;
#else
    const bool posting = false;
#endif
    snprintf(name, sizeof name, "%s.%s", posting ? "buffer_set_tensor_at" : "buffer_set_tensor", what);
    step(name);
#ifdef APIR_COMMAND_TYPE_BUFFER_SET_TENSOR_AT
    if (apir_buffer_post_set_tensor(gpu, apir, t, data, 0, size)) {
        return;
    }
#endif
    apir_buffer_set_tensor(gpu, apir, t, data, 0, size);
}

// The extension session of the patched C guest: the same program against a host with the
// extensions (graph replay agreed: graph_compute_keep, graph_recompute; ASYNC: sets and clears
// posted, gathered into the EXECBUFFER of the next waited command, synchronize, and events)
// and against one without (ext_query answered INDEX_INVALID: the guest then sends APIR 0.2 only). Graphs
// get a uid as ggml's scheduler gives them (ggml_graph_next_uid), which the guest takes as the
// graph's id.
// Steps for further extensions of the patch go in here, each under the #ifdef of the macro the
// patch defines for it, so that this file still builds against an older patch.
static int run_ext(void) {
    printf("CONST APIR_COMMAND_TYPE_EXT_QUERY %d\nCONST APIR_COMMAND_TYPE_GRAPH_COMPUTE_KEEP %d\n"
           "CONST APIR_COMMAND_TYPE_GRAPH_RECOMPUTE %d\nCONST APIR_EXTENSION_GRAPH_REPLAY %u\n"
           "CONST APIR_BACKEND_GRAPH_UNKNOWN %d\n",
           APIR_COMMAND_TYPE_EXT_QUERY, APIR_COMMAND_TYPE_GRAPH_COMPUTE_KEEP, APIR_COMMAND_TYPE_GRAPH_RECOMPUTE,
           APIR_EXTENSION_GRAPH_REPLAY, APIR_BACKEND_GRAPH_UNKNOWN);
#ifdef APIR_COMMAND_TYPE_SYNCHRONIZE
    printf("CONST APIR_COMMAND_TYPE_SYNCHRONIZE %d\nCONST APIR_COMMAND_TYPE_BUFFER_SET_TENSOR_AT %d\n"
           "CONST APIR_EXTENSION_ASYNC %u\nCONST APIR_FORWARD_POSTED %u\n",
           APIR_COMMAND_TYPE_SYNCHRONIZE, APIR_COMMAND_TYPE_BUFFER_SET_TENSOR_AT, APIR_EXTENSION_ASYNC,
           APIR_FORWARD_POSTED);
#endif
#ifdef APIR_COMMAND_TYPE_EVENT_NEW
    printf("CONST APIR_COMMAND_TYPE_EVENT_NEW %d\nCONST APIR_COMMAND_TYPE_EVENT_FREE %d\n", APIR_COMMAND_TYPE_EVENT_NEW,
           APIR_COMMAND_TYPE_EVENT_FREE);
#endif
    step("handshake");  // create_virtgpu sends all three, in this order
    step("load_library");
    step("ext_query");
    virtgpu * gpu = create_virtgpu();
    if (!gpu) {
        return 1;
    }
    printf("GOT extensions %u\n", gpu->extensions);
    const bool replay = gpu->extensions & APIR_EXTENSION_GRAPH_REPLAY;

    step("device_get_buffer_type");
    apir_buffer_type_host_handle_t buft = apir_device_get_buffer_type(gpu);
    step("buffer_type_alloc_buffer.a");
    apir_buffer_context_t apir_a = apir_buffer_type_alloc_buffer(gpu, buft, 4096);
    step("buffer_get_base.a");
    void * base_a = apir_buffer_get_base(gpu, &apir_a);
    static remote_buffer A;
    remote_buffer_init(&A, gpu, apir_a, base_a, 4096);

    ggml_init_params params = { 16 * 1024 * 1024, NULL, true };
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    x      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_tensor *    y      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 3);
    ggml_set_name(x, "x");
    ggml_set_name(y, "y");
    place(x, &A, 0);
    place(y, &A, 64);
    ggml_tensor * s = ggml_add(ctx, x, y);
    ggml_set_name(s, "s");
    place(s, &A, 128);
    ggml_tensor * m = ggml_mul(ctx, x, y);
    ggml_set_name(m, "m");
    place(m, &A, 192);
    ggml_cgraph * gf_add = graph_of(ctx, s);
    gf_add->uid          = ggml_graph_next_uid();
    ggml_cgraph * gf_mul = graph_of(ctx, m);
    gf_mul->uid          = ggml_graph_next_uid();

    float xv[12], yv[12], out[12];
    fill(xv, 12, 1);
    fill(yv, 12, 2);
    // posted with ASYNC: both go in the EXECBUFFER of the graph after them
    set_tensor(gpu, &apir_a, x, xv, sizeof xv, "x");
    set_tensor(gpu, &apir_a, y, yv, sizeof yv, "y");

    // a new graph; the same graph again (new input first); another graph
    step(replay ? "graph_compute_keep.add" : "backend_graph_compute.add");
    printf("GOT status_add %d\n", (int) apir_backend_graph_compute(gpu, gf_add));
    step("buffer_get_tensor.s");
    apir_buffer_get_tensor(gpu, &apir_a, s, out, 0, sizeof out);
    fill(xv, 12, 3);
    set_tensor(gpu, &apir_a, x, xv, sizeof xv, "x_again");
    step(replay ? "graph_recompute.add" : "backend_graph_compute.add_again");
    printf("GOT status_add_again %d\n", (int) apir_backend_graph_compute(gpu, gf_add));
    step("buffer_get_tensor.s_again");
    apir_buffer_get_tensor(gpu, &apir_a, s, out, 0, sizeof out);
    step(replay ? "graph_compute_keep.mul" : "backend_graph_compute.mul");
    printf("GOT status_mul %d\n", (int) apir_backend_graph_compute(gpu, gf_mul));
    step("buffer_get_tensor.m");
    apir_buffer_get_tensor(gpu, &apir_a, m, out, 0, sizeof out);

    if (replay) {
        // the host forgets its kept graphs when an ext_query drops GRAPH_REPLAY; the guest,
        // not told, asks for the add graph by id, is answered GRAPH_UNKNOWN and sends it again
        uint32_t none = 0, bits = gpu->extensions;
        step("forget.ext_query.none");
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_EXT_QUERY, enc_u32, &none));
        step("forget.ext_query.again");
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_EXT_QUERY, enc_u32, &bits));
        step("graph_recompute.add.unknown");  // one call, two commands
        step("graph_compute_keep.add.resend");
        printf("GOT status_add_resend %d\n", (int) apir_backend_graph_compute(gpu, gf_add));
        step("buffer_get_tensor.s_resend");
        apir_buffer_get_tensor(gpu, &apir_a, s, out, 0, sizeof out);
    }

#ifdef APIR_COMMAND_TYPE_SYNCHRONIZE
    if (gpu->extensions & APIR_EXTENSION_ASYNC) {
        // a posted clear and a posted set in one EXECBUFFER with synchronize (nothing failed)
        step("buffer_clear.a");
        apir_buffer_post_clear(gpu, &apir_a, 0x11);
        set_tensor(gpu, &apir_a, x, xv, sizeof xv, "x_after_clear");
        step("synchronize");
        apir_backend_synchronize(gpu);
        step("buffer_get_tensor.s_cleared");
        apir_buffer_get_tensor(gpu, &apir_a, s, out, 0, sizeof out);
        step("buffer_get_tensor.x_after_clear");
        apir_buffer_get_tensor(gpu, &apir_a, x, out, 0, sizeof out);
        // a posted clear of a buffer the host never gave, then synchronize reporting it (the C
        // guest's apir_backend_synchronize sends these bytes, then aborts on the failure)
        apir_buffer_context_t unknown = apir_a;
        unknown.host_handle           = 0x7e57ab1e0000ull;
        step("error.buffer_clear.posted_unknown_buffer");
        apir_buffer_post_clear(gpu, &unknown, 1);
        step("error.synchronize.pending_error");
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_SYNCHRONIZE, NULL, NULL));
    }
#endif
#ifdef APIR_COMMAND_TYPE_EVENT_NEW
    if (gpu->extensions & APIR_EXTENSION_ASYNC) {
        // an event's life as ggml's scheduler leads it (all waited for), then a record of the
        // freed event: refused, the C's apir_event_record would abort there
        step("event_new");
        uint64_t event = apir_event_new(gpu);
        printf("GOT event %" PRIu64 "\n", event);
        step("event_record");
        apir_event_record(gpu, event);
        step("event_wait");
        apir_event_wait(gpu, event);
        step("event_synchronize");
        apir_event_synchronize(gpu, event);
        step("event_free");
        apir_event_free(gpu, event);
        step("error.event_record.freed_event");
        printf("GOT rc %u\n", raw_forward(gpu, APIR_COMMAND_TYPE_EVENT_RECORD, enc_u64, &event));
    }
#endif

    step("buffer_free_buffer.a");
    apir_buffer_free_buffer(gpu, &apir_a);
    ggml_free(ctx);
    printf("DONE\n");
    return 0;
}
#endif

#ifdef APIR_COMMAND_TYPE_DEVICE_SELECT
// Device selection against a host with two devices: the device functions of host device 1,
// then of device 0, each under the guest's device lock (apir_device_lock sends device_select
// when the selection changes, as the patched guest's ggml devices do); a buffer of each
// device's buffer type (buffer-type functions route by their handle: no device_select).
static int run_devices(void) {
    printf("CONST APIR_COMMAND_TYPE_DEVICE_SELECT %d\nCONST APIR_EXTENSION_DEVICES %u\n",
           APIR_COMMAND_TYPE_DEVICE_SELECT, APIR_EXTENSION_DEVICES);
    step("handshake");
    step("load_library");
    step("ext_query");
    virtgpu * gpu = create_virtgpu();
    if (!gpu) {
        return 1;
    }
    printf("GOT extensions %u\nGOT devices %u\n", gpu->extensions, gpu->ext_device_count);

    apir_buffer_type_host_handle_t buft[2];
    apir_buffer_context_t          buffer[2];
    for (int device = 1; device >= 0; device--) {
        char name[64];
        snprintf(name, sizeof name, "device_select.%d", device);
        step(name);
        snprintf(name, sizeof name, "device_get_name.%d", device);
        step(name);
        apir_device_lock(gpu, device);
        free(apir_device_get_name(gpu));
        snprintf(name, sizeof name, "device_get_buffer_type.%d", device);
        step(name);  // the same device again: no device_select
        buft[device] = apir_device_get_buffer_type(gpu);
        apir_device_unlock(gpu);
        snprintf(name, sizeof name, "buffer_type_alloc_buffer.%d", device);
        step(name);
        buffer[device] = apir_buffer_type_alloc_buffer(gpu, buft[device], 4096);
    }
    step("buffer_free_buffer.1");
    apir_buffer_free_buffer(gpu, &buffer[1]);
    step("buffer_free_buffer.0");
    apir_buffer_free_buffer(gpu, &buffer[0]);
    printf("DONE\n");
    return 0;
}
#endif
