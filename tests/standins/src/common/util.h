/*
 * util.h: clock, sleep/spin, environment and symbol-lookup helpers shared by
 * every stand-in library. Every copy is private to its library (hidden).
 */
#ifndef STANDIN_UTIL_H
#define STANDIN_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* The CUDA stand-ins build with -DSD_HIDDEN= : libcuda.so.1 exports the
 * engine to libcudart.so.12 (see cudrv.h). */
#ifndef SD_HIDDEN
#define SD_HIDDEN __attribute__((visibility("hidden")))
#endif
#define SD_EXPORT __attribute__((visibility("default")))

/* CLOCK_BOOTTIME in nanoseconds: the clock of the agent and of every record. */
SD_HIDDEN uint64_t sd_now_ns(void);
/* Sleeps (off-CPU) until CLOCK_BOOTTIME reaches deadline_ns. */
SD_HIDDEN void sd_sleep_until(uint64_t deadline_ns);
/* Busy-spins until CLOCK_BOOTTIME reaches deadline_ns. */
SD_HIDDEN void sd_spin_until(uint64_t deadline_ns);

/* Environment values, `def` when unset or unparsable. */
SD_HIDDEN uint64_t sd_env_u64(const char *name, uint64_t def);
SD_HIDDEN int64_t sd_env_i64(const char *name, int64_t def);
SD_HIDDEN double sd_env_double(const char *name, double def);
/* STANDIN_MALLOC_ERROR: a status every device allocation fails with while
 * the variable is set (0: none). Read at each allocation, so a program can
 * set it when it wants its allocations to start failing (a device lost or
 * a sticky error mid-run, not out of memory). */
SD_HIDDEN int64_t sd_injected_malloc_error(void);

/* The calling thread's Linux tid. */
SD_HIDDEN uint32_t sd_gettid(void);

/* Looks `sym` up among loaded objects, then in `lib` if that is already
 * loaded (RTLD_NOLOAD), or loads it when `load` is set. NULL if absent. */
SD_HIDDEN void *sd_lookup(const char *sym, const char *lib, int load);

/* A lazily resolved optional hook (a reporting sink in another library that
 * may never be loaded): looked up again at most every 100 ms while absent. */
struct sd_hook {
    const char *sym;
    const char *lib;
    void *volatile fn;
    volatile uint64_t next_try_ns;
};
SD_HIDDEN void *sd_hook_get(struct sd_hook *hook);

/* Returns a copy of `s` that lives for the whole process (one per content). */
SD_HIDDEN const char *sd_intern(const char *s);

#endif /* STANDIN_UTIL_H */
