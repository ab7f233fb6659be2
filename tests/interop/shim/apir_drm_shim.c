/*
 * apir_drm_shim.c: apir's local transport presented to an unmodified C guest as a DRM device.
 *
 * Theory of operation: the C guest library (ggml's libggml-virtgpu.so) finds its render node
 * with drmGetDevices2, opens it, checks drmGetVersion for "virtio_gpu" 0.x, then talks to it
 * only through drmIoctl (the virtgpu ioctls) and mmap of the node's fd at the offset that
 * DRM_IOCTL_VIRTGPU_MAP returned. Loaded with LD_PRELOAD, this shim answers those calls:
 *
 *   drmGetDevices2 / drmFreeDevices  one device whose render node is APIR_SHIM_NODE
 *   open(APIR_SHIM_NODE)             connects to the apir host socket ($APIR_SHIM_SOCKET), sends
 *                                    HELLO and returns the context's shared memory file (the fd
 *                                    the HELLO reply carries) as the "render node" fd
 *   drmGetVersion / drmFreeVersion   "virtio_gpu" 0.1.0 for that fd
 *   drmIoctl                         GETPARAM, GET_CAPS, CONTEXT_INIT, RESOURCE_CREATE_BLOB, MAP,
 *                                    EXECBUFFER and GEM_CLOSE become one request and one reply on
 *                                    the socket (docs/local-transport.md); an errno reply fails
 *                                    the ioctl with that errno, as the kernel would
 *   close(fd)                        ends the connection: the host frees the context
 *
 * mmap is not intercepted: the node fd *is* the shared memory file and a blob's MAP offset is
 * its offset in that file, so the guest's own mmap(fd, offset) maps the blob's pages, shared
 * with the host. Every other fd, path and call goes to the real libc / libdrm (RTLD_NEXT).
 *
 * EXECBUFFER waits for the host's reply, which the host sends once the command has run; a dead
 * host (EOF) fails the ioctl with EIO instead of leaving the guest polling forever.
 *
 * Struct layouts and request numbers come from the kernel UAPI header drm/virtgpu_drm.h and
 * libdrm's xf86drm.h the C guest was built with.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <xf86drm.h>
#include <drm/virtgpu_drm.h>

#define APIR_SHIM_NODE "/dev/dri/apir-local-renderD128"
#define APIR_SHIM_SOCKET_ENV "APIR_SHIM_SOCKET"

/* the local transport's wire (apir/local/wire.py) */
#define WIRE_HELLO_MAGIC 0x52495041u /* "APIR" */
#define WIRE_VERSION 1u
enum wire_op {
    OP_HELLO = 1,
    OP_GETPARAM = 2,
    OP_GET_CAPS = 3,
    OP_CONTEXT_INIT = 4,
    OP_CREATE_BLOB = 5,
    OP_MAP = 6,
    OP_GEM_CLOSE = 7,
    OP_EXECBUFFER = 8,
};
struct wire_header {
    uint32_t op, err, len, seq;
};
#define WIRE_MAX_EXEC_COMMAND 65536u
#define WIRE_MAX_REPLY 4096u

#define MAX_CONNECTIONS 16

struct connection {
    int node_fd; /* the shared memory file, handed to the guest as its render node fd */
    int sock;
    uint32_t seq;
    pthread_mutex_t lock;
};

static struct connection conns[MAX_CONNECTIONS];
static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static int debug_enabled = -1;

