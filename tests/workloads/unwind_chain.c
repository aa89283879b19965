/*
 * The unwinding fixture: built WITHOUT frame pointers (-O2
 * -fomit-frame-pointer, see the Makefile), a chain of its own functions
 * main -> chain_outer -> chain_middle -> chain_inner -> block_in_libc that
 * blocks forever in one glibc call, chosen by argv[1]:
 *
 *   nanosleep  nanosleep(2) for an hour
 *   mutex      a second pthread_mutex_lock of a default (non-recursive) mutex
 *   condvar    pthread_cond_wait on a condition nobody signals
 *   pipe       read(2) on an empty pipe whose write end stays open
 *   dlcall LIB SYMBOL
 *              calls int SYMBOL(void *) in LIB (dlopen), with getenv()
 *              and dlopen() interposed: the library's first call of either
 *              blocks in read(2) on a pipe, so the stack runs fixture ->
 *              LIB -> fixture -> libc (the real libnccl from PyPI reads its
 *              settings with getenv, libcudart dlopens the driver). With
 *              UNWIND_CHAIN_DELAY_MS set, waits that long between the
 *              dlopen and the call.
 *   alloc LIB  calls cudaMalloc in LIB (dlopen) every 50 ms, forever
 *              (allocating stacks; without a GPU the call fails at once).
 *
 * Or, for the agent's end-to-end test (the stacks must be taken after the
 * agent attached, so nothing may block before it says so):
 *
 *   forks SPEC...
 *              waits for a line on stdin, then forks a child per SPEC
 *              (a mode above, its arguments joined with ':', e.g.
 *              dlcall:LIB:SYMBOL) that runs the chain from main; each says
 *              "ready INDEX PID". At end of stdin the children are killed
 *              and reaped and the parent exits.
 *
 * It prints "ready" on stdout just before blocking; the test then stops it
 * with ptrace and unwinds. Every chain function does work after its call,
 * so none of the calls can become a tail call (which would legitimately
 * drop the caller from every unwinder's view).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

volatile int sink;

static int block_pipe[2];
static volatile int block_in_getenv;

/* forks mode: which SPEC this child runs (-1: not forked). */
static int fork_index = -1;

static void say_ready(void) {
    if (fork_index >= 0)
        printf("ready %d %d\n", fork_index, (int)getpid());
    else
        fputs("ready\n", stdout);
    fflush(stdout);
}

/* Blocks forever in read(2) (the pipe's write end is never written). */
NOINLINE int block_on_pipe(void) {
    char c;
    say_ready();
    int r = (int)read(block_pipe[0], &c, 1);
    sink += r;
    return r;
}

/* Once armed, the library's first getenv or dlopen blocks. */
static void block_if_armed(void) {
    if (block_in_getenv) {
        block_in_getenv = 0;
        sink += block_on_pipe();
    }
}

/* getenv and dlopen for everything this executable loads (linked with
 * -rdynamic, so the dynamic linker binds libraries' calls here first):
 * libnccl reads its settings with getenv, libcudart dlopens the driver.
 * Until armed they are the real functions. */
char *getenv(const char *name) {
    static char *(*real_getenv)(const char *);
    block_if_armed();
    if (!real_getenv)
        real_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
    return real_getenv ? real_getenv(name) : NULL;
}

void *dlopen(const char *file, int flags) {
    static void *(*real_dlopen)(const char *, int);
    block_if_armed();
    if (!real_dlopen)
        real_dlopen = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
    return real_dlopen ? real_dlopen(file, flags) : NULL;
}

NOINLINE int call_library(const char *lib, const char *symbol) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
        exit(2);
    }
    int (*fn)(void *) = (int (*)(void *))dlsym(h, symbol);
    if (!fn) {
        fprintf(stderr, "dlsym %s: %s\n", symbol, dlerror());
        exit(2);
    }
    /* UNWIND_CHAIN_DELAY_MS: time for an agent following this process to
     * probe the library it just loaded before the call. */
    const char *delay = getenv("UNWIND_CHAIN_DELAY_MS");
    if (delay)
        usleep((useconds_t)atoi(delay) * 1000);
    char scratch[256];
    memset(scratch, 0, sizeof scratch);
    block_in_getenv = 1;
    int r = fn(scratch);
    /* The library returned without calling getenv: say so, the test fails
     * with this message instead of waiting for "ready". */
    if (block_in_getenv) {
        fprintf(stderr, "%s returned %d without calling getenv or dlopen\n", symbol, r);
        exit(3);
    }
    sink += r;
    return r;
}

