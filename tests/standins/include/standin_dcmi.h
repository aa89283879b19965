/*
 * standin_dcmi.h: the subset of dcmi_interface_api.h (the Ascend NPU
 * driver's device management interface, libdcmi.so) that the stand-in
 * implements, with the real names, types, struct layouts, enum values and
 * prototypes, and the state file through which a simulated job plays the
 * NPUs.
 *
 * Semantics of the stand-in (see tests/standins/README.md):
 * - STANDIN_DCMI_DEVICE_COUNT NPUs (default 8), two per card (cards 0, 1,
 *   ...; device 0 and 1 in each), chip "Ascend" "910B3", AI Core rated
 *   at 1980 MHz (the simulator's one device clock), 64 GiB of HBM, idle,
 *   healthy, no error code.
 * - Each NPU's state is read, at each call, from the text file
 *   $STANDIN_DCMI_DIR/npu<index> (index = card * 2 + device; absent: the
 *   idle NPU above), one "key value" a line (standin_dcmi_write_state
 *   writes one):
 *     pid N             a process running on it (repeatable, 64 at most)
 *     aicore_mhz N      its AI Core frequency now
 *     max_aicore_mhz N  its AI Core rated frequency
 *     util_aicore N     its AI Core utilization, percent
 *     hbm_used_mb N     HBM in use, MB
 *     hbm_total_mb N    HBM, MB
 *     health N          0 ok, 1 minor, 2 major, 3 critical alarm
 *     error_code N      an error code it has now (repeatable, in order)
 *   The file is replaced whole (written aside, then renamed), so a reader
 *   never sees half of one.
 */
#ifndef STANDIN_DCMI_H
#define STANDIN_DCMI_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DCMI_OK 0
#define DCMI_ERR_CODE_INVALID_PARAMETER (-8001)
#define DCMI_ERR_CODE_INNER_ERR (-8005)
#define DCMI_ERR_CODE_INVALID_DEVICE_ID (-8007)

#define MAX_CHIP_NAME_LEN 32

struct dcmi_chip_info {
    unsigned char chip_type[MAX_CHIP_NAME_LEN];
    unsigned char chip_name[MAX_CHIP_NAME_LEN];
    unsigned char chip_ver[MAX_CHIP_NAME_LEN];
    unsigned int aicore_cnt;
};

struct dcmi_hbm_info {
    unsigned long long memory_size; /* MB */
    unsigned int freq;
    unsigned long long memory_usage; /* MB */
    int temp;
    unsigned int bandwith_util_rate;
};

struct dcmi_proc_mem_info {
    int proc_id;
    unsigned long proc_mem_usage;
};

enum dcmi_freq_type {
    DCMI_FREQ_DDR = 1,
    DCMI_FREQ_CTRLCPU = 2,
    DCMI_FREQ_HBM = 6,
    DCMI_FREQ_AICORE_CURRENT_ = 7,
    DCMI_FREQ_AICORE_MAX = 9,
    DCMI_FREQ_VECTORCORE_CURRENT = 12
};

#define DCMI_UTILIZATION_RATE_AICORE 2

int dcmi_init(void);
int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len);
int dcmi_get_device_num_in_card(int card_id, int *device_num);
int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *chip_info);
int dcmi_get_device_frequency(int card_id, int device_id, enum dcmi_freq_type input_type,
                              unsigned int *frequency);
int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type,
                                     unsigned int *utilization_rate);
int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info);
int dcmi_get_device_health(int card_id, int device_id, unsigned int *health);
int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
                                 unsigned int *error_code_list, unsigned int list_len);
int dcmi_get_device_resource_info(int card_id, int device_id, struct dcmi_proc_mem_info *proc_info,
                                  int *proc_num);

/* ---- the state file ---- */

#define STANDIN_DCMI_MAX_PIDS 64
#define STANDIN_DCMI_MAX_CODES 64
#define STANDIN_DCMI_PER_CARD 2

/* One NPU's state as the state file holds it. */
struct standin_dcmi_state {
    unsigned int pids[STANDIN_DCMI_MAX_PIDS];
    unsigned int npids;
    unsigned int aicore_mhz, max_aicore_mhz, util_aicore, health;
    unsigned long long hbm_used_mb, hbm_total_mb;
    unsigned int codes[STANDIN_DCMI_MAX_CODES];
    unsigned int ncodes;
};

/* Writes NPU `index`'s state file under `dir` (aside, then renamed);
 * 0 or -1. */
static inline int standin_dcmi_write_state(const char *dir, unsigned int index,
                                           const struct standin_dcmi_state *s) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/npu%u", dir, index);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    for (unsigned int i = 0; i < s->npids && i < STANDIN_DCMI_MAX_PIDS; i++)
        fprintf(f, "pid %u\n", s->pids[i]);
    fprintf(f, "aicore_mhz %u\nmax_aicore_mhz %u\nutil_aicore %u\nhealth %u\n", s->aicore_mhz,
            s->max_aicore_mhz, s->util_aicore, s->health);
    fprintf(f, "hbm_used_mb %llu\nhbm_total_mb %llu\n", s->hbm_used_mb, s->hbm_total_mb);
    for (unsigned int i = 0; i < s->ncodes && i < STANDIN_DCMI_MAX_CODES; i++)
        fprintf(f, "error_code %u\n", s->codes[i]);
    if (fclose(f) != 0) return -1;
    return rename(tmp, path);
}

#ifdef __cplusplus
}
#endif
#endif
