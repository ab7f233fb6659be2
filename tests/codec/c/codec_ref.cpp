// Test/benchmark harness around ggml-virtgpu's C codec, loaded with ctypes after libggml
// (its ggml symbols resolve against the already loaded, RTLD_GLOBAL libggml-base).
//
// - ref_encode_all / ref_decode_all: one value of every type through apir_cs.h's typed
//   helpers, in a fixed order the Python tests repeat.
// - ref_layout: sizeof/offsetof of ggml_tensor and apir_rpc_tensor.
// - ref_serialize_graph / ref_serialize_tensor: the C guest's apir_serialize_graph /
//   apir_serialize_tensor (apir_cs_ggml-rpc-front.cpp, compiled alongside). ref_new_buffer
//   fakes just enough of a remote buffer (a ggml_backend_buffer whose context is a
//   ggml_backend_remoting_buffer_context) for the C to read its host handle and base.
#include "ggml-remoting.h"
#include "backend/shared/apir_cs_rpc.h"
#include "backend/shared/apir_cs_ggml.h"

#include <cstddef>

#include <chrono>
#include <cstring>
#include <vector>

extern "C" {

void * ref_new_buffer(uint64_t host_handle, void * base) {
    auto * ctx                     = new ggml_backend_remoting_buffer_context();
    ctx->apir_context.host_handle  = host_handle;
    ctx->base                      = base;
    auto * buffer                  = new ggml_backend_buffer();
    buffer->context                = ctx;
    return buffer;
}

void ref_free_buffer(void * buffer) {
    auto * buf = (ggml_backend_buffer *) buffer;
    delete (ggml_backend_remoting_buffer_context *) buf->context;
    delete buf;
}

// Serializes into out (capacity cap); returns the graph's size (copies only if it fits).
size_t ref_serialize_graph(const ggml_cgraph * cgraph, uint8_t * out, size_t cap) {
    std::vector<uint8_t> data;
    apir_serialize_graph(cgraph, data);
    if (data.size() <= cap) {
        memcpy(out, data.data(), data.size());
    }
    return data.size();
}

// Nanoseconds per apir_serialize_graph over reps calls (fresh output vector each, as the guest).
double ref_time_serialize_graph(const ggml_cgraph * cgraph, int reps) {
    auto t0 = std::chrono::steady_clock::now();
    size_t total = 0;
    for (int i = 0; i < reps; i++) {
        std::vector<uint8_t> data;
        apir_serialize_graph(cgraph, data);
        total += data.size();
    }
    auto t1 = std::chrono::steady_clock::now();
    if (total == 0) {
        return -1.0;
    }
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / reps;
}

// --- the C host's graph decode (backend-dispatched-backend.cpp's graph_compute, front half) ----
// apir_deserialize_graph (backend/apir_cs_ggml-rpc-back.cpp) is compiled alongside with its
// ggml_init renamed to ref_tracked_ggml_init (cbuild.py), so that the harness can free the
// context it makes (the C host never does).
static ggml_context * ref_last_ctx = nullptr;

ggml_context * ref_tracked_ggml_init(ggml_init_params params) {
    ref_last_ctx = ggml_init(params);
    return ref_last_ctx;
}

// apir_track_backend_buffer: the C host only accepts tensors of buffers it allocated.
void ref_track_buffer(void * buffer) {
    apir_track_backend_buffer((ggml_backend_buffer_t) buffer);
}

void ref_untrack_buffer(void * buffer) {
    apir_untrack_backend_buffer((ggml_backend_buffer_t) buffer);
}

// Best nanoseconds over reps of what the C host does with a serialized graph before compute:
// apir_decode_ggml_cgraph over the bytes (counts, then apir_deserialize_graph: a ggml_context,
// every tensor and the graph built, nothing validated beyond ggml_nbytes inside its buffer),
// the context freed outside the timing. Returns -1 when the decode fails or n_nodes differs.
double ref_time_deserialize_graph(const uint8_t * data, size_t size, int reps) {
    double best = -1.0;
    for (int i = 0; i < reps; i++) {
        apir_decoder dec = apir_new_decoder((const char *) data, size);
        auto t0 = std::chrono::steady_clock::now();
        ggml_cgraph * graph = apir_decode_ggml_cgraph(&dec, size);
        auto t1 = std::chrono::steady_clock::now();
        bool ok = graph && !apir_decoder_get_fatal(&dec);
        uint32_t n_nodes;
        memcpy(&n_nodes, data, 4);
        ok = ok && graph->n_nodes == (int) n_nodes;
        if (ref_last_ctx) {
            ggml_free(ref_last_ctx);
            ref_last_ctx = nullptr;
        }
        if (!ok) {
            return -1.0;
        }
        double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
        if (best < 0 || ns < best) {
            best = ns;
        }
    }
    return best;
}

size_t ref_serialize_tensor(const ggml_tensor * tensor, uint8_t * out) {
    apir_rpc_tensor rec = apir_serialize_tensor(tensor);
    memcpy(out, &rec, sizeof(rec));
    return sizeof(rec);
}


// --- wire: every typed helper of apir_cs.h / apir_cs_ggml.h, in this order ---------------------

static const uint64_t U64_ARRAY[3]  = { 1, 0x8000000000000001ull, 0xFFFFFFFFFFFFFFFFull };
static const int32_t  I32_ARRAY[2]  = { -1, 7 };
static const uint32_t U32_ARRAY[3]  = { 9, 0x80000000u, 0xFFFFFFFFu };
static const size_t   SIZE_ARRAY[2] = { 5, 0x123456789ull };

// Fills apir_rpc_tensor fields with recognisable values (holes are whatever *rec held).
static void fill_rpc_tensor(apir_rpc_tensor * rec) {
    rec->id   = 0x7f0011223344ull;
    rec->type = 1;
    rec->buffer = 0xABCDEF0102030405ull;
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        rec->ne[i] = 100 + i;
        rec->nb[i] = 0xF0000000u + i;
    }
    rec->op = 7;
    for (size_t i = 0; i < GGML_MAX_OP_PARAMS / sizeof(int32_t); i++) {
        rec->op_params[i] = -(int32_t) i;
    }
    rec->flags = 0x5;
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        rec->src[i] = 0x1000 + i;
    }
    rec->view_src  = 0x2000;
    rec->view_offs = 0x3000;
    rec->data      = 0x4000;
    snprintf(rec->name, GGML_MAX_NAME, "%s", "rpc-probe");
}

