/*
 * fake_nvml.c: a stand-in for NVIDIA's libnvidia-ml.so.1 (NVML), for tests.
 *
 * It exports, with NVML's real C ABI (names, argument lists, struct layouts, return
 * codes of nvml.h), the calls that pynvml makes on nri-accel's discovery and health
 * paths, and answers them from a text description of a node read at nvmlInit time from
 * $FAKE_NVML_CONFIG, or else from "fake_nvml.conf" beside this library file. What
 * happens to the node later (XID errors, ECC errors, a GPU falling off the bus) is read
 * from "fake_nvml.events" beside the description, which tests append to while NVML is
 * in use. See README.md for both formats and the calls covered.
 *
 * Like the real library it may be called from several threads: one recursive mutex
 * guards all state, and nvmlEventSetWait sleeps without holding it.
 *
 * Build variants: -DFAKE_NVML_OMIT_NUMA leaves out nvmlDeviceGetNumaNodeId, and
 * -DFAKE_NVML_OMIT_EVENT_WAIT_V2 nvmlEventSetWait_v2, as drivers older than the ones
 * that introduced them.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* ---- NVML ABI subset (values and layouts as in nvml.h) ---------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_UNKNOWN = 999,
};

/* nvmlEventType bits */
#define nvmlEventTypeSingleBitEccError 0x0000000000000001ULL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002ULL
#define nvmlEventTypePState            0x0000000000000004ULL
#define nvmlEventTypeXidCriticalError  0x0000000000000008ULL
/* nvmlEventData_t's instance ids when an event is not attributable to a MIG instance */
#define NVML_GPU_INSTANCE_ID_ANY       0xFFFFFFFFu
#define NVML_COMPUTE_INSTANCE_ID_ANY   0xFFFFFFFFu

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16

typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef enum { NVML_FEATURE_DISABLED = 0, NVML_FEATURE_ENABLED = 1 } nvmlEnableState_t;

/* ---- the node description ------------------------------------------------------ */

#define MAX_GPUS 16
#define MAX_MIGS 8
#define MAX_LINKS 18
#define MAX_FAILS 8
#define MAX_SETS 8
#define MAX_QUEUED 64
#define STR 96
/* What an ECC-enabled data-center GPU offers when the description does not say. */
#define DEFAULT_EVENTS (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | \
                        nvmlEventTypePState | nvmlEventTypeXidCriticalError)

struct fail { char fn[64]; int code; };

struct link { int present; int active; int remote_type; char remote_bus_id[STR]; };

struct dev {
    int is_mig;
    struct dev *parent;
    char uuid[STR];
    char name[STR];
    unsigned int minor;
    unsigned int brand;
    unsigned int arch;
    int cc_major, cc_minor;
    unsigned long long memory_total;
    char bus_id[STR];
    unsigned int pci_device_id, pci_subsystem_id;
    int has_numa; int numa_node;
    int mig_capable; unsigned int mig_current, mig_pending, mig_max;
    struct link links[MAX_LINKS]; int nlinks;
    /* MIG device fields */
    unsigned int gi, ci, gi_slices, ci_slices, multiprocessors;
    struct dev *migs[MAX_MIGS]; int nmigs;
    struct fail fails[MAX_FAILS]; int nfails;
    /* health (GPUs only) */
    int events_none; unsigned long long events;   /* supported nvmlEventType mask */
    int has_retirement; unsigned int retired_pending;
    int has_remapping; unsigned int remap_corr, remap_unc, remap_pending, remap_failure;
    int lost;                                      /* fallen off the bus */
};

/* One queued event, as nvmlEventSetWait hands it out. */
struct event {
    struct dev *gpu;
    unsigned long long type, data;
    unsigned int gi, ci;
};

/* An nvmlEventSet_t points at one of these. */
struct evset {
    int used;
    unsigned long long mask[MAX_GPUS];  /* registered event types, by GPU index */
    struct event queue[MAX_QUEUED]; int head, count;
};

