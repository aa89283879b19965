/* Command line of the rank program (the launcher builds it) and the
 * environment a real launcher provides (RANK, LOCAL_RANK, WORLD_SIZE). */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

static const char usage[] =
    "usage: sim_rank_<flavor> --comms FILE --rdv DIR --step-log FILE [options]\n"
    "  rank identity from RANK, LOCAL_RANK, WORLD_SIZE\n"
    "  --steps N --microbatches M --layers L --kernel-us U --opt-kernels K\n"
    "  --opt-kernel-us U --host-us U --loader-us U --prefetch N --grad-mb MB\n"
    "  --act-kb KB --start-delay-ms MS --start-gate FILE --tolerate-errors\n"
    "  --init-delay-ms MS       pause before the first device call (an agent attached to\n"
    "                           the launcher places its probes before communicator set-up)\n"
    "  --activity-api           also enable host API activity records\n"
    "  --expandable-segments    activations in a segment mapped page by page (CUDA driver VMM)\n"
    "  --driver-launches        library kernels launched below the runtime (CUDA driver + a graph,\n"
    "                           or the CANN runtime)\n"
    "  --activity-log FILE      write every activity record read, one JSON line each\n"
    "faults:\n"
    "  --slow FACTOR@STEP       kernels take FACTOR times longer from STEP\n"
    "  --host-work MS@STEP      the main thread spends MS more CPU time on host work in\n"
    "                           every step from STEP (a host-bound rank)\n"
    "  --stall MS@STEP          dataloader sleeps MS before batch STEP\n"
    "  --leak MB@STEP           allocate MB more device memory every step from STEP\n"
    "  --crash SIGNAL@STEP      raise SIGNAL at the start of STEP\n"
    "  --device-error CODE@STEP device allocations fail with status CODE from STEP\n"
    "  --throttle MHZ@STEP      the GPU's SM clock drops to MHZ (thermal) from STEP;\n"
    "                           kernels take 1980/MHZ times longer\n"
    "  --xid CODE@STEP          the GPU raises Xid CODE at the start of STEP\n"
    "                           (STANDIN_MALLOC_ERROR); the rank exits 1 on it\n"
    "  --hang COMM@SEQ          stop forever before operation SEQ (0-based) of COMM\n"
    "  --hang-step STEP         stop forever before the gradient all-reduce of STEP\n"
    "  --hang-inside SEQ        log where STANDIN_*_HANG_AT_SEQ=SEQ takes effect\n"
    "  --delay MS@COMM@SEQ      arrive MS late at operation SEQ (0-based) of COMM\n"
    "  --delay-step MS@STEP     arrive MS late at the gradient all-reduce of STEP\n";

static long env_long(const char *name, long def) {
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : def;
}

static int bad(const char *opt, const char *val) {
    fprintf(stderr, "sim: bad value for --%s: '%s'\n%s", opt, val, usage);
    return -1;
}

/* "A@B" -> two numbers. */
static int split_num_at(const char *s, double *a, long *b) {
    char *end;
    *a = strtod(s, &end);
    if (end == s || *end != '@')
        return -1;
    const char *rest = end + 1;
    *b = strtol(rest, &end, 10);
    return end == rest || *end ? -1 : 0;
}

/* "NAME@SEQ" -> name and number. */
static int split_name_at(const char *s, char *name, long *num) {
    const char *at = strrchr(s, '@');
    if (!at || at == s || (size_t)(at - s) >= SIM_NAME_LEN)
        return -1;
    memcpy(name, s, (size_t)(at - s));
    name[at - s] = 0;
    char *end;
    *num = strtol(at + 1, &end, 10);
    return end == at + 1 || *end ? -1 : 0;
}

static int parse_signal(const char *s) {
    static const struct {
        const char *name;
        int sig;
    } names[] = {{"SIGABRT", SIGABRT}, {"SIGSEGV", SIGSEGV}, {"SIGKILL", SIGKILL},
                 {"SIGBUS", SIGBUS},   {"SIGFPE", SIGFPE},   {"SIGTERM", SIGTERM}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name) || !strcmp(s, names[i].name + 3))
            return names[i].sig;
    char *end;
    long n = strtol(s, &end, 10);
    return end != s && !*end && n > 0 && n < 65 ? (int)n : -1;
}

