/* rendezvous.c: see rendezvous.h. */
#define _GNU_SOURCE
#include "rendezvous.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RDV_MAGIC 0x52445631u /* "RDV1" */

struct rdv_rank {
    int32_t pid;
    uint32_t joined;
    double slowdown;
    uint64_t coll_reached; /* collectives this rank has arrived at */
};

struct rdv_release {
    uint64_t seq;
    uint64_t ns;
};

struct rdv_shared {
    uint32_t magic; /* written last by the creator */
    uint32_t nranks;
    uint32_t joined;
    uint32_t aborted;
    pthread_mutex_t mu; /* process-shared, robust */
    uint32_t gen;       /* futex word: bumped on every change */
    uint32_t pad;
    struct rdv_release release[4];
    struct rdv_rank ranks[]; /* nranks, then sent[n][n], recvd[n][n] */
};

struct sd_rdv {
    struct rdv_shared *sh;
    size_t size;
    int nranks;
    int rank;
    uint64_t *sent;  /* sent[src * n + dst]: sends posted by src to dst */
    uint64_t *recvd; /* recvd[dst * n + src]: receives posted by dst from src */
    char name[SD_RDV_NAME_MAX];
};

static size_t segment_size(int nranks)
{
    size_t n = (size_t)nranks;
    return sizeof(struct rdv_shared) + n * sizeof(struct rdv_rank) + 2 * n * n * sizeof(uint64_t);
}

void sd_rdv_make_name(const char *kind, char *out, size_t len)
{
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        rnd = sd_now_ns() * 6364136223846793005ull;
    }
    snprintf(out, len, "/standin-%s-%d-%llx-%llx", kind, (int)getpid(),
             (unsigned long long)(sd_now_ns() & 0xffffffffffull), (unsigned long long)rnd);
}

static void lock(struct rdv_shared *sh)
{
    int rc = pthread_mutex_lock(&sh->mu);
    if (rc == EOWNERDEAD) {
        /* A rank died holding the lock; the counters it guards are plain
         * stores, so the state is still consistent. */
        pthread_mutex_consistent(&sh->mu);
    }
}

static void unlock(struct rdv_shared *sh)
{
    pthread_mutex_unlock(&sh->mu);
}

/* A condition variable made of a futex generation counter: a waiter keeps
 * no state in the segment, so a rank killed while waiting cannot wedge the
 * others (glibc's process-shared condvars can). Caller holds the mutex. */
static void wait_cv(struct rdv_shared *sh)
{
    uint32_t seen = __atomic_load_n(&sh->gen, __ATOMIC_ACQUIRE);
    unlock(sh);
    syscall(SYS_futex, &sh->gen, FUTEX_WAIT, seen, NULL, NULL, 0);
    lock(sh);
}

static void broadcast(struct rdv_shared *sh)
{
    __atomic_add_fetch(&sh->gen, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &sh->gen, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void init_shared(struct rdv_shared *sh, int nranks)
{
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&sh->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    sh->nranks = (uint32_t)nranks;
    for (int i = 0; i < 4; i++) {
        sh->release[i].seq = UINT64_MAX;
    }
    __atomic_store_n(&sh->magic, RDV_MAGIC, __ATOMIC_RELEASE);
}

struct sd_rdv *sd_rdv_join(const char *name, int nranks, int rank, double slowdown, int *err)
{
    *err = 1;
    if (nranks < 1 || nranks > SD_RDV_MAX_RANKS || rank < 0 || rank >= nranks || name == NULL ||
        name[0] != '/' || strlen(name) >= SD_RDV_NAME_MAX) {
        return NULL;
    }
    *err = 2;
    size_t size = segment_size(nranks);
    int created = 1;
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno == EEXIST) {
        created = 0;
        fd = shm_open(name, O_RDWR, 0600);
    }
    if (fd < 0) {
        return NULL;
    }
    if (created) {
        if (ftruncate(fd, (off_t)size) != 0) {
            close(fd);
            shm_unlink(name);
            return NULL;
        }
    } else {
        /* Wait for the creator to size the segment. */
        struct stat st;
        for (int i = 0;; i++) {
            if (fstat(fd, &st) != 0) {
                close(fd);
                return NULL;
            }
            if ((size_t)st.st_size >= sizeof(struct rdv_shared)) {
                break;
            }
            if (i > 30000) {
                close(fd);
                return NULL;
            }
            usleep(1000);
        }
        if ((size_t)st.st_size != size) {
            close(fd);
            *err = 1; /* a different nranks */
            return NULL;
        }
    }
    void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mem == MAP_FAILED) {
        return NULL;
    }
    struct rdv_shared *sh = mem;
    if (created) {
        init_shared(sh, nranks);
    } else {
        for (int i = 0; __atomic_load_n(&sh->magic, __ATOMIC_ACQUIRE) != RDV_MAGIC; i++) {
            if (i > 30000) {
                munmap(mem, size);
                return NULL;
            }
            usleep(1000);
        }
    }
    struct sd_rdv *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        munmap(mem, size);
        return NULL;
    }
    r->sh = sh;
    r->size = size;
    r->nranks = nranks;
    r->rank = rank;
    r->sent = (uint64_t *)(void *)&sh->ranks[nranks];
    r->recvd = r->sent + (size_t)nranks * (size_t)nranks;
    snprintf(r->name, sizeof(r->name), "%s", name);

    lock(sh);
    if (sh->ranks[rank].joined) {
        unlock(sh);
        munmap(mem, size);
        free(r);
        *err = 1;
        return NULL;
    }
    sh->ranks[rank].joined = 1;
    sh->ranks[rank].pid = (int32_t)getpid();
    sh->ranks[rank].slowdown = slowdown >= 1.0 ? slowdown : 1.0;
    sh->joined++;
    if (sh->joined == sh->nranks) {
        shm_unlink(name);
    }
    broadcast(sh);
    unlock(sh);
    *err = 0;
    return r;
}

