/* Shared definitions of the allocsampler BPF programs (bcc dialect).
 *
 * Compile-time parameters (set by sampler/bpf_loader.py with -D):
 *   SAMPLE_MEAN   mean bytes between samples (Poisson process over requested bytes)
 *   MAX_FRAMES    user stack frames captured per sampled event
 *   LIVE_MAX      capacity of the sampled-live-address table
 *   RINGBUF_PAGES ring buffer size in pages
 *
 * The event layout here is mirrored by sampler/events.py: change both together.
 */
#include <uapi/linux/ptrace.h>

#ifndef SAMPLE_MEAN
#define SAMPLE_MEAN (512 * 1024)
#endif
#ifndef MAX_FRAMES
#define MAX_FRAMES 127
#endif
#ifndef LIVE_MAX
#define LIVE_MAX 262144
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 2048
#endif

/* Weight table: h(x) = x / (1 - exp(-x)) at x = i / WTAB_STEPS, Q20 fixed point; filled from
 * sampler/weights.py before any probe is attached. Beyond WTAB_MAX_X the weight is the size. */
#define WTAB_STEPS 64
#define WTAB_MAX_X 24
#define WTAB_N (WTAB_STEPS * WTAB_MAX_X + 1)

enum ev_type { EV_ALLOC = 1, EV_FREE = 2, EV_VM = 3, EV_PROC = 4 };
enum ev_source { SRC_MALLOC = 1, SRC_MMAP = 2 };
enum ev_flags { EVF_FIRST_IS_IP = 1, EVF_SAMPLED = 2, EVF_STACK_ERR = 4 };

/* Allocator functions; values are shared with sampler/allocators.py (Fn). */
enum fn_id {
    FN_MALLOC = 1, FN_CALLOC, FN_REALLOC, FN_REALLOCARRAY, FN_POSIX_MEMALIGN, FN_ALIGNED_ALLOC,
    FN_MEMALIGN, FN_VALLOC, FN_PVALLOC, FN_NEW, FN_FREE, FN_DELETE,
};
/* Cookie flag: this function hands some calls to another probed function (glibc: realloc(NULL, n)
 * to malloc and realloc(p, 0) to free; memalign-family calls with alignment <= 16 to malloc).
 * Those calls are left to the inner probe, so that their bytes are counted once. */
#define FNF_DELEGATES 0x100

/* Memory-mapping syscalls. */
enum vm_op { VM_MMAP = 1, VM_MUNMAP, VM_MREMAP, VM_BRK, VM_MADVISE, VM_MPROTECT };
enum proc_op { PROC_FORK = 1, PROC_EXEC, PROC_EXIT };

/* Counters (per CPU, summed in user space). Hit counters are indexed by fn_id / 32 + vm_op. */
enum counter {
    C_LOST_EVENTS = 0,   /* ring buffer full */
    C_LIVE_FULL,         /* sampled allocation not tracked: live table full */
    C_PENDING_FULL,      /* per-thread pending table full */
    C_SAMPLED,
    C_STACK_ERR,
    C_HITS = 16,         /* + fn_id: allocator probe hits */
    C_VM_HITS = 48,      /* + vm_op: syscall hits by targets */
    C_N = 64,
};

struct ev_hdr {
    u8 type;
    u8 source;
    u16 op;          /* fn_id, vm_op or proc_op */
    u32 pid;
    u32 tid;
    u16 nframes;
    u16 flags;
    u64 ts;
    u64 addr;        /* ALLOC/FREE: block; VM: syscall address argument; PROC: child pid */
    u64 size;        /* requested bytes (VM: length) */
    u64 weight;      /* unbiased weight in bytes, sampled events only */
    u64 arg;         /* VM: prot | flags << 32, advice, or new length */
    u64 ret;         /* VM: syscall return value */
};

struct ev_stack {
    struct ev_hdr h;
    u64 sp_word;     /* syscall events: the word at the user sp (the return address into the
                      * caller of a leaf syscall wrapper, which a frame-pointer walk skips) */
    u64 frames[MAX_FRAMES];
};

