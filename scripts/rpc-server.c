/* apir's rpc-server: ggml's RPC server (ggml_backend_rpc_start_server, ggml-rpc.h) on the
 * devices of this ggml build's registry. Built by scripts/build-ggml-backends.sh against the
 * same ggml as apir's Vulkan/RPC build, so its RPC protocol version matches the client's.
 * The flags follow llama.cpp's tools/rpc/rpc-server (which the ggml sdist does not carry):
 *
 *   rpc-server [-H HOST] [-p PORT] [-d DEV[,DEV...]] [-t THREADS] [-c CACHE_DIR]
 *
 * -H: address to listen on (default 127.0.0.1; the server has no authentication, bind it to
 *     loopback unless the network is trusted). -p: TCP port (default 50052). -d: device names
 *     from the registry (`ggml_backend_dev_by_name`, e.g. CPU, Vulkan0; default: CPU).
 * -t: CPU threads (default 1; the server sets them on CPU-like devices). -c: a folder for
 *     ggml-rpc's tensor cache (SET_TENSOR_HASH), off when not given.
 * Prints "rpc-server: listening on HOST:PORT" (stdout, line-buffered, as ggml-rpc's own lines
 * such as "Accepted client connection") and serves until killed. Exit 1 on bad arguments
 * or an unknown device. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml-rpc.h"

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s [-H HOST] [-p PORT] [-d DEV[,DEV...]] [-t THREADS] [-c CACHE_DIR]\n", argv0);
}

int main(int argc, char **argv) {
    const char *host = "127.0.0.1";
    const char *port = "50052";
    const char *devs = "CPU";
    const char *cache_dir = NULL;
    long n_threads = 1;
    setvbuf(stdout, NULL, _IOLBF, 0); /* ggml-rpc's "Accepted client connection" lines, as they come */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) {
            usage(argv[0]);
            return 1;
        }
        const char *v = argv[++i];
        if (strcmp(a, "-H") == 0) host = v;
        else if (strcmp(a, "-p") == 0) port = v;
        else if (strcmp(a, "-d") == 0) devs = v;
        else if (strcmp(a, "-c") == 0) cache_dir = v;
        else if (strcmp(a, "-t") == 0) n_threads = strtol(v, NULL, 10);
        else {
            usage(argv[0]);
            return 1;
        }
    }
    if (n_threads < 1) {
        fprintf(stderr, "rpc-server: -t wants a positive number\n");
        return 1;
    }
    ggml_backend_dev_t devices[GGML_RPC_MAX_SERVERS];
    size_t n_devices = 0;
    char *list = strdup(devs);
    for (char *name = strtok(list, ","); name; name = strtok(NULL, ",")) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
        if (!dev || n_devices == GGML_RPC_MAX_SERVERS) {
            fprintf(stderr, "rpc-server: no device %s (or too many); the registry has:\n", name);
            for (size_t k = 0; k < ggml_backend_dev_count(); k++) {
                fprintf(stderr, "  %s\n", ggml_backend_dev_name(ggml_backend_dev_get(k)));
            }
            return 1;
        }
        devices[n_devices++] = dev;
    }
    free(list);
    char endpoint[512];
    snprintf(endpoint, sizeof endpoint, "%s:%s", host, port);
    printf("rpc-server: listening on %s\n", endpoint);
    fflush(stdout);
    ggml_backend_rpc_start_server(endpoint, cache_dir, (size_t)n_threads, n_devices, devices);
    return 0;
}