static struct {
    int loaded;
    int refcount;
    char driver_version[STR];
    int cuda_version;
    int init_error;
    struct fail fails[MAX_FAILS]; int nfails;
    struct dev gpus[MAX_GPUS]; int ngpus;
    struct dev migs[MAX_GPUS * MAX_MIGS]; int nmigs;
    struct evset sets[MAX_SETS];
    char events_path[4096]; long events_offset; int events_line;
    int broken;  /* a bad events line: every later call answers NVML_ERROR_UNKNOWN */
} node;

/* Every entry point holds this from its first check to its return. */
static pthread_mutex_t mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

static void release_mu(int *unused)
{
    (void)unused;
    pthread_mutex_unlock(&mu);
}

#define HOLD_LOCK()                                                                \
    pthread_mutex_lock(&mu);                                                       \
    int _held __attribute__((cleanup(release_mu), unused)) = 1

/* ---- configuration parsing --------------------------------------------------------- */

static char conf_path[4096];
static int conf_line;

static int conf_error(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fake_nvml: %s:%d: ", conf_path, conf_line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

static int add_fail(struct fail *fails, int *n, const char *rest)
{
    if (*n >= MAX_FAILS)
        return conf_error("too many 'fail' lines");
    if (sscanf(rest, "%63s %d", fails[*n].fn, &fails[*n].code) != 2)
        return conf_error("expected 'fail <nvml function> <return code>'");
    (*n)++;
    return 0;
}

static int copy_str(char *dst, const char *src)
{
    if (strlen(src) >= STR)
        return conf_error("value too long");
    strcpy(dst, src);
    return 0;
}

/* One "key value" line inside a 'gpu' or 'mig' section. */
static int device_key(struct dev *d, const char *key, const char *rest)
{
    if (!strcmp(key, "uuid"))
        return copy_str(d->uuid, rest);
    if (!strcmp(key, "name"))
        return copy_str(d->name, rest);
    if (!strcmp(key, "memory_total"))
        return sscanf(rest, "%llu", &d->memory_total) == 1 ? 0 : conf_error("bad memory_total");
    if (!strcmp(key, "fail"))
        return add_fail(d->fails, &d->nfails, rest);
    if (d->is_mig) {
        if (!strcmp(key, "gi"))
            return sscanf(rest, "%u", &d->gi) == 1 ? 0 : conf_error("bad gi");
        if (!strcmp(key, "ci"))
            return sscanf(rest, "%u", &d->ci) == 1 ? 0 : conf_error("bad ci");
        if (!strcmp(key, "slices"))
            return sscanf(rest, "%u %u", &d->gi_slices, &d->ci_slices) == 2
                       ? 0 : conf_error("expected 'slices <gi slices> <ci slices>'");
        if (!strcmp(key, "multiprocessors"))
            return sscanf(rest, "%u", &d->multiprocessors) == 1 ? 0 : conf_error("bad count");
        return conf_error("unknown mig key '%s'", key);
    }
    if (!strcmp(key, "minor"))
        return sscanf(rest, "%u", &d->minor) == 1 ? 0 : conf_error("bad minor");
    if (!strcmp(key, "events")) {
        if (!strcmp(rest, "none")) {
            d->events_none = 1;
            return 0;
        }
        return sscanf(rest, "%llx", &d->events) == 1
                   ? 0 : conf_error("expected 'events none' or 'events <hex event type mask>'");
    }
    if (!strcmp(key, "page_retirement")) {
        d->has_retirement = 1;
        return sscanf(rest, "%u", &d->retired_pending) == 1 && d->retired_pending <= 1
                   ? 0 : conf_error("expected 'page_retirement <pending 0|1>'");
    }
    if (!strcmp(key, "row_remapping")) {
        d->has_remapping = 1;
        return sscanf(rest, "%u %u %u %u", &d->remap_corr, &d->remap_unc, &d->remap_pending,
                      &d->remap_failure) == 4
                   ? 0 : conf_error("expected 'row_remapping <correctable> <uncorrectable> "
                                    "<pending 0|1> <failure 0|1>'");
    }
    if (!strcmp(key, "brand"))
        return sscanf(rest, "%u", &d->brand) == 1 ? 0 : conf_error("bad brand");
    if (!strcmp(key, "arch"))
        return sscanf(rest, "%u", &d->arch) == 1 ? 0 : conf_error("bad arch");
    if (!strcmp(key, "compute_capability"))
        return sscanf(rest, "%d.%d", &d->cc_major, &d->cc_minor) == 2
                   ? 0 : conf_error("expected 'compute_capability <major>.<minor>'");
    if (!strcmp(key, "pci"))
        return sscanf(rest, "%95s %x %x", d->bus_id, &d->pci_device_id, &d->pci_subsystem_id) == 3
                   ? 0 : conf_error("expected 'pci <bus id> <device id> <subsystem id>'");
    if (!strcmp(key, "numa_node")) {
        d->has_numa = 1;
        return sscanf(rest, "%d", &d->numa_node) == 1 ? 0 : conf_error("bad numa_node");
    }
    if (!strcmp(key, "mig_mode")) {
        d->mig_capable = 1;
        return sscanf(rest, "%u %u %u", &d->mig_current, &d->mig_pending, &d->mig_max) == 3
                   ? 0 : conf_error("expected 'mig_mode <current> <pending> <max mig devices>'");
    }
    if (!strcmp(key, "nvlink")) {
        unsigned int idx;
        char type[16], bus[STR];
        int active;
        if (sscanf(rest, "%u %d %15s %95s", &idx, &active, type, bus) != 4 || idx >= MAX_LINKS)
            return conf_error("expected 'nvlink <link> <active 0|1> <gpu|switch> <remote bus id>'");
        struct link *l = &d->links[idx];
        l->present = 1;
        l->active = active;
        l->remote_type = !strcmp(type, "gpu") ? 0 : !strcmp(type, "switch") ? 2 : -1;
        if (l->remote_type < 0)
            return conf_error("nvlink remote type must be gpu or switch");
        strcpy(l->remote_bus_id, bus);
        if ((int)idx + 1 > d->nlinks)
            d->nlinks = (int)idx + 1;
        return 0;
    }
    return conf_error("unknown gpu key '%s'", key);
}

static int load_config(void)
{
    const char *env = getenv("FAKE_NVML_CONFIG");
    if (env && *env) {
        snprintf(conf_path, sizeof(conf_path), "%s", env);
    } else {
        Dl_info info;
        if (!dladdr((void *)load_config, &info) || !info.dli_fname)
            return -1;
        snprintf(conf_path, sizeof(conf_path), "%s", info.dli_fname);
        char *slash = strrchr(conf_path, '/');
        size_t dir = slash ? (size_t)(slash - conf_path + 1) : 0;
        snprintf(conf_path + dir, sizeof(conf_path) - dir, "fake_nvml.conf");
    }
    FILE *f = fopen(conf_path, "r");
    if (!f) {
        conf_line = 0;
        return conf_error("cannot open: %s", strerror(errno));
    }
    memset(&node, 0, sizeof(node));
    struct dev *cur = NULL;
    char line[512];
    int rv = 0;
    for (conf_line = 1; rv == 0 && fgets(line, sizeof(line), f); conf_line++) {
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *end = line + strlen(line);
        while (end > line && (end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t'))
            *--end = '\0';
        char *key = line + strspn(line, " \t");
        if (!*key)
            continue;
        char *rest = key + strcspn(key, " \t");
        if (*rest)
            *rest++ = '\0';
        rest += strspn(rest, " \t");

        if (!strcmp(key, "gpu")) {
            if (node.ngpus >= MAX_GPUS) { rv = conf_error("too many gpus"); break; }
            cur = &node.gpus[node.ngpus++];
            cur->events = DEFAULT_EVENTS;
        } else if (!strcmp(key, "mig")) {
            struct dev *gpu = cur && cur->is_mig ? cur->parent : cur;
            if (!gpu) { rv = conf_error("'mig' before any 'gpu'"); break; }
            if (gpu->nmigs >= MAX_MIGS) { rv = conf_error("too many mig devices"); break; }
            cur = &node.migs[node.nmigs++];
            cur->is_mig = 1;
            cur->parent = gpu;
            gpu->migs[gpu->nmigs++] = cur;
        } else if (cur) {
            rv = device_key(cur, key, rest);
        } else if (!strcmp(key, "driver_version")) {
            rv = copy_str(node.driver_version, rest);
        } else if (!strcmp(key, "cuda_version")) {
            rv = sscanf(rest, "%d", &node.cuda_version) == 1 ? 0 : conf_error("bad cuda_version");
        } else if (!strcmp(key, "init_error")) {
            rv = sscanf(rest, "%d", &node.init_error) == 1 ? 0 : conf_error("bad init_error");
        } else if (!strcmp(key, "fail")) {
            rv = add_fail(node.fails, &node.nfails, rest);
        } else {
            rv = conf_error("unknown key '%s'", key);
        }
    }
    fclose(f);
    snprintf(node.events_path, sizeof(node.events_path), "%s", conf_path);
    char *slash = strrchr(node.events_path, '/');
    size_t dir = slash ? (size_t)(slash - node.events_path + 1) : 0;
    snprintf(node.events_path + dir, sizeof(node.events_path) - dir, "fake_nvml.events");
    return rv;
}

/* ---- helpers ---------------------------------------------------------------------- */

static int injected(const struct fail *fails, int n, const char *fn)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(fails[i].fn, fn))
            return fails[i].code;
    return NVML_SUCCESS;
}

static struct dev *gpu_of(struct dev *d) { return d->is_mig ? d->parent : d; }

static struct dev *gpu_by_uuid(const char *uuid)
{
    for (int i = 0; i < node.ngpus; i++)
        if (!strcmp(node.gpus[i].uuid, uuid))
            return &node.gpus[i];
    return NULL;
}

/* ---- injected events ---------------------------------------------------------------- */

static int event_error(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fake_nvml: %s:%d: ", node.events_path, node.events_line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    node.broken = 1;
    return -1;
}

/* Queue an event in every set where `gpu` is registered for its type; a full queue
 * drops the event, as the driver's bounded queue does. */
static void deliver(struct dev *gpu, unsigned long long type, unsigned long long data,
                    unsigned int gi, unsigned int ci)
{
    int idx = (int)(gpu - node.gpus);
    for (int i = 0; i < MAX_SETS; i++) {
        struct evset *set = &node.sets[i];
        if (!set->used || !(set->mask[idx] & type) || set->count == MAX_QUEUED)
            continue;
        struct event *e = &set->queue[(set->head + set->count++) % MAX_QUEUED];
        e->gpu = gpu;
        e->type = type;
        e->data = data;
        e->gi = gi;
        e->ci = ci;
    }
}

/* A GPU reset: a lost GPU answers again, pending retirements and remappings take effect. */
static void reset_gpu(struct dev *gpu)
{
    gpu->lost = 0;
    gpu->retired_pending = 0;
    if (gpu->remap_pending) {
        gpu->remap_pending = 0;
        gpu->remap_unc++;
    }
}

/* One line of the events file. */
static int apply_event(char *line)
{
    char what[16], uuid[STR];
    int n = 0;
    if (sscanf(line, "%15s %95s %n", what, uuid, &n) != 2)
        return event_error("expected '<xid|dbe|lost|back|reset> <GPU uuid> ...'");
    const char *rest = line + n;
    struct dev *gpu = gpu_by_uuid(uuid);
    if (!gpu)
        return event_error("no GPU %s in the node description", uuid);
    if (!strcmp(what, "xid")) {
        unsigned long long xid;
        unsigned int gi, ci;
        int got = sscanf(rest, "%llu %u %u", &xid, &gi, &ci);
        if (got == 1)
            gi = ci = NVML_GPU_INSTANCE_ID_ANY;
        else if (got != 3)
            return event_error("expected 'xid <GPU uuid> <xid> [<gi> <ci>]'");
        deliver(gpu, nvmlEventTypeXidCriticalError, xid, gi, ci);
    } else if (*rest) {
        return event_error("unexpected '%s' after '%s %s'", rest, what, uuid);
    } else if (!strcmp(what, "dbe")) {
        /* Uncorrectable memory errors retire the page (before Ampere) or remap the row
         * (Ampere and later) at the next GPU reset. */
        if (gpu->has_retirement)
            gpu->retired_pending = 1;
        if (gpu->has_remapping)
            gpu->remap_pending = 1;
        deliver(gpu, nvmlEventTypeDoubleBitEccError, 0,
                NVML_GPU_INSTANCE_ID_ANY, NVML_COMPUTE_INSTANCE_ID_ANY);
    } else if (!strcmp(what, "lost")) {
        gpu->lost = 1;
    } else if (!strcmp(what, "back")) {
        gpu->lost = 0;
    } else if (!strcmp(what, "reset")) {
        reset_gpu(gpu);
    } else {
        return event_error("unknown event '%s' (xid, dbe, lost, back, reset)", what);
    }
    return 0;
}

/* Apply the complete lines appended to the events file since the last look. */
static void poll_events(void)
{
    if (node.broken)
        return;
    FILE *f = fopen(node.events_path, "r");
    if (!f)
        return;
    char line[512];
    if (fseek(f, node.events_offset, SEEK_SET) == 0) {
        while (fgets(line, sizeof(line), f)) {
            size_t len = strlen(line);
            if (!len || line[len - 1] != '\n')
                break;  /* a line still being written: read it next time */
            node.events_offset += (long)len;
            node.events_line++;
            char *hash = strchr(line, '#');
            if (hash)
                *hash = '\0';
            char *start = line + strspn(line, " \t\n");
            if (*start && apply_event(start) < 0)
                break;
        }
    }
    fclose(f);
}

/* Entry checks. The ENTER_* macros take the lock until the function returns. */
#define CHECK_SYSTEM(fn)                                                           \
    do {                                                                           \
        if (node.refcount <= 0) return NVML_ERROR_UNINITIALIZED;                   \
        poll_events();                                                             \
        if (node.broken) return NVML_ERROR_UNKNOWN;                                \
        int _c = injected(node.fails, node.nfails, fn);                            \
        if (_c) return _c;                                                         \
    } while (0)

#define ENTER_SYSTEM()                                                             \
    HOLD_LOCK();                                                                   \
    CHECK_SYSTEM(__func__)

#define ENTER_DEVICE(d)                                                            \
    ENTER_SYSTEM();                                                                \
    do {                                                                           \
        if (!(d)) return NVML_ERROR_INVALID_ARGUMENT;                              \
        if (gpu_of(d)->lost) return NVML_ERROR_GPU_IS_LOST;                        \
        int _d = injected((d)->fails, (d)->nfails, __func__);                      \
        if (_d) return _d;                                                         \
    } while (0)

static nvmlReturn_t put_str(char *buf, unsigned int len, const char *s)
{
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, s);
    return NVML_SUCCESS;
}