int sd_rdv_wait_joined(struct sd_rdv *r)
{
    struct rdv_shared *sh = r->sh;
    lock(sh);
    while (sh->joined < sh->nranks && !sh->aborted) {
        wait_cv(sh);
    }
    int rc = sh->aborted ? -1 : 0;
    unlock(sh);
    return rc;
}

static int all_reached(struct rdv_shared *sh, uint64_t count)
{
    for (uint32_t i = 0; i < sh->nranks; i++) {
        if (sh->ranks[i].coll_reached < count) {
            return 0;
        }
    }
    return 1;
}

int sd_rdv_collective(struct sd_rdv *r, uint64_t seq, uint64_t *release_ns, double *slowdown)
{
    struct rdv_shared *sh = r->sh;
    lock(sh);
    if (sh->ranks[r->rank].coll_reached < seq + 1) {
        sh->ranks[r->rank].coll_reached = seq + 1;
    }
    struct rdv_release *rel = &sh->release[seq % 4];
    if (rel->seq != seq && all_reached(sh, seq + 1)) {
        rel->seq = seq;
        rel->ns = sd_now_ns();
        broadcast(sh);
    }
    while (rel->seq != seq && !sh->aborted) {
        wait_cv(sh);
    }
    if (rel->seq != seq) {
        unlock(sh);
        return -1;
    }
    *release_ns = rel->ns;
    double worst = 1.0;
    for (uint32_t i = 0; i < sh->nranks; i++) {
        if (sh->ranks[i].slowdown > worst) {
            worst = sh->ranks[i].slowdown;
        }
    }
    *slowdown = worst;
    unlock(sh);
    return 0;
}

uint64_t sd_rdv_p2p_post(struct sd_rdv *r, int peer, int is_send)
{
    struct rdv_shared *sh = r->sh;
    size_t n = (size_t)r->nranks;
    lock(sh);
    uint64_t ticket = is_send ? ++r->sent[(size_t)r->rank * n + (size_t)peer]
                              : ++r->recvd[(size_t)r->rank * n + (size_t)peer];
    broadcast(sh);
    unlock(sh);
    return ticket;
}

int sd_rdv_p2p_wait(struct sd_rdv *r, int peer, int is_send, uint64_t ticket)
{
    struct rdv_shared *sh = r->sh;
    size_t n = (size_t)r->nranks;
    /* A send completes when the peer posted its matching receive, and the
     * other way round. */
    uint64_t *other = is_send ? &r->recvd[(size_t)peer * n + (size_t)r->rank]
                              : &r->sent[(size_t)peer * n + (size_t)r->rank];
    lock(sh);
    while (*other < ticket && !sh->aborted) {
        wait_cv(sh);
    }
    int rc = *other >= ticket ? 0 : -1;
    unlock(sh);
    return rc;
}

double sd_rdv_pair_slowdown(struct sd_rdv *r, int peer)
{
    double a = r->sh->ranks[r->rank].slowdown;
    double b = r->sh->ranks[peer].slowdown;
    return a > b ? a : b;
}

void sd_rdv_block_until_abort(struct sd_rdv *r)
{
    struct rdv_shared *sh = r->sh;
    lock(sh);
    while (!sh->aborted) {
        wait_cv(sh);
    }
    unlock(sh);
}

void sd_rdv_abort(struct sd_rdv *r)
{
    struct rdv_shared *sh = r->sh;
    lock(sh);
    sh->aborted = 1;
    broadcast(sh);
    unlock(sh);
    shm_unlink(r->name); /* in case not every rank joined */
}

int sd_rdv_aborted(struct sd_rdv *r)
{
    return __atomic_load_n(&r->sh->aborted, __ATOMIC_ACQUIRE) != 0;
}

void sd_rdv_leave(struct sd_rdv *r)
{
    munmap(r->sh, r->size);
    free(r);
}
