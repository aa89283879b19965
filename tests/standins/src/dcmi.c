/*
 * dcmi.c: the stand-in libdcmi.so (see include/standin_dcmi.h). Every
 * NPU's frequency, utilization, HBM, health, error codes and processes
 * come from its state file, which the simulated job's fault injector
 * writes, so an agent loading this library from its own process sees what
 * the job plays.
 */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "standin_dcmi.h"

#define API SD_EXPORT

#define MAX_DEVICES 64
#define DEFAULT_MAX_MHZ 1980u
#define DEFAULT_HBM_MB (64ULL << 10)

static int initialized;

static unsigned int device_count(void) {
    uint64_t n = sd_env_u64("STANDIN_DCMI_DEVICE_COUNT", 8);
    return n > MAX_DEVICES ? MAX_DEVICES : (unsigned int)n;
}

/* The NPU at (card, device), as an index; -1 when there is none. */
static int npu_index(int card_id, int device_id) {
    if (!initialized || card_id < 0 || device_id < 0 || device_id >= STANDIN_DCMI_PER_CARD)
        return -1;
    long index = (long)card_id * STANDIN_DCMI_PER_CARD + device_id;
    return index < (long)device_count() ? (int)index : -1;
}

/* NPU `index`'s state: the idle defaults, then what its file says. */
static void read_state(unsigned int index, struct standin_dcmi_state *s) {
    memset(s, 0, sizeof *s);
    s->aicore_mhz = s->max_aicore_mhz = DEFAULT_MAX_MHZ;
    s->hbm_total_mb = DEFAULT_HBM_MB;
    const char *dir = getenv("STANDIN_DCMI_DIR");
    if (!dir || !*dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/npu%u", dir, index);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char key[32];
    unsigned long long v;
    while (fscanf(f, "%31s %llu", key, &v) == 2) {
        if (!strcmp(key, "pid") && s->npids < STANDIN_DCMI_MAX_PIDS)
            s->pids[s->npids++] = (unsigned int)v;
        else if (!strcmp(key, "aicore_mhz"))
            s->aicore_mhz = (unsigned int)v;
        else if (!strcmp(key, "max_aicore_mhz"))
            s->max_aicore_mhz = (unsigned int)v;
        else if (!strcmp(key, "util_aicore"))
            s->util_aicore = (unsigned int)v;
        else if (!strcmp(key, "health"))
            s->health = (unsigned int)v;
        else if (!strcmp(key, "hbm_used_mb"))
            s->hbm_used_mb = v;
        else if (!strcmp(key, "hbm_total_mb"))
            s->hbm_total_mb = v;
        else if (!strcmp(key, "error_code") && s->ncodes < STANDIN_DCMI_MAX_CODES)
            s->codes[s->ncodes++] = (unsigned int)v;
    }
    fclose(f);
}

/* The state of the NPU at (card, device), or an error status. */
#define STATE_OR_RETURN(card_id, device_id, s)                        \
    struct standin_dcmi_state s;                                      \
    do {                                                              \
        int index_ = npu_index(card_id, device_id);                   \
        if (!initialized) return DCMI_ERR_CODE_INNER_ERR;             \
        if (index_ < 0) return DCMI_ERR_CODE_INVALID_DEVICE_ID;       \
        read_state((unsigned int)index_, &s);                         \
    } while (0)

API int dcmi_init(void) {
    initialized = 1;
    return DCMI_OK;
}

API int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len) {
    if (!initialized) return DCMI_ERR_CODE_INNER_ERR;
    if (!card_num || !card_list || list_len < 0) return DCMI_ERR_CODE_INVALID_PARAMETER;
    int cards = (int)((device_count() + STANDIN_DCMI_PER_CARD - 1) / STANDIN_DCMI_PER_CARD);
    if (cards > list_len) return DCMI_ERR_CODE_INVALID_PARAMETER;
    for (int c = 0; c < cards; c++) card_list[c] = c;
    *card_num = cards;
    return DCMI_OK;
}

API int dcmi_get_device_num_in_card(int card_id, int *device_num) {
    if (!initialized) return DCMI_ERR_CODE_INNER_ERR;
    if (!device_num) return DCMI_ERR_CODE_INVALID_PARAMETER;
    if (npu_index(card_id, 0) < 0) return DCMI_ERR_CODE_INVALID_DEVICE_ID;
    *device_num = npu_index(card_id, 1) < 0 ? 1 : STANDIN_DCMI_PER_CARD;
    return DCMI_OK;
}

API int dcmi_get_device_chip_info(int card_id, int device_id, struct dcmi_chip_info *chip_info) {
    if (!chip_info) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    (void)s;
    memset(chip_info, 0, sizeof *chip_info);
    snprintf((char *)chip_info->chip_type, MAX_CHIP_NAME_LEN, "Ascend");
    snprintf((char *)chip_info->chip_name, MAX_CHIP_NAME_LEN, "910B3");
    snprintf((char *)chip_info->chip_ver, MAX_CHIP_NAME_LEN, "V1");
    chip_info->aicore_cnt = 20;
    return DCMI_OK;
}

API int dcmi_get_device_frequency(int card_id, int device_id, enum dcmi_freq_type input_type,
                                  unsigned int *frequency) {
    if (!frequency) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    switch (input_type) {
    case DCMI_FREQ_AICORE_CURRENT_: *frequency = s.aicore_mhz; return DCMI_OK;
    case DCMI_FREQ_AICORE_MAX: *frequency = s.max_aicore_mhz; return DCMI_OK;
    default: return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
}

API int dcmi_get_device_utilization_rate(int card_id, int device_id, int input_type,
                                         unsigned int *utilization_rate) {
    if (!utilization_rate || input_type != DCMI_UTILIZATION_RATE_AICORE)
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    *utilization_rate = s.util_aicore;
    return DCMI_OK;
}

API int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info) {
    if (!hbm_info) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    memset(hbm_info, 0, sizeof *hbm_info);
    hbm_info->memory_size = s.hbm_total_mb;
    hbm_info->memory_usage = s.hbm_used_mb;
    hbm_info->freq = 1600;
    hbm_info->temp = 40;
    return DCMI_OK;
}

API int dcmi_get_device_health(int card_id, int device_id, unsigned int *health) {
    if (!health) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    *health = s.health;
    return DCMI_OK;
}

API int dcmi_get_device_errorcode_v2(int card_id, int device_id, int *error_count,
                                     unsigned int *error_code_list, unsigned int list_len) {
    if (!error_count || !error_code_list) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    unsigned int n = s.ncodes < list_len ? s.ncodes : list_len;
    for (unsigned int i = 0; i < n; i++) error_code_list[i] = s.codes[i];
    *error_count = (int)n;
    return DCMI_OK;
}

API int dcmi_get_device_resource_info(int card_id, int device_id,
                                      struct dcmi_proc_mem_info *proc_info, int *proc_num) {
    if (!proc_info || !proc_num) return DCMI_ERR_CODE_INVALID_PARAMETER;
    STATE_OR_RETURN(card_id, device_id, s);
    /* The caller's array holds MAX_PROC_NUM_IN_DEVICE entries at least, as
     * DCMI's reference requires; the stand-in lists up to 64 as newer
     * drivers do. */
    for (unsigned int i = 0; i < s.npids; i++) {
        proc_info[i].proc_id = (int)s.pids[i];
        proc_info[i].proc_mem_usage = 0;
    }
    *proc_num = (int)s.npids;
    return DCMI_OK;
}