size_t ref_encode_all(uint8_t * buf, size_t cap) {
    apir_encoder enc = apir_new_encoder((char *) buf, cap);
    uint8_t u8 = 0xAB;
    apir_encode_uint8_t(&enc, &u8);
    uint64_t u64 = 0x0123456789ABCDEFull;
    apir_encode_uint64_t(&enc, &u64);
    apir_encode_uint64_t_array(&enc, U64_ARRAY, 3);
    int32_t i32 = -5;
    apir_encode_int32_t(&enc, &i32);
    apir_encode_int32_t_array(&enc, I32_ARRAY, 2);
    apir_encode_array_size(&enc, 3);
    apir_encode_simple_pointer(&enc, &u8);
    apir_encode_simple_pointer(&enc, NULL);
    uint32_t u32 = 0xDEADBEEF;
    apir_encode_uint32_t(&enc, &u32);
    apir_encode_uint32_t_array(&enc, U32_ARRAY, 3);
    size_t sz = 123456789012ull;
    apir_encode_size_t(&enc, &sz);
    apir_encode_size_t_array(&enc, SIZE_ARRAY, 2);
    apir_encode_blob_array(&enc, "abcde", 5);
    apir_encode_char_array(&enc, "hello", 6);
    bool t = true, f = false;
    apir_encode_bool_t(&enc, &t);
    apir_encode_bool_t(&enc, &f);
    apir_buffer_type_host_handle_t buft = 0xFEEDFACE12345678ull;
    apir_encode_apir_buffer_type_host_handle_t(&enc, &buft);
    apir_buffer_host_handle_t bufh = 0x1122334455667788ull;
    apir_encode_apir_buffer_host_handle_t(&enc, &bufh);
    uintptr_t uptr = 0x7FFF00001234ull;
    apir_encode_uintptr_t(&enc, &uptr);
    ggml_status status = GGML_STATUS_FAILED;
    apir_encode_ggml_status(&enc, &status);
    apir_encode_virtgpu_shmem_res_id(&enc, 42);
    apir_encode_apir_buffer_type_host_handle(&enc, 0x0102030405060708ull);
    // a reply string, as device_get_name sends it: size with the NUL, then the chars
    const char * name = "virt";
    apir_encode_array_size(&enc, strlen(name) + 1);
    apir_encode_char_array(&enc, name, strlen(name) + 1);
    apir_rpc_tensor rec;
    fill_rpc_tensor(&rec);
    apir_encode_rcp_tensor(&enc, &rec);
    return (size_t) (enc.cur - enc.start);
}

static uint64_t pack8(const void * p, size_t n) {
    uint64_t v = 0;
    memcpy(&v, p, n < 8 ? n : 8);
    return v;
}

// A decoded C string as its user sees it: the bytes up to the first NUL.
static uint64_t pack_cstr(char * s, size_t n) {
    size_t len = strnlen(s, n);
    memset(s + len, 0, n - len);
    return pack8(s, n);
}

// The byte a bool was decoded into (values other than 0/1 are what the sender wrote).
static uint64_t bool_byte(const bool * b) {
    uint8_t v;
    memcpy(&v, b, 1);
    return v != 0;
}