static struct dev *gpu_by_bus_id(const char *bus_id)
{
    for (int i = 0; i < node.ngpus; i++)
        if (!strcasecmp(node.gpus[i].bus_id, bus_id))
            return &node.gpus[i];
    return NULL;
}

static void fill_pci(nvmlPciInfo_t *pci, const char *bus_id, unsigned int device_id,
                     unsigned int subsystem_id)
{
    memset(pci, 0, sizeof(*pci));
    sscanf(bus_id, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    snprintf(pci->busId, sizeof(pci->busId), "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0",
             pci->domain, pci->bus, pci->device);
    pci->pciDeviceId = device_id;
    pci->pciSubSystemId = subsystem_id;
}

typedef struct dev *nvmlDevice_t;

/* ---- exported NVML API -------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    HOLD_LOCK();
    if (!node.loaded) {
        if (load_config() < 0)
            return NVML_ERROR_UNKNOWN;
        node.loaded = 1;
    }
    if (node.init_error)
        return node.init_error;
    node.refcount++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    HOLD_LOCK();
    if (node.refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (--node.refcount == 0)
        node.loaded = 0;  /* the next nvmlInit re-reads the description and events */
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER_SYSTEM();
    return put_str(version, length, node.driver_version);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    ENTER_SYSTEM();
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = node.cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    ENTER_SYSTEM();
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = node.cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    ENTER_SYSTEM();
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)node.ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER_SYSTEM();
    if (!device || index >= (unsigned int)node.ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    if (node.gpus[index].lost) return NVML_ERROR_GPU_IS_LOST;
    *device = &node.gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length)
{
    ENTER_DEVICE(d);
    return put_str(uuid, length, d->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length)
{
    ENTER_DEVICE(d);
    return put_str(name, length, d->name);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor)
{
    ENTER_DEVICE(d);
    if (d->is_mig || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = d->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t d, unsigned int *brand)
{
    ENTER_DEVICE(d);
    if (!brand) return NVML_ERROR_INVALID_ARGUMENT;
    *brand = d->is_mig ? d->parent->brand : d->brand;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t d, unsigned int *arch)
{
    ENTER_DEVICE(d);
    if (!arch) return NVML_ERROR_INVALID_ARGUMENT;
    *arch = d->is_mig ? d->parent->arch : d->arch;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    ENTER_DEVICE(d);
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    const struct dev *g = d->is_mig ? d->parent : d;
    *major = g->cc_major;
    *minor = g->cc_minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory)
{
    ENTER_DEVICE(d);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = d->memory_total;
    memory->used = 0;
    memory->free = d->memory_total;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    ENTER_DEVICE(d);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const struct dev *g = d->is_mig ? d->parent : d;
    fill_pci(pci, g->bus_id, g->pci_device_id, g->pci_subsystem_id);
    return NVML_SUCCESS;
}

#ifndef FAKE_NVML_OMIT_NUMA
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *numa)
{
    ENTER_DEVICE(d);
    if (!numa) return NVML_ERROR_INVALID_ARGUMENT;
    const struct dev *g = d->is_mig ? d->parent : d;
    if (!g->has_numa) return NVML_ERROR_NOT_SUPPORTED;
    *numa = (unsigned int)g->numa_node;
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    ENTER_DEVICE(d);
    if (!current || !pending || d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *current = d->mig_current;
    *pending = d->mig_pending;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count)
{
    ENTER_DEVICE(d);
    if (!count || d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *count = d->mig_capable ? d->mig_max : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index,
                                                 nvmlDevice_t *mig)
{
    ENTER_DEVICE(d);
    if (!mig || d->is_mig || !d->mig_capable || index >= d->mig_max)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->mig_current) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= (unsigned int)d->nmigs) return NVML_ERROR_NOT_FOUND;
    *mig = d->migs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id)
{
    ENTER_DEVICE(d);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *id = d->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id)
{
    ENTER_DEVICE(d);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *id = d->ci;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t d, nvmlDeviceAttributes_t *attrs)
{
    ENTER_DEVICE(d);
    if (!attrs) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    memset(attrs, 0, sizeof(*attrs));
    attrs->multiprocessorCount = d->multiprocessors;
    attrs->gpuInstanceSliceCount = d->gi_slices;
    attrs->computeInstanceSliceCount = d->ci_slices;
    attrs->memorySizeMB = d->memory_total / (1024ULL * 1024ULL);
    return NVML_SUCCESS;
}

static nvmlReturn_t link_of(nvmlDevice_t d, unsigned int link, const struct link **out)
{
    if (d->is_mig || !d->nlinks) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (unsigned int)d->nlinks || !d->links[link].present)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &d->links[link];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, unsigned int *active)
{
    ENTER_DEVICE(d);
    const struct link *l;
    nvmlReturn_t r = link_of(d, link, &l);
    if (r) return r;
    if (!active) return NVML_ERROR_INVALID_ARGUMENT;
    *active = (unsigned int)l->active;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link,
                                                 nvmlPciInfo_t *pci)
{
    ENTER_DEVICE(d);
    const struct link *l;
    nvmlReturn_t r = link_of(d, link, &l);
    if (r) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const struct dev *peer = gpu_by_bus_id(l->remote_bus_id);
    fill_pci(pci, l->remote_bus_id, peer ? peer->pci_device_id : 0x22A310DE, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t d, unsigned int link, int *type)
{
    ENTER_DEVICE(d);
    const struct link *l;
    nvmlReturn_t r = link_of(d, link, &l);
    if (r) return r;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    *type = l->remote_type;
    return NVML_SUCCESS;
}

/* ---- health: ECC page retirement, row remapping, events ---------------------------- */

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, nvmlEnableState_t *pending)
{
    ENTER_DEVICE(d);
    if (!pending) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig || !d->has_retirement) return NVML_ERROR_NOT_SUPPORTED;
    *pending = d->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure)
{
    ENTER_DEVICE(d);
    if (!corr || !unc || !pending || !failure) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig || !d->has_remapping) return NVML_ERROR_NOT_SUPPORTED;
    /* nvml.h: not supported on MIG-enabled GPUs with active instances */
    if (d->mig_current && d->nmigs) return NVML_ERROR_NOT_SUPPORTED;
    *corr = d->remap_corr;
    *unc = d->remap_unc;
    *pending = d->remap_pending;
    *failure = d->remap_failure;
    return NVML_SUCCESS;
}