int sim_parse_args(struct sim_config *cfg, int argc, char **argv) {
    *cfg = (struct sim_config){
        .rank = (int)env_long("RANK", 0),
        .local_rank = (int)env_long("LOCAL_RANK", 0),
        .world_size = (int)env_long("WORLD_SIZE", 1),
        .steps = 100,
        .microbatches = 2,
        .layers = 3,
        .kernel_us = 300,
        .opt_kernels = 2,
        .opt_kernel_us = 200,
        .host_us = 200,
        .loader_us = 200,
        .prefetch = 2,
        .grad_mb = 4,
        .act_kb = 256,
        .faults = {.slow_factor = 1.0, .slow_from_step = -1, .host_work_from_step = -1, .stall_step = -1,
                   .leak_from_step = -1, .crash_step = -1, .device_error_step = -1, .hang_seq = -1, .hang_step = -1, .hang_inside_seq = -1,
                   .delay_seq = -1, .delay_step = -1, .throttle_from_step = -1, .xid_step = -1},
    };
    enum {
        O_STEPS = 256, O_MB, O_LAYERS, O_KUS, O_OPTK, O_OPTUS, O_HOST, O_LOADER, O_PREFETCH,
        O_GRAD, O_ACT, O_DELAYMS, O_GATE, O_COMMS, O_RDV, O_LOG, O_TOL, O_SLOW, O_STALL,
        O_LEAK, O_CRASH, O_HANG, O_HANGSTEP, O_DELAY, O_DELAYSTEP, O_HANGIN, O_ACTAPI,
        O_ACTLOG, O_INITDELAY, O_DEVERR, O_HOSTWORK, O_THROTTLE, O_XID, O_EXPSEG, O_DRVLAUNCH,
        O_HELP
    };
    static const struct option opts[] = {
        {"steps", 1, 0, O_STEPS},          {"microbatches", 1, 0, O_MB},
        {"layers", 1, 0, O_LAYERS},        {"kernel-us", 1, 0, O_KUS},
        {"opt-kernels", 1, 0, O_OPTK},     {"opt-kernel-us", 1, 0, O_OPTUS},
        {"host-us", 1, 0, O_HOST},         {"loader-us", 1, 0, O_LOADER},
        {"prefetch", 1, 0, O_PREFETCH},    {"grad-mb", 1, 0, O_GRAD},
        {"act-kb", 1, 0, O_ACT},           {"start-delay-ms", 1, 0, O_DELAYMS},
        {"start-gate", 1, 0, O_GATE},      {"comms", 1, 0, O_COMMS},
        {"rdv", 1, 0, O_RDV},              {"step-log", 1, 0, O_LOG},
        {"tolerate-errors", 0, 0, O_TOL},  {"slow", 1, 0, O_SLOW},
        {"stall", 1, 0, O_STALL},          {"leak", 1, 0, O_LEAK},
        {"crash", 1, 0, O_CRASH},          {"hang", 1, 0, O_HANG},
        {"hang-step", 1, 0, O_HANGSTEP},   {"delay", 1, 0, O_DELAY},
        {"delay-step", 1, 0, O_DELAYSTEP}, {"hang-inside", 1, 0, O_HANGIN},
        {"activity-api", 0, 0, O_ACTAPI},  {"activity-log", 1, 0, O_ACTLOG},
        {"init-delay-ms", 1, 0, O_INITDELAY}, {"device-error", 1, 0, O_DEVERR},
        {"host-work", 1, 0, O_HOSTWORK},   {"throttle", 1, 0, O_THROTTLE},
        {"xid", 1, 0, O_XID},              {"help", 0, 0, O_HELP},
        {"expandable-segments", 0, 0, O_EXPSEG}, {"driver-launches", 0, 0, O_DRVLAUNCH},
        {0, 0, 0, 0},
    };
    struct sim_faults *f = &cfg->faults;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        const char *v = optarg;
        double d;
        long n;
        switch (c) {
        case O_STEPS: cfg->steps = atol(v); break;
        case O_MB: cfg->microbatches = atoi(v); break;
        case O_LAYERS: cfg->layers = atoi(v); break;
        case O_KUS: cfg->kernel_us = atol(v); break;
        case O_OPTK: cfg->opt_kernels = atoi(v); break;
        case O_OPTUS: cfg->opt_kernel_us = atol(v); break;
        case O_HOST: cfg->host_us = atol(v); break;
        case O_LOADER: cfg->loader_us = atol(v); break;
        case O_PREFETCH: cfg->prefetch = atoi(v); break;
        case O_GRAD: cfg->grad_mb = atol(v); break;
        case O_ACT: cfg->act_kb = atol(v); break;
        case O_DELAYMS: cfg->start_delay_ms = atol(v); break;
        case O_INITDELAY: cfg->init_delay_ms = atol(v); break;
        case O_GATE: cfg->start_gate = v; break;
        case O_COMMS: cfg->comm_file = v; break;
        case O_RDV: cfg->rdv_dir = v; break;
        case O_LOG: cfg->step_log = v; break;
        case O_TOL: cfg->tolerate_errors = 1; break;
        case O_ACTAPI: cfg->activity_api = 1; break;
        case O_EXPSEG: cfg->expandable_segments = 1; break;
        case O_DRVLAUNCH: cfg->driver_launches = 1; break;
        case O_ACTLOG: cfg->activity_log = v; break;
        case O_SLOW:
            if (split_num_at(v, &d, &n) || d <= 0) return bad("slow", v);
            f->slow_factor = d, f->slow_from_step = n;
            break;
        case O_HOSTWORK:
            if (split_num_at(v, &d, &n) || d <= 0) return bad("host-work", v);
            f->host_work_ms = (long)d, f->host_work_from_step = n;
            break;
        case O_STALL:
            if (split_num_at(v, &d, &n)) return bad("stall", v);
            f->stall_ms = (long)d, f->stall_step = n;
            break;
        case O_LEAK:
            if (split_num_at(v, &d, &n) || d <= 0) return bad("leak", v);
            f->leak_mb = (long)d, f->leak_from_step = n;
            break;
        case O_CRASH: {
            char sig[32];
            const char *at = strrchr(v, '@');
            if (!at || (size_t)(at - v) >= sizeof sig) return bad("crash", v);
            memcpy(sig, v, (size_t)(at - v));
            sig[at - v] = 0;
            f->crash_signal = parse_signal(sig);
            f->crash_step = atol(at + 1);
            if (f->crash_signal < 0) return bad("crash", v);
            break;
        }
        case O_DEVERR:
            if (split_num_at(v, &d, &n) || d == 0) return bad("device-error", v);
            f->device_error_code = (long)d, f->device_error_step = n;
            break;
        case O_THROTTLE:
            if (split_num_at(v, &d, &n) || d < 1 || d >= SIM_GPU_MAX_MHZ) return bad("throttle", v);
            f->throttle_mhz = (long)d, f->throttle_from_step = n;
            break;
        case O_XID:
            if (split_num_at(v, &d, &n) || d < 1) return bad("xid", v);
            f->xid_code = (long)d, f->xid_step = n;
            break;
        case O_HANG:
            if (split_name_at(v, f->hang_comm, &f->hang_seq)) return bad("hang", v);
            break;
        case O_HANGSTEP: f->hang_step = atol(v); break;
        case O_HANGIN: f->hang_inside_seq = atol(v); break;
        case O_DELAY: {
            char *end;
            f->delay_ms = strtol(v, &end, 10);
            if (*end != '@' || split_name_at(end + 1, f->delay_comm, &f->delay_seq))
                return bad("delay", v);
            break;
        }
        case O_DELAYSTEP:
            if (split_num_at(v, &d, &n)) return bad("delay-step", v);
            f->delay_ms = (long)d, f->delay_step = n;
            break;
        case O_HELP: fputs(usage, stdout); exit(0);
        default: fputs(usage, stderr); return -1;
        }
    }
    if (!cfg->step_log) {
        fputs("sim: --step-log is required\n", stderr);
        return -1;
    }
    if (cfg->world_size > 1 && (!cfg->comm_file || !cfg->rdv_dir)) {
        fputs("sim: --comms and --rdv are required when WORLD_SIZE > 1\n", stderr);
        return -1;
    }
    if (cfg->microbatches < 1 || cfg->layers < 1 || cfg->prefetch < 1 || cfg->steps < 0)
        return bad("microbatches/layers/prefetch/steps", "out of range");
    return 0;
}