struct live_key {
    u32 pid;
    u32 pad;
    u64 addr;
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(counters, u64, C_N);
BPF_PERCPU_ARRAY(countdown, s64, 1);
BPF_ARRAY(weight_tab, u64, WTAB_N + 1);
/* Sampled blocks that are still live, per process. A free of any other address emits nothing. */
BPF_HASH(live, struct live_key, u64, LIVE_MAX);
/* Processes being recorded (tgid -> flags); syscall tracepoints fire host-wide and check it. */
BPF_HASH(targets, u32, u32, 4096);

/* Per-process drop accounting (rare path only). */
struct drops {
    u64 lost_events;
    u64 live_full;
};
BPF_HASH(drops, u32, struct drops, 4096);

static __always_inline void count(u32 idx, u64 n)
{
    u64 *c = counters.lookup(&idx);
    if (c)
        *c += n;
}

static __always_inline void count_drop(u32 pid, u32 what)
{
    count(what, 1);
    struct drops zero = {};
    struct drops *d = drops.lookup_or_try_init(&pid, &zero);
    if (!d)
        return;
    if (what == C_LIVE_FULL)
        __sync_fetch_and_add(&d->live_full, 1);
    else
        __sync_fetch_and_add(&d->lost_events, 1);
}

/* An Exp(SAMPLE_MEAN) draw: -ln(U) * mean with U uniform in (0, 1], computed as
 * ln2 * (32 - log2(r)) for a 32-bit random r, log2 in Q16 by repeated squaring. */
static __always_inline s64 draw_countdown(void)
{
    u64 r = bpf_get_prandom_u32() | 1;
    u64 x = r;
    u32 k = 0;
    if (x >= (1ULL << 16)) { x >>= 16; k += 16; }
    if (x >= (1ULL << 8)) { x >>= 8; k += 8; }
    if (x >= (1ULL << 4)) { x >>= 4; k += 4; }
    if (x >= (1ULL << 2)) { x >>= 2; k += 2; }
    if (x >= (1ULL << 1)) { k += 1; }
    u64 m = r << (31 - k);          /* mantissa in [1, 2), Q31 */
    u64 frac = 0;
    /* branch-free: 2^16 paths through an unrolled branchy loop exhaust the verifier */
#pragma unroll
    for (int i = 0; i < 16; i++) {
        m = (m * m) >> 31;
        u64 b = m >> 32;
        m >>= b;
        frac |= b << (15 - i);
    }
    u64 nlog2 = ((u64)(32 - k) << 16) - frac;    /* -log2(U), Q16 */
    s64 c = (s64)((((u64)SAMPLE_MEAN * nlog2) >> 16) * 45426 >> 16);   /* x ln2 (Q16) */
    return c > 0 ? c : 1;
}

/* Poisson sampling over requested bytes, decided at allocation entry. Returns the unbiased
 * weight (size / (1 - exp(-size/mean)) bytes) of a sampled allocation, 0 if not sampled.
 * The countdown is per CPU: every allocation, whichever process or CPU it runs on, is sampled
 * independently with probability 1 - exp(-size/mean) because the exponential is memoryless. */
static __always_inline u64 sample_bytes(u64 size)
{
    u32 zero = 0;
    s64 *cd = countdown.lookup(&zero);
    if (!cd || size == 0)
        return 0;
    s64 c = *cd;
    if (c == 0)
        c = draw_countdown();
    c -= (s64)size;
    if (c > 0) {
        *cd = c;
        return 0;
    }
    *cd = draw_countdown();
    count(C_SAMPLED, 1);

    u64 mean = SAMPLE_MEAN;
    if (size >= (u64)WTAB_MAX_X * mean)
        return size;
    u64 xq = (size << 22) / mean;             /* x = size/mean in units of 1/64, Q16 */
    u32 i = xq >> 16;
    u32 j = i + 1;
    if (i >= WTAB_N - 1)
        return size;
    u64 *h0 = weight_tab.lookup(&i);
    u64 *h1 = weight_tab.lookup(&j);
    if (!h0 || !h1)
        return size;
    u64 h = *h0 + (((*h1 - *h0) * (xq & 0xffff)) >> 16);    /* h is increasing */
    return (mean * h) >> 20;
}

/* Every header field is written (ring buffer memory is not zeroed; no padding exists). */
static __always_inline void init_hdr(struct ev_hdr *e, u8 type, u8 source, u16 op, u32 pid, u32 tid)
{
    e->type = type;
    e->source = source;
    e->op = op;
    e->pid = pid;
    e->tid = tid;
    e->nframes = 0;
    e->flags = 0;
    e->ts = bpf_ktime_get_ns();
    e->addr = 0;
    e->size = 0;
    e->weight = 0;
    e->arg = 0;
    e->ret = 0;
}

/* Fill a stack event's frames with the user stack (frame-pointer walk by the kernel).
 * Kept behind this one function so that a later unwinder can replace the capture. */
static __always_inline void capture_stack(void *ctx, struct ev_stack *e)
{
    e->sp_word = 0;
    long n = bpf_get_stack(ctx, e->frames, sizeof(e->frames), BPF_F_USER_STACK);
    if (n < 0) {
        e->h.nframes = 0;
        e->h.flags |= EVF_STACK_ERR;
        count(C_STACK_ERR, 1);
    } else {
        e->h.nframes = n / sizeof(u64);
    }
}

/* At a syscall: the word at the user stack pointer, validated in user space. */
static __always_inline void capture_sp_word(struct ev_stack *e)
{
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(
        (struct task_struct *)bpf_get_current_task_btf());
    u64 sp = 0;
    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp);
    bpf_probe_read_user(&e->sp_word, sizeof(e->sp_word), (void *)sp);
}
