/* Communicators: read this rank's memberships from the launcher's comm file,
 * share the unique id (ncclUniqueId / HcclRootInfo) through files in the
 * rendezvous directory, and initialise each communicator.
 *
 * Comm file, one communicator per line, in the order every rank initialises
 * them (so blocking inits cannot deadlock):
 *   <name> <kind> <size> <rank-in-comm> <global rank of comm rank 0> ... */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device.h"
#include "sim.h"

#define RDV_TIMEOUT_NS (120ull * 1000000000ull)

int comms_load(const char *path, struct sim_comm *comms, int max) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "sim: cannot open comm file %s: %s\n", path, strerror(errno));
        return -1;
    }
    int n = 0;
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n')
            continue;
        if (n == max) {
            fprintf(stderr, "sim: more than %d communicators in %s\n", max, path);
            fclose(f);
            return -1;
        }
        struct sim_comm *c = &comms[n];
        memset(c, 0, sizeof *c);
        int used = 0;
        if (sscanf(line, "%63s %7s %d %d%n", c->name, c->kind, &c->size, &c->rank, &used) != 4 ||
            c->size < 1 || c->size > SIM_MAX_MEMBERS || c->rank < 0 || c->rank >= c->size) {
            fprintf(stderr, "sim: bad comm line in %s: %s", path, line);
            fclose(f);
            return -1;
        }
        const char *p = line + used;
        for (int i = 0; i < c->size; i++) {
            int m = 0, k = 0;
            if (sscanf(p, "%d%n", &m, &k) != 1) {
                fprintf(stderr, "sim: comm %s lists fewer than %d members\n", c->name, c->size);
                fclose(f);
                return -1;
            }
            c->members[i] = m;
            p += k;
        }
        n++;
    }
    fclose(f);
    return n;
}

static int write_id(const char *dir, const char *name, const void *id, size_t len) {
    char tmp[4096], final[4096];
    snprintf(tmp, sizeof tmp, "%s/%s.id.tmp.%d", dir, name, (int)getpid());
    snprintf(final, sizeof final, "%s/%s.id", dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        return -1;
    ssize_t w = write(fd, id, len);
    close(fd);
    if (w != (ssize_t)len || rename(tmp, final) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int read_id(const char *dir, const char *name, void *id, size_t len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.id", dir, name);
    uint64_t deadline = sim_boot_ns() + RDV_TIMEOUT_NS;
    for (;;) {
        int fd = open(path, O_RDONLY);
        if (fd >= 0) {
            ssize_t r = read(fd, id, len);
            close(fd);
            if (r == (ssize_t)len)
                return 0;
        }
        if (sim_boot_ns() > deadline) {
            fprintf(stderr, "sim: timed out waiting for %s\n", path);
            return -1;
        }
        sim_sleep_ns(2000000);
    }
}

int comms_rendezvous_init(struct sim_comm *comms, int n, const char *rdv_dir, int tolerate) {
    size_t len = dev_comm_id_size();
    unsigned char *id = calloc(1, len);
    if (!id)
        return -1;
    for (int i = 0; i < n; i++) {
        struct sim_comm *c = &comms[i];
        memset(id, 0, len);
        if (c->rank == 0) {
            int err = dev_comm_id_create(id);
            if (err && !tolerate) {
                fprintf(stderr, "sim: unique id for %s failed: %d\n", c->name, err);
                free(id);
                return -1;
            }
            if (write_id(rdv_dir, c->name, id, len)) {
                fprintf(stderr, "sim: cannot publish id of %s in %s\n", c->name, rdv_dir);
                free(id);
                return -1;
            }
        } else if (read_id(rdv_dir, c->name, id, len)) {
            free(id);
            return -1;
        }
        int err = dev_comm_init(&c->handle, c->size, id, c->rank);
        steplog_printf("{\"event\":\"comm_init\",\"comm\":\"%s\",\"kind\":\"%s\",\"size\":%d,"
                       "\"comm_rank\":%d,\"handle\":\"%p\",\"status\":%d,\"boot_ns\":%llu}",
                       c->name, c->kind, c->size, c->rank, c->handle, err,
                       (unsigned long long)sim_boot_ns());
        if (err && !tolerate) {
            fprintf(stderr, "sim: init of communicator %s failed: %d (%s)\n", c->name, err,
                    dev_strerror(err));
            free(id);
            return -1;
        }
    }
    free(id);
    return 0;
}