// Decodes what ref_encode_all wrote (from buf[0:size], possibly truncated) into out[]
// (one u64 per value, array elements each their own); returns the fatal flag.
int ref_decode_all(const uint8_t * buf, size_t size, uint64_t * out) {
    apir_decoder dec = apir_new_decoder((const char *) buf, size);
    int n = 0;
    uint8_t u8;
    apir_decode_uint8_t(&dec, &u8);
    out[n++] = u8;
    uint64_t u64, u64a[3];
    apir_decode_uint64_t(&dec, &u64);
    out[n++] = u64;
    apir_decode_uint64_t_array(&dec, u64a, 3);
    for (int i = 0; i < 3; i++) out[n++] = u64a[i];
    int32_t i32, i32a[2];
    apir_decode_int32_t(&dec, &i32);
    out[n++] = (uint64_t) (int64_t) i32;
    apir_decode_int32_t_array(&dec, i32a, 2);
    for (int i = 0; i < 2; i++) out[n++] = (uint64_t) (int64_t) i32a[i];
    out[n++] = apir_decode_array_size(&dec, 3);
    out[n++] = apir_decode_simple_pointer(&dec);
    out[n++] = apir_decode_simple_pointer(&dec);
    uint32_t u32, u32a[3];
    apir_decode_uint32_t(&dec, &u32);
    out[n++] = u32;
    apir_decode_uint32_t_array(&dec, u32a, 3);
    for (int i = 0; i < 3; i++) out[n++] = u32a[i];
    size_t sz, sza[2];
    apir_decode_size_t(&dec, &sz);
    out[n++] = sz;
    apir_decode_size_t_array(&dec, sza, 2);
    for (int i = 0; i < 2; i++) out[n++] = sza[i];
    char blob[5];
    apir_decode_blob_array(&dec, blob, 5);
    out[n++] = pack8(blob, 5);
    char chars[6];
    apir_decode_char_array(&dec, chars, 6);
    out[n++] = pack_cstr(chars, 6);
    bool b1, b2;
    apir_decode_bool_t(&dec, &b1);
    apir_decode_bool_t(&dec, &b2);
    out[n++] = bool_byte(&b1);
    out[n++] = bool_byte(&b2);
    apir_buffer_type_host_handle_t buft;
    apir_decode_apir_buffer_type_host_handle_t(&dec, &buft);
    out[n++] = buft;
    apir_buffer_host_handle_t bufh;
    apir_decode_apir_buffer_host_handle_t(&dec, &bufh);
    out[n++] = bufh;
    uintptr_t uptr;
    apir_decode_uintptr_t(&dec, &uptr);
    out[n++] = uptr;
    ggml_status status;
    apir_decode_ggml_status(&dec, &status);
    out[n++] = (uint64_t) (int64_t) status;
    uint32_t res_id;
    apir_decode_virtgpu_shmem_res_id(&dec, &res_id);
    out[n++] = res_id;
    out[n++] = apir_decode_apir_buffer_type_host_handle(&dec);
    uint64_t str_size = apir_decode_array_size_unchecked(&dec);
    out[n++] = str_size;
    char str[8] = { 0 };
    if (str_size <= sizeof(str)) {
        apir_decode_char_array(&dec, str, str_size);
    }
    out[n++] = pack_cstr(str, 8);
    const apir_rpc_tensor * rec = apir_decode_apir_rpc_tensor_inplace(&dec);
    out[n++] = rec ? rec->id : 0;
    return apir_decoder_get_fatal(&dec);
}

// --- layout: sizeof / offsetof of the two records -------------------------------------------

#define OFF(s, f) (int64_t) offsetof(s, f)

// out: [sizeof, offsets of type buffer ne nb op op_params flags src view_src view_offs data
// name] for ggml_tensor, then [sizeof, offsets of id + the same + padding] for apir_rpc_tensor.
int ref_layout(int64_t * out) {
    int n = 0;
    out[n++] = sizeof(ggml_tensor);
    out[n++] = OFF(ggml_tensor, type);
    out[n++] = OFF(ggml_tensor, buffer);
    out[n++] = OFF(ggml_tensor, ne);
    out[n++] = OFF(ggml_tensor, nb);
    out[n++] = OFF(ggml_tensor, op);
    out[n++] = OFF(ggml_tensor, op_params);
    out[n++] = OFF(ggml_tensor, flags);
    out[n++] = OFF(ggml_tensor, src);
    out[n++] = OFF(ggml_tensor, view_src);
    out[n++] = OFF(ggml_tensor, view_offs);
    out[n++] = OFF(ggml_tensor, data);
    out[n++] = OFF(ggml_tensor, name);
    out[n++] = OFF(ggml_tensor, extra);
    out[n++] = sizeof(apir_rpc_tensor);
    out[n++] = OFF(apir_rpc_tensor, id);
    out[n++] = OFF(apir_rpc_tensor, type);
    out[n++] = OFF(apir_rpc_tensor, buffer);
    out[n++] = OFF(apir_rpc_tensor, ne);
    out[n++] = OFF(apir_rpc_tensor, nb);
    out[n++] = OFF(apir_rpc_tensor, op);
    out[n++] = OFF(apir_rpc_tensor, op_params);
    out[n++] = OFF(apir_rpc_tensor, flags);
    out[n++] = OFF(apir_rpc_tensor, src);
    out[n++] = OFF(apir_rpc_tensor, view_src);
    out[n++] = OFF(apir_rpc_tensor, view_offs);
    out[n++] = OFF(apir_rpc_tensor, data);
    out[n++] = OFF(apir_rpc_tensor, name);
    out[n++] = OFF(apir_rpc_tensor, padding);
    return n;
}

}