#define REAL(name) static __typeof__(name) *real_##name; \
    if (!real_##name) real_##name = (__typeof__(name) *) dlsym(RTLD_NEXT, #name)

static void debug(const char *fmt, ...) {
    if (debug_enabled < 0)
        debug_enabled = getenv("APIR_SHIM_DEBUG") != NULL;
    if (!debug_enabled)
        return;
    va_list ap;
    va_start(ap, fmt);
    fputs("apir-shim: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static struct connection *find_conn(int fd) {
    if (fd < 0)
        return NULL;
    for (int i = 0; i < MAX_CONNECTIONS; i++)
        if (conns[i].sock > 0 && conns[i].node_fd == fd)
            return &conns[i];
    return NULL;
}

/* --- socket I/O ------------------------------------------------------------------------- */

static int send_all(int sock, const void *buf, size_t size) {
    const char *p = buf;
    while (size) {
        ssize_t n = send(sock, p, size, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        size -= (size_t) n;
    }
    return 0;
}

static int recv_all(int sock, void *buf, size_t size) {
    char *p = buf;
    while (size) {
        ssize_t n = recv(sock, p, size, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        size -= (size_t) n;
    }
    return 0;
}

/* One request and its reply. Returns 0, or -1 with errno set (the reply's errno, or EIO when
 * the connection broke). `reply_len` gets the reply payload size (at most reply_cap). */
static int transact(struct connection *c, uint32_t op, const void *req, uint32_t req_len,
                    const void *tail, uint32_t tail_len, void *reply, uint32_t reply_cap,
                    uint32_t *reply_len) {
    struct wire_header h = { op, 0, req_len + tail_len, 0 };
    struct wire_header r;
    int err = 0;

    pthread_mutex_lock(&c->lock);
    h.seq = ++c->seq;
    if (send_all(c->sock, &h, sizeof h) || send_all(c->sock, req, req_len) ||
        (tail_len && send_all(c->sock, tail, tail_len)) || recv_all(c->sock, &r, sizeof r)) {
        err = EIO;
        goto out;
    }
    if (r.op != op || r.seq != h.seq || r.len > reply_cap) {
        debug("bad reply to op %u: op %u seq %u/%u len %u", op, r.op, r.seq, h.seq, r.len);
        err = EIO;
        goto out;
    }
    if (r.len && recv_all(c->sock, reply, r.len)) {
        err = EIO;
        goto out;
    }
    if (reply_len)
        *reply_len = r.len;
    err = (int) r.err;
out:
    pthread_mutex_unlock(&c->lock);
    if (err) {
        debug("op %u failed: %s", op, strerror(err));
        errno = err;
        return -1;
    }
    return 0;
}

/* Connects and says HELLO; returns the shared memory file's fd (the node fd) or -1. */
static int connect_node(void) {
    const char *path = getenv(APIR_SHIM_SOCKET_ENV);
    if (!path || strlen(path) >= sizeof(((struct sockaddr_un *) 0)->sun_path)) {
        debug("%s not set (or too long)", APIR_SHIM_SOCKET_ENV);
        errno = ENOENT;
        return -1;
    }
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -1;
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    strcpy(addr.sun_path, path);
    if (connect(sock, (struct sockaddr *) &addr, sizeof addr)) {
        debug("connect(%s): %s", path, strerror(errno));
        close(sock);
        return -1;
    }

    uint32_t hello[2] = { WIRE_HELLO_MAGIC, WIRE_VERSION };
    struct wire_header h = { OP_HELLO, 0, sizeof hello, 1 };
    struct wire_header r;
    uint32_t reply[4];
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = { &r, sizeof r };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                          .msg_controllen = sizeof cbuf };
    int memfd = -1;

    if (send_all(sock, &h, sizeof h) || send_all(sock, hello, sizeof hello))
        goto fail;
    /* the fd rides on the reply's first byte: read the header with recvmsg */
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0)
        goto fail;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
            memcpy(&memfd, CMSG_DATA(cm), sizeof memfd);
    if ((size_t) n < sizeof r && recv_all(sock, (char *) &r + n, sizeof r - (size_t) n))
        goto fail;
    if (r.op != OP_HELLO || r.err || r.len != sizeof reply || recv_all(sock, reply, sizeof reply) ||
        reply[0] != WIRE_HELLO_MAGIC || reply[1] != WIRE_VERSION || memfd < 0) {
        debug("HELLO refused (err %u, len %u, fd %d)", r.err, r.len, memfd);
        goto fail;
    }

    pthread_mutex_lock(&conns_lock);
    for (int i = 0; i < MAX_CONNECTIONS; i++) {
        if (conns[i].sock <= 0) {
            conns[i].node_fd = memfd;
            conns[i].sock = sock;
            conns[i].seq = 1;
            pthread_mutex_init(&conns[i].lock, NULL);
            pthread_mutex_unlock(&conns_lock);
            debug("connected to %s: node fd %d, blob alignment %u", path, memfd, reply[2]);
            return memfd;
        }
    }
    pthread_mutex_unlock(&conns_lock);
    errno = EMFILE;
fail:
    if (memfd >= 0)
        close(memfd);
    close(sock);
    if (!errno)
        errno = EIO;
    return -1;
}

/* --- libc ----------------------------------------------------------------------------- */

static int is_node(const char *path) {
    return path && strcmp(path, APIR_SHIM_NODE) == 0;
}

int open(const char *path, int flags, ...) {
    REAL(open);
    if (is_node(path))
        return connect_node();
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    return real_open(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    REAL(open64);
    if (is_node(path))
        return connect_node();
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    return real_open64(path, flags, mode);
}

int close(int fd) {
    REAL(close);
    pthread_mutex_lock(&conns_lock);
    struct connection *c = find_conn(fd);
    if (c) {
        real_close(c->sock);
        c->sock = 0;
        c->node_fd = -1;
        pthread_mutex_destroy(&c->lock);
        debug("node fd %d closed", fd);
    }
    pthread_mutex_unlock(&conns_lock);
    return real_close(fd);
}

/* --- libdrm ----------------------------------------------------------------------------- */

int drmGetDevices2(uint32_t flags, drmDevicePtr devices[], int max_devices) {
    (void) flags;
    if (!devices || max_devices < 1)
        return 1;
    /* one block, as libdrm allocates it, so either drmFreeDevices can free it */
    size_t size = sizeof(drmDevice) + DRM_NODE_MAX * sizeof(char *) + sizeof APIR_SHIM_NODE;
    drmDevicePtr dev = calloc(1, size);
    if (!dev)
        return -ENOMEM;
    dev->nodes = (char **) (dev + 1);
    char *name = (char *) (dev->nodes + DRM_NODE_MAX);
    memcpy(name, APIR_SHIM_NODE, sizeof APIR_SHIM_NODE);
    dev->nodes[DRM_NODE_RENDER] = name;
    dev->available_nodes = 1 << DRM_NODE_RENDER;
    dev->bustype = DRM_BUS_PLATFORM;
    devices[0] = dev;
    return 1;
}

void drmFreeDevices(drmDevicePtr devices[], int count) {
    for (int i = 0; devices && i < count; i++) {
        free(devices[i]);
        devices[i] = NULL;
    }
}

drmVersionPtr drmGetVersion(int fd) {
    REAL(drmGetVersion);
    if (!find_conn(fd))
        return real_drmGetVersion ? real_drmGetVersion(fd) : NULL;
    drmVersionPtr v = calloc(1, sizeof *v);
    if (!v)
        return NULL;
    v->version_major = 0;
    v->version_minor = 1;
    v->name = strdup("virtio_gpu");
    v->name_len = (int) strlen(v->name);
    v->date = strdup("0");
    v->date_len = 1;
    v->desc = strdup("apir local transport");
    v->desc_len = (int) strlen(v->desc);
    return v;
}

void drmFreeVersion(drmVersionPtr v) {
    /* libdrm's own drmFreeVersion frees the same three strings and the struct */
    if (!v)
        return;
    free(v->name);
    free(v->date);
    free(v->desc);
    free(v);
}

static int ioctl_getparam(struct connection *c, struct drm_virtgpu_getparam *a) {
    uint64_t param = a->param, value = 0;
    uint32_t len = 0;
    if (transact(c, OP_GETPARAM, &param, sizeof param, NULL, 0, &value, sizeof value, &len))
        return -1;
    /* the kernel writes an int (32 bits) to the user's value pointer */
    int v32 = (int) value;
    memcpy((void *) (uintptr_t) a->value, &v32, sizeof v32);
    return 0;
}

static int ioctl_get_caps(struct connection *c, struct drm_virtgpu_get_caps *a) {
    uint32_t req[4] = { a->cap_set_id, a->cap_set_ver, a->size, 0 };
    char caps[WIRE_MAX_REPLY];
    uint32_t len = 0;
    if (transact(c, OP_GET_CAPS, req, sizeof req, NULL, 0, caps, sizeof caps, &len))
        return -1;
    memcpy((void *) (uintptr_t) a->addr, caps, len < a->size ? len : a->size);
    return 0;
}

static int ioctl_context_init(struct connection *c, struct drm_virtgpu_context_init *a) {
    struct {
        uint32_t capset_id, num_rings;
        uint64_t poll_rings_mask;
    } req = { 0, 0, 0 };
    const struct drm_virtgpu_context_set_param *p =
        (const struct drm_virtgpu_context_set_param *) (uintptr_t) a->ctx_set_params;
    for (uint32_t i = 0; i < a->num_params; i++) {
        switch (p[i].param) {
        case VIRTGPU_CONTEXT_PARAM_CAPSET_ID: req.capset_id = (uint32_t) p[i].value; break;
        case VIRTGPU_CONTEXT_PARAM_NUM_RINGS: req.num_rings = (uint32_t) p[i].value; break;
        case VIRTGPU_CONTEXT_PARAM_POLL_RINGS_MASK: req.poll_rings_mask = p[i].value; break;
        default: errno = EINVAL; return -1;
        }
    }
    return transact(c, OP_CONTEXT_INIT, &req, sizeof req, NULL, 0, NULL, 0, NULL);
}

static int ioctl_create_blob(struct connection *c, struct drm_virtgpu_resource_create_blob *a) {
    struct {
        uint32_t blob_mem, blob_flags;
        uint64_t size, blob_id;
    } req = { a->blob_mem, a->blob_flags, a->size, a->blob_id };
    struct {
        uint32_t res_handle, bo_handle;
        uint64_t size;
    } rep;
    uint32_t len = 0;
    if (a->cmd_size) { /* blob creation commands are not part of APIR */
        errno = EINVAL;
        return -1;
    }
    if (transact(c, OP_CREATE_BLOB, &req, sizeof req, NULL, 0, &rep, sizeof rep, &len))
        return -1;
    if (len != sizeof rep) {
        errno = EIO;
        return -1;
    }
    a->res_handle = rep.res_handle;
    a->bo_handle = rep.bo_handle;
    return 0;
}

static int ioctl_map(struct connection *c, struct drm_virtgpu_map *a) {
    uint32_t req[2] = { a->handle, 0 };
    uint64_t offset = 0;
    uint32_t len = 0;
    if (transact(c, OP_MAP, req, sizeof req, NULL, 0, &offset, sizeof offset, &len))
        return -1;
    a->offset = offset;
    return 0;
}

static int ioctl_gem_close(struct connection *c, struct drm_gem_close *a) {
    uint32_t req[2] = { a->handle, 0 };
    return transact(c, OP_GEM_CLOSE, req, sizeof req, NULL, 0, NULL, 0, NULL);
}

static int ioctl_execbuffer(struct connection *c, struct drm_virtgpu_execbuffer *a) {
    uint32_t req[4] = { a->flags, a->size, a->ring_idx, 0 };
    if (a->size > WIRE_MAX_EXEC_COMMAND || a->num_bo_handles || a->num_in_syncobjs ||
        a->num_out_syncobjs || (a->flags & (VIRTGPU_EXECBUF_FENCE_FD_IN | VIRTGPU_EXECBUF_FENCE_FD_OUT))) {
        errno = EINVAL; /* APIR uses none of these; the host has no fences to give */
        return -1;
    }
    return transact(c, OP_EXECBUFFER, req, sizeof req, (const void *) (uintptr_t) a->command, a->size,
                    NULL, 0, NULL);
}

int drmIoctl(int fd, unsigned long request, void *arg) {
    REAL(drmIoctl);
    struct connection *c = find_conn(fd);
    if (!c)
        return real_drmIoctl ? real_drmIoctl(fd, request, arg) : (errno = ENOSYS, -1);
    switch (request) {
    case DRM_IOCTL_VIRTGPU_GETPARAM: return ioctl_getparam(c, arg);
    case DRM_IOCTL_VIRTGPU_GET_CAPS: return ioctl_get_caps(c, arg);
    case DRM_IOCTL_VIRTGPU_CONTEXT_INIT: return ioctl_context_init(c, arg);
    case DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB: return ioctl_create_blob(c, arg);
    case DRM_IOCTL_VIRTGPU_MAP: return ioctl_map(c, arg);
    case DRM_IOCTL_VIRTGPU_EXECBUFFER: return ioctl_execbuffer(c, arg);
    case DRM_IOCTL_GEM_CLOSE: return ioctl_gem_close(c, arg);
    default:
        debug("unsupported ioctl %#lx", request);
        errno = ENOTTY;
        return -1;
    }
}