/* Allocates 1 MiB with LIB's cudaMalloc every 50 ms, forever. */
NOINLINE int allocate_in_loop(const char *lib) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
        exit(2);
    }
    int (*cuda_malloc)(void **, size_t) = (int (*)(void **, size_t))dlsym(h, "cudaMalloc");
    if (!cuda_malloc) {
        fprintf(stderr, "dlsym cudaMalloc: %s\n", dlerror());
        exit(2);
    }
    for (int i = 0;; i++) {
        void *p = NULL;
        sink += cuda_malloc(&p, 1 << 20);
        if (i == 0)
            say_ready();
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

NOINLINE int block_in_libc(char **argv) {
    const char *kind = argv[1];
    int r = 0;
    if (!strcmp(kind, "nanosleep")) {
        struct timespec ts = {3600, 0};
        say_ready();
        r = nanosleep(&ts, NULL);
    } else if (!strcmp(kind, "mutex")) {
        static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&m);
        say_ready();
        r = pthread_mutex_lock(&m); /* a default mutex deadlocks here */
    } else if (!strcmp(kind, "condvar")) {
        static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
        static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
        pthread_mutex_lock(&m);
        say_ready();
        r = pthread_cond_wait(&c, &m);
    } else if (!strcmp(kind, "pipe")) {
        r = block_on_pipe();
    } else if (!strcmp(kind, "dlcall") && argv[2] && argv[3]) {
        r = call_library(argv[2], argv[3]);
    } else if (!strcmp(kind, "alloc") && argv[2]) {
        r = allocate_in_loop(argv[2]);
    } else {
        fprintf(stderr, "usage: %s nanosleep|mutex|condvar|pipe|dlcall LIB SYMBOL|alloc LIB\n", argv[0]);
        exit(2);
    }
    sink += r;
    return r + 1;
}

NOINLINE int chain_inner(char **argv) {
    int r = block_in_libc(argv);
    sink += r;
    return r * 3;
}

NOINLINE int chain_middle(char **argv) {
    int r = chain_inner(argv);
    sink += r;
    return r + 7;
}

NOINLINE int chain_outer(char **argv) {
    int r = chain_middle(argv);
    sink += r;
    return r - 1;
}

/* forks mode, in the parent: the children's pids. */
#define MAX_FORKS 16

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s nanosleep|mutex|condvar|pipe|dlcall LIB SYMBOL|alloc LIB\n", argv[0]);
        fprintf(stderr, "       %s forks SPEC...\n", argv[0]);
        return 2;
    }
    if (pipe(block_pipe) != 0) {
        perror("pipe");
        return 1;
    }
    char *child_argv[5] = {argv[0], NULL, NULL, NULL, NULL};
    if (!strcmp(argv[1], "forks")) {
        pid_t pids[MAX_FORKS];
        int n = 0;
        char line[64];
        if (!fgets(line, sizeof line, stdin))
            return 1;
        for (int i = 2; i < argc && n < MAX_FORKS; i++) {
            fflush(stdout);
            pid_t pid = fork();
            if (pid < 0) {
                perror("fork");
                break;
            }
            if (pid == 0) {
                /* Never outlive a parent killed by a failing test. */
                prctl(PR_SET_PDEATHSIG, SIGKILL);
                fork_index = i - 2;
                /* SPEC -> mode and its arguments (split in place). */
                int k = 1;
                for (char *tok = strtok(argv[i], ":"); tok && k < 4; tok = strtok(NULL, ":"))
                    child_argv[k++] = tok;
                argv = child_argv;
                break;
            }
            pids[n++] = pid;
        }
        if (fork_index < 0) {
            while (fgets(line, sizeof line, stdin))
                ;
            for (int i = 0; i < n; i++)
                kill(pids[i], SIGKILL);
            for (int i = 0; i < n; i++)
                waitpid(pids[i], NULL, 0);
            return 0;
        }
    }
    int r = chain_outer(argv);
    sink += r;
    return r == 12345;
}
