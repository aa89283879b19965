/*
 * xpuscope-escape LIBCUDART: calls that never return to their probe.
 *
 * Prints "ready" and waits for a line on stdin; then calls cudaMalloc
 * ESCAPES times with an output pointer on a page it may not write: the
 * library faults writing the result, and the fault handler jumps back out
 * of the call (siglongjmp), so the call's return is never seen, as for a
 * return probe attached a moment after its entry probe or detached during
 * the call. Then it allocates 1, 2 and 3 MiB for real, prints
 * "done <pointers>", and waits for another line before exiting.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define ESCAPES 12
#define MIB (1u << 20)

typedef int (*malloc_fn)(void **ptr, size_t size);

static sigjmp_buf escape;

static void on_fault(int sig)
{
    (void)sig;
    siglongjmp(escape, 1);
}

static void wait_line(void)
{
    char line[64];
    if (fgets(line, sizeof(line), stdin) == NULL) {
        exit(1);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s LIBCUDART\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "escape: %s\n", dlerror());
        return 2;
    }
    malloc_fn dev_malloc = (malloc_fn)dlsym(lib, "cudaMalloc");
    if (!dev_malloc) {
        fprintf(stderr, "escape: no cudaMalloc\n");
        return 2;
    }
    void **locked = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (locked == MAP_FAILED) {
        perror("mmap");
        return 2;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fault;
    sigaction(SIGSEGV, &sa, NULL);
    printf("ready\n");
    fflush(stdout);
    wait_line();
    int escaped = 0;
    for (int i = 0; i < ESCAPES; i++) {
        if (sigsetjmp(escape, 1) == 0) {
            dev_malloc(locked, MIB);
        } else {
            escaped++;
        }
    }
    void *p[3] = {0};
    for (int i = 0; i < 3; i++) {
        if (dev_malloc(&p[i], (size_t)(i + 1) * MIB) != 0) {
            fprintf(stderr, "escape: cudaMalloc failed\n");
            return 1;
        }
    }
    printf("done %d %p %p %p\n", escaped, p[0], p[1], p[2]);
    fflush(stdout);
    wait_line();
    return 0;
}