typedef struct evset *nvmlEventSet_t;

/* nvmlEventSetWait_v2's nvmlEventData_t (R450 and later) */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* What the unversioned nvmlEventSetWait writes: the layout before the instance ids. */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} nvmlEventData_v1_t;

static int valid_set(nvmlEventSet_t set)
{
    return set >= node.sets && set < node.sets + MAX_SETS && set->used;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    ENTER_DEVICE(d);
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    /* events are reported on the GPU, never per MIG device handle */
    if (d->is_mig || d->events_none) return NVML_ERROR_NOT_SUPPORTED;
    *types = d->events;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types,
                                      nvmlEventSet_t set)
{
    ENTER_DEVICE(d);
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig || d->events_none || (types & ~d->events)) return NVML_ERROR_NOT_SUPPORTED;
    set->mask[d - node.gpus] |= types;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER_SYSTEM();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < MAX_SETS; i++) {
        if (!node.sets[i].used) {
            memset(&node.sets[i], 0, sizeof(node.sets[i]));
            node.sets[i].used = 1;
            *set = &node.sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_MEMORY;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER_SYSTEM();
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    set->used = 0;
    return NVML_SUCCESS;
}

/* One look at `set`: an event (SUCCESS), a lost GPU in it (GPU_IS_LOST), or nothing yet
 * (TIMEOUT). */
static nvmlReturn_t take_event(const char *fn, nvmlEventSet_t set, struct event *out)
{
    HOLD_LOCK();
    CHECK_SYSTEM(fn);
    if (!valid_set(set) || !out) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < node.ngpus; i++)
        if (set->mask[i] && node.gpus[i].lost)
            return NVML_ERROR_GPU_IS_LOST;
    if (!set->count) return NVML_ERROR_TIMEOUT;
    *out = set->queue[set->head];
    set->head = (set->head + 1) % MAX_QUEUED;
    set->count--;
    return NVML_SUCCESS;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Look every 5 ms, the lock released in between, until an answer or `timeoutms`. */
static nvmlReturn_t wait_event(const char *fn, nvmlEventSet_t set, struct event *out,
                               unsigned int timeoutms)
{
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        nvmlReturn_t r = take_event(fn, set, out);
        long long left = deadline - now_ms();
        if (r != NVML_ERROR_TIMEOUT || left <= 0)
            return r;
        struct timespec nap = {0, (left < 5 ? left : 5) * 1000000L};
        nanosleep(&nap, NULL);
    }
}

#ifndef FAKE_NVML_OMIT_EVENT_WAIT_V2
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    struct event e = {0};
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = wait_event(__func__, set, &e, timeoutms);
    if (r) return r;
    data->device = e.gpu;
    data->eventType = e.type;
    data->eventData = e.data;
    data->gpuInstanceId = e.gi;
    data->computeInstanceId = e.ci;
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeoutms)
{
    struct event e = {0};
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = wait_event(__func__, set, &e, timeoutms);
    if (r) return r;
    data->device = e.gpu;
    data->eventType = e.type;
    data->eventData = e.data;
    return NVML_SUCCESS;
}
