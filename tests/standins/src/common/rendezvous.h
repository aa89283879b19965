/*
 * rendezvous.h: the cross-process communicator engine shared by libnccl and
 * libhccl.
 *
 * A communicator is a POSIX shared-memory segment named by the unique id /
 * root info: a header with a process-shared robust mutex and a futex
 * generation word (a condition variable), one slot per rank (pid, joined, link slowdown, collectives
 * reached) and two nranks x nranks matrices counting posted sends and
 * receives. The first rank to open the name creates and initialises it;
 * the last to join unlinks it (every rank keeps it mapped), so nothing is
 * left in /dev/shm once a communicator is fully formed.
 */
#ifndef STANDIN_RENDEZVOUS_H
#define STANDIN_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "util.h"

#define SD_RDV_MAX_RANKS 1024
#define SD_RDV_NAME_MAX 64

struct sd_rdv;

/* Writes a fresh, unique segment name "/standin-<kind>-<pid>-<ns>-<rand>". */
SD_HIDDEN void sd_rdv_make_name(const char *kind, char *out, size_t len);

/* Opens or creates the segment and registers `rank` with its link slowdown.
 * Does not wait for the others. NULL with *err set: 1 bad argument (nranks
 * or rank out of range, nranks differs from the creator's, rank already
 * joined), 2 system error. */
SD_HIDDEN struct sd_rdv *sd_rdv_join(const char *name, int nranks, int rank, double slowdown,
                                     int *err);
/* Blocks until all ranks joined. 0, or -1 when aborted. */
SD_HIDDEN int sd_rdv_wait_joined(struct sd_rdv *r);

/* Collective number `seq` (0-based, the same order on every rank): marks
 * this rank arrived and blocks until every rank has. *release_ns: when the
 * last rank arrived; *slowdown: the largest link slowdown of the ranks.
 * 0, or -1 when the communicator was aborted. */
SD_HIDDEN int sd_rdv_collective(struct sd_rdv *r, uint64_t seq, uint64_t *release_ns,
                                double *slowdown);

/* Point to point: post a send to / a receive from `peer` (returns a ticket),
 * then wait for the matching receive / send. 0, or -1 when aborted. */
SD_HIDDEN uint64_t sd_rdv_p2p_post(struct sd_rdv *r, int peer, int is_send);
SD_HIDDEN int sd_rdv_p2p_wait(struct sd_rdv *r, int peer, int is_send, uint64_t ticket);

/* The larger link slowdown of this rank and `peer`. */
SD_HIDDEN double sd_rdv_pair_slowdown(struct sd_rdv *r, int peer);

/* Blocks until the communicator is aborted (a hang). */
SD_HIDDEN void sd_rdv_block_until_abort(struct sd_rdv *r);
/* Aborts: every rank's pending and future waits return -1. */
SD_HIDDEN void sd_rdv_abort(struct sd_rdv *r);
SD_HIDDEN int sd_rdv_aborted(struct sd_rdv *r);
/* Unmaps the segment (no waits may be pending). */
SD_HIDDEN void sd_rdv_leave(struct sd_rdv *r);

#endif /* STANDIN_RENDEZVOUS_H */
