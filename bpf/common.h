/* Shared definitions of the allocsampler BPF programs (bcc dialect).
 *
 * Compile-time parameters (set by sampler/bpf/loader.py with -D):
 *   SAMPLE_MEAN   mean bytes between samples (Poisson process over requested bytes)
 *   STACK_BYTES   user stack bytes copied per sampled event (multiple of STACK_CHUNK)
 *   PY_MAX        Python frames captured per sampled event
 *   LIVE_MAX      capacity of the sampled-live-address table
 *   RINGBUF_PAGES ring buffer size in pages
 *   VM_EVENTS_PER_S unsampled syscall events sent per process per VM window (0: all)
 *
 * Values and layouts shared with user space are in abi.h (pasted before this file).
 */
#include <uapi/linux/ptrace.h>

#ifndef SAMPLE_MEAN
#define SAMPLE_MEAN (512 * 1024)
#endif
/* Map sizes: these defaults are compiled; the loader gives the configured sizes when it creates
 * the maps (sampler/bpf/objcache.py), so they are not compile flags. */
#define LIVE_MAX 262144
#define RINGBUF_PAGES 2048
#define UW_PROCS 1024
#ifndef VM_EVENTS_PER_S
#define VM_EVENTS_PER_S 2000
#endif




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
/* Processes being recorded; syscall tracepoints fire host-wide and check it. */
BPF_HASH(targets, u32, struct target, TARGETS_MAX);
/* forks registered by BPF over every family, alive now (FAMILIES_MAX) */
BPF_ARRAY(family_n, u64, 1);
/* Per process and CPU: allocator probe hits (the governor's cost estimate). Entries are created
 * by user space for attach-tier targets; the probes only add to them. `shift` is the process's
 * sampling-mean shift, copied to every CPU by user space: the allocation probes read it from
 * the entry they already look up, with no second lookup on their path. */
struct pid_hits {
    u64 alloc;
    u64 free;
    s32 shift;
    u32 pad;
};
BPF_PERCPU_HASH(pid_hits, u32, struct pid_hits, 4096);

/* CPython targets: per-process layout of the frame chain (sampler/python/runtime.py PyLayout), and
 * each thread's PyThreadState, filled from user space (the interpreter's "current thread"
 * pointer is NULL whenever the GIL is released, as in every torch op). */
BPF_HASH(pyprocs, u32, struct py_layout, 4096);
BPF_HASH(pythreads, u32, u64, 65536);
/* Per process: stack bytes worth copying, learnt in user space from how deep its walks go (a
 * smaller record per sample); absent: STACK_BYTES. */
BPF_HASH(stack_hint, u32, u32, 4096);

/* Per-CPU scratch for stack records (too big for the BPF stack), with a busy flag: a program
 * preempted on this CPU must not have its record overwritten by the next one. */
BPF_PERCPU_ARRAY(stack_scratch, struct ev_stack, 1);
BPF_PERCPU_ARRAY(scratch_busy, u64, 1);

/* Per-process accounting: drops, samples drawn and the VM event budget's window. Touched on
 * sampled and syscall paths only, never by an unsampled allocation. */
struct drops {
    u64 lost_events;
    u64 live_full;
    u64 vm_suppressed;   /* unsampled syscall events not sent (over budget) */
    u64 sampled;         /* samples drawn (the sample-rate cap's measure, sampler/control/sample_rate.py) */
    u64 vm_window;       /* ktime >> VM_WINDOW_SHIFT of the current window */
    u64 vm_sent;         /* unsampled syscall events sent in it */
};
BPF_HASH(drops, u32, struct drops, 4096);

static __always_inline void count(u32 idx, u64 n)
{
    u64 *c = counters.lookup(&idx);
    if (c)
        *c += n;
}

/* Returns the process's sampling-mean shift. */
static __always_inline s32 count_hit(u32 pid, bool is_free)
{
    struct pid_hits *h = pid_hits.lookup(&pid);
    if (!h)
        return 0;
    if (is_free)
        h->free++;
    else
        h->alloc++;
    return h->shift;
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

/* An Exp(SAMPLE_MEAN) draw in 1/2^SHIFT_MAX bytes: -ln(U) * mean with U uniform in (0, 1], computed as
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
    return c > 0 ? c << SHIFT_MAX : 1;       /* in 1/2^SHIFT_MAX bytes (see sample_bytes) */
}

static __always_inline void count_sampled(u32 pid)
{
    count(C_SAMPLED, 1);
    struct drops zero = {};
    struct drops *d = drops.lookup_or_try_init(&pid, &zero);
    if (d)
        __sync_fetch_and_add(&d->sampled, 1);
}

/* Poisson sampling over requested bytes, decided at allocation entry. Returns the unbiased
 * weight (size / (1 - exp(-size/mean)) bytes) of a sampled allocation, 0 if not sampled, with
 * mean = SAMPLE_MEAN * 2^shift, the process's own mean.
 * The countdown is per CPU and shared by all processes: an allocation consumes size / 2^shift
 * of it (in 1/2^SHIFT_MAX bytes, exact). Because the exponential is memoryless, every allocation,
 * whichever process or CPU it runs on and whatever the means were before, is sampled
 * independently with probability 1 - exp(-size/mean): weights stay unbiased when a mean changes. */
static __always_inline u64 sample_bytes(u32 pid, u64 size, s32 shift)
{
    u32 zero = 0;
    s64 *cd = countdown.lookup(&zero);
    if (!cd || size == 0)
        return 0;
    if (shift < SHIFT_MIN)
        shift = SHIFT_MIN;
    if (shift > SHIFT_MAX)
        shift = SHIFT_MAX;
    u64 mean = shift >= 0 ? (u64)SAMPLE_MEAN << shift : (u64)SAMPLE_MEAN >> -shift;
    if (size >= (u64)WTAB_MAX_X * mean) {      /* sampled for sure (p > 1 - 4e-11) */
        *cd = draw_countdown();
        count_sampled(pid);
        return size;
    }
    s64 c = *cd;
    if (c == 0)
        c = draw_countdown();
    /* size * 2^(SHIFT_MAX - shift), exact; no overflow: size < 24 * mean */
    c -= (s64)((size << (SHIFT_MAX - SHIFT_MIN)) >> (shift - SHIFT_MIN));
    if (c > 0) {
        *cd = c;
        return 0;
    }
    *cd = draw_countdown();
    count_sampled(pid);

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
    return (mean * h) >> WTAB_SHIFT;
}

/* Wake-ups: the reader is woken once rb_wake[1] bytes (an eighth of the ring buffer, set at load)
 * wait to be read, not at every record; its poll's timeout bounds how long a record waits
 * otherwise. A wake-up (and a pass of the recorder's loop) per record cost the recorder more than
 * reading the records. rb_wake[0]: bytes written since the last wake-up. */
BPF_ARRAY(rb_wake, u64, 2);

static __always_inline u64 rb_flags(u64 len)
{
    u32 k_unread = 0, k_limit = 1;
    u64 *n = rb_wake.lookup(&k_unread), *limit = rb_wake.lookup(&k_limit);
    if (!n || !limit)
        return 0;
    if (__sync_fetch_and_add(n, len) + len < *limit)
        return BPF_RB_NO_WAKEUP;
    *n = 0;                 /* racing CPUs: a wake-up more or less */
    return BPF_RB_FORCE_WAKEUP;
}

/* Every header field is written (ring buffer memory is not zeroed; no padding exists). */
static __always_inline void init_hdr(struct ev_hdr *e, u8 type, u8 source, u16 op, u32 pid, u32 tid)
{
    e->type = type;
    e->source = source;
    e->op = op;
    e->pid = pid;
    e->tid = tid;
    e->pad = 0;
    e->flags = 0;
    e->ts = bpf_ktime_get_ns();
    e->addr = 0;
    e->size = 0;
    e->weight = 0;
    e->arg = 0;
    e->ret = 0;
}

static __always_inline struct ev_stack *scratch_acquire(void)
{
    u32 zero = 0;
    u64 *busy = scratch_busy.lookup(&zero);
    if (!busy || __sync_fetch_and_add(busy, 1)) {
        if (busy)
            __sync_fetch_and_add(busy, -1);
        return 0;
    }
    return stack_scratch.lookup(&zero);
}

static __always_inline void scratch_release(void)
{
    u32 zero = 0;
    u64 *busy = scratch_busy.lookup(&zero);
    if (busy)
        __sync_fetch_and_add(busy, -1);
}

/* The thread's Python frames, innermost first, into e->data; returns their number. */
static __always_inline u32 capture_python(struct ev_stack *e, u32 pid, u32 tid)
{
    struct py_layout *lp = pyprocs.lookup(&pid);
    if (!lp)
        return 0;
    struct py_layout L = *lp;
    u64 *tsp = pythreads.lookup(&tid);
    if (!tsp) {
        e->h.flags |= EVF_PY_MISS;
        count(C_PY_MISS, 1);
        return 0;
    }
    u64 f = 0;
    if (bpf_probe_read_user(&f, sizeof(f), (void *)(*tsp + L.tstate_frame)))
        return 0;
    if (L.cframe_frame != 0xffff && f && bpf_probe_read_user(&f, sizeof(f), (void *)(f + L.cframe_frame)))
        return 0;
    u32 n = 0;
    for (u32 i = 0; i < PY_MAX; i++) {
        if (!f)
            return n;
        u64 *slot = (u64 *)(e->data + i * 16);
        u64 code = 0, instr = 0;
        u8 entry = 0;
        bpf_probe_read_user(&code, sizeof(code), (void *)(f + L.frame_code));
        bpf_probe_read_user(&instr, sizeof(instr), (void *)(f + L.frame_instr));
        if (L.frame_entry != 0xffff)
            bpf_probe_read_user(&entry, 1, (void *)(f + L.frame_entry));
        slot[0] = code | (u64)entry << 56;
        slot[1] = instr;
        n = i + 1;
        if (bpf_probe_read_user(&f, sizeof(f), (void *)(f + L.frame_back)))
            return n;
    }
    if (f)
        e->h.flags |= EVF_PY_TRUNC;
    return n;
}

/* Up to STACK_BYTES of the user stack from sp, stopping at the end of the stack mapping (or at
 * a page that is not resident). Returns the bytes copied, at e->data + off. */
static __always_inline u32 copy_stack(struct ev_stack *e, u32 off, u64 sp)
{
    if (off > PY_MAX * 16 + UW_FRAMES * 8)
        return 0;
    u32 pid = e->h.pid;
    u32 *hint = stack_hint.lookup(&pid);
    u32 limit = hint ? *hint : STACK_BYTES;
    u32 first = STACK_CHUNK - (sp & (STACK_CHUNK - 1));
    if (bpf_probe_read_user(e->data + off, first, (void *)sp))
        return 0;
    u32 n = first;
#pragma unroll
    for (int i = 0; i < STACK_BYTES / STACK_CHUNK - 1; i++) {
        if (n >= limit)
            break;
        if (bpf_probe_read_user(e->data + off + n, STACK_CHUNK, (void *)(sp + n)))
            break;
        n += STACK_CHUNK;
    }
    return n;
}

/* The innermost return address above sp that a uretprobe replaced with its trampoline, from the
 * thread's pending return instances in the kernel: another tool's uretprobe on the same function
 * puts one there in calls this recorder did not sample (the walk would end at the trampoline).
 * Without the offsets (RI_*: sampler/bpf/loader.py, from BTF) the caller's own record stays. */
static __always_inline void uretprobe_slot(struct ev_stack *e, u64 sp)
{
#ifdef RI_TASK_STRUCT_UTASK
    u64 ut = 0, ri = 0, slot = 0;
    bpf_probe_read_kernel(&ut, sizeof(ut), (void *)(bpf_get_current_task() + RI_TASK_STRUCT_UTASK));
    if (!ut)
        return;
    bpf_probe_read_kernel(&ri, sizeof(ri), (void *)(ut + RI_UPROBE_TASK_RETURN_INSTANCES));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (!ri)
            return;
        if (bpf_probe_read_kernel(&slot, sizeof(slot), (void *)(ri + RI_RETURN_INSTANCE_STACK)))
            return;
        if (slot >= sp) {           /* below sp: a frame left by longjmp, not yet reclaimed */
            e->ra_slot = slot;
            bpf_probe_read_kernel(&e->ra, sizeof(e->ra), (void *)(ri + RI_RETURN_INSTANCE_ORIG_RET_VADDR));
            return;
        }
        bpf_probe_read_kernel(&ri, sizeof(ri), (void *)(ri + RI_RETURN_INSTANCE_NEXT));
    }
#endif
}

/* Native unwinding in BPF: compact CFI rows per file (uw_rows, shared by every process that maps
 * the file) and each process's executable mappings (uw_procs), both from user space
 * (sampler/stacks/kernel_tables.py). The walk follows sampler/stacks/unwind.py rule for rule;
 * what it cannot follow (a file whose rows are not loaded, code in no known mapping, a signal
 * frame, an unsupported rule, more than UW_FRAMES frames) is handed over: the stack is copied
 * from that frame and user space goes on from there. */
/* BPF_F_MMAPABLE: user space writes a file's rows through a mapping, not an update per row */
BPF_F_TABLE("array", u32, struct uw_row, uw_rows, 1 << UW_ROWS_LOG2, 1U << 10);
BPF_HASH(uw_procs, u32, struct uw_proc, UW_PROCS);
BPF_ARRAY(uw_maps, struct uw_map, UW_PROCS * UW_MAPS);
BPF_F_TABLE("array", u32, u64, uw_pages, 1 << 20, 1U << 10);

/* Searches below step through powers of two from the largest down, unrolled, with no branch
 * but a lookup's null check: a branch the verifier cannot resolve stays pending until the end of
 * the program, and 64 frames' worth overflow its jump stack. `le` and the clamp are 0/1 by
 * arithmetic: every value compared is below 2^32, so a difference's sign bit is the comparison.
 * Each finds the last index in [lo, lo + n) whose key is <= the one sought (checked after). */
#define UW_NEG(x) ((u64)(x) >> 63)

/* The mapping holding addr (a process's maps are sorted by start), or 0. */
static __always_inline struct uw_map *uw_find_map(struct uw_proc *p, u64 addr)
{
    u32 n = p->n;
    u64 lo = (u64)p->slot * UW_MAPS;
    if (n == 0 || n > UW_MAPS)
        return 0;
    u64 last = lo + n - 1;
#pragma unroll
    for (int b = 7; b >= 0; b--) {           /* UW_MAPS = 2^8 */
        u64 mid = lo + (1u << b);
        mid -= UW_NEG(last - mid) * (mid - last);           /* min(mid, last) */
        u32 key = mid;
        struct uw_map *m = uw_maps.lookup(&key);
        if (!m)
            return 0;
        /* start <= addr, for 64-bit values: compared as the top and bottom 32 bits */
        u64 hi_a = addr >> 32, hi_s = m->start >> 32;
        u64 lt_hi = UW_NEG(hi_s - hi_a), eq_hi = 1 - UW_NEG(hi_s - hi_a) - UW_NEG(hi_a - hi_s);
        u64 le_lo = 1 - UW_NEG((addr & 0xffffffff) - (m->start & 0xffffffff));
        u64 le = lt_hi | (eq_hi & le_lo);
        lo += le * (mid - lo);
    }
    u32 key = lo;
    struct uw_map *m = uw_maps.lookup(&key);
    return m && addr >= m->start && addr < m->end ? m : 0;
}

/* The row in force at vaddr in m's file, or 0: its page's rows from the page index (the rows in
 * force at its start and at the next page's, as low | high << 32), then a
 * search of at most 2^UW_PAGE_ROWS_LOG2 rows. *over: the page has more (hand over). */
static __always_inline struct uw_row *uw_find_row(struct uw_map *m, u64 vaddr, u8 *over)
{
    u64 page = vaddr >> UW_PAGE_SHIFT;
    if (page < m->page_first)
        return 0;                                           /* before the first row: no CFI */
    page -= m->page_first;
    u64 lo, last;
    if (page >= m->page_n) {                                /* after the last row's page */
        lo = last = (u64)m->row_lo + m->row_n - 1;
    } else {
        u32 k = m->page_lo + page;
        u64 *range = uw_pages.lookup(&k);
        if (!range)
            return 0;
        lo = (u64)m->row_lo + (u32)*range;
        last = (u64)m->row_lo + (*range >> 32);
        if (last - lo >= (1u << UW_PAGE_ROWS_LOG2) || last < lo) {
            *over = 1;
            return 0;
        }
    }
    u32 pc = vaddr;
#pragma unroll
    for (int b = UW_PAGE_ROWS_LOG2 - 1; b >= 0; b--) {
        u64 mid = lo + (1u << b);
        mid -= UW_NEG(last - mid) * (mid - last);           /* min(mid, last) */
        u32 key = mid;
        struct uw_row *r = uw_rows.lookup(&key);
        if (!r)
            return 0;
        u64 le = 1 - UW_NEG((u64)pc - r->pc);               /* r->pc <= pc */
        lo += le * (mid - lo);
    }
    u32 key = lo;
    struct uw_row *r = uw_rows.lookup(&key);
    return r && r->pc <= pc ? r : 0;
}

static __always_inline int read_u64(u64 *v, u64 addr)
{
    return bpf_probe_read_user(v, sizeof(*v), (void *)addr);
}

/* The walk runs in its own program (walk.bpf.c), reached by tail call from every attach point that
 * samples stacks; a tail call needs the caller's program type and attach type, so there is one
 * walker per kind of caller, each verified once, not once per attach point. Each run walks
 * UW_STEP frames and tail-calls itself for the next ones, so that the verifier checks UW_STEP
 * frames' worth of code, not UW_FRAMES'. Between runs the walk's registers are kept here. */
#define UW_STEP 16
struct walk_state {
    u64 pc;          /* the next frame's pc (not yet written) */
    u64 sp;
    u64 bp;
    u32 n;           /* native pcs written */
    u32 off;         /* where they start in e->data: after the Python frames */
    u8 started;      /* 0: the caller just handed over (set up by the first run) */
    u8 mode;         /* WALK_* */
    u8 stop;         /* uw_stop */
    u8 bp_ok;
    u8 precise;
    u8 pad[3];
};
#define WALK_ON 0        /* walking (or done walking) the process's tables */
#define WALK_COPY 1      /* no tables for this process: the stack is copied from sp */
#define WALK_NONE 2      /* nothing to walk or copy */
BPF_PERCPU_ARRAY(walk_states, struct walk_state, 1);
BPF_PROG_ARRAY(walk_kprobe, 1);         /* uprobes through perf events (perf mode) */
BPF_PROG_ARRAY(walk_multi, 1);          /* uprobe_multi links */
BPF_PROG_ARRAY(walk_session, 1);        /* uprobe session links */
BPF_PROG_ARRAY(walk_tracepoint, 1);
BPF_PROG_ARRAY(walk_perf, 1);           /* sampled page faults */
#define WALKER_KPROBE 0
#define WALKER_MULTI 1
#define WALKER_SESSION 2
#define WALKER_TRACEPOINT 3
#define WALKER_PERF 4

/* A count read back from the record (map memory): the verifier sees an unknown in a range rather
 * than the constant each path computed it as, so that the states of the code after it merge
 * across paths (one per Python depth would multiply the walk's states by PY_MAX). */
static __always_inline u32 reread(u16 *field)
{
    asm volatile("" ::: "memory");
    return *(volatile u16 *)field;
}

/* A tail call into the walker of `walker`'s kind (a constant: the other branches compile away, and
 * a program must not refer to another kind's program array). Returns only when it failed. */
static __always_inline void walk_next(void *ctx, const int walker)
{
    if (walker == WALKER_MULTI)
        walk_multi.call(ctx, 0);
    else if (walker == WALKER_SESSION)
        walk_session.call(ctx, 0);
    else if (walker == WALKER_TRACEPOINT)
        walk_tracepoint.call(ctx, 0);
    else if (walker == WALKER_PERF)
        walk_perf.call(ctx, 0);
    else
        walk_kprobe.call(ctx, 0);
}

/* The scratch record `e` (acquired, header set) gets its stack from (ip, sp, bp) and is sent by
 * the walker of the caller's program type (`walker`: a constant), which also releases it.
 * Returns only when the walker could not run: the caller then sends the record without a stack. */
static __always_inline void walk_user(void *ctx, struct ev_stack *e, u64 ip, u64 sp, u64 bp, const int walker)
{
    u32 zero = 0;
    struct walk_state *w = walk_states.lookup(&zero);
    if (!w)
        return;
    e->ip = ip;
    e->sp = sp;
    e->bp = bp;
    w->started = 0;
    walk_next(ctx, walker);
}

/* First run: the Python frames, then the walk's starting registers. */
static __always_inline void walk_begin(struct ev_stack *e, struct walk_state *w)
{
    w->started = 1;
    uretprobe_slot(e, e->sp);
    e->npy = capture_python(e, e->h.pid, e->h.tid);
    u32 npy = reread(&e->npy);
    if (npy > PY_MAX)
        npy = PY_MAX;
    w->off = npy * 16;
    w->pc = e->ip;
    w->sp = e->sp;
    w->bp = e->bp;
    w->n = 0;
    w->bp_ok = 1;
    w->precise = 1;
    w->stop = UWS_NONE;
    e->npc = 0;
    e->stop = UWS_NONE;
    u32 pid = e->h.pid;
    w->mode = uw_procs.lookup(&pid) ? WALK_ON : WALK_COPY;
    e->pad = 1;
}

/* Walks up to UW_STEP native frames from the state into e->data + off (sampler/stacks/unwind.py
 * rule for rule). Returns whether frames are left to walk (the state then holds the next one). */
static __always_inline int walk_frames(struct ev_stack *e, struct walk_state *w)
{
    if (w->mode != WALK_ON)
        return 0;
    u32 pid = e->h.pid;
    struct uw_proc *proc = uw_procs.lookup(&pid);
    u32 off = w->off;
    u32 n = w->n;
    if (!proc || off > PY_MAX * 16 || n >= UW_FRAMES) {
        w->stop = UWS_NO_MAP;                  /* untracked meanwhile: hand over from here */
        return 0;
    }
    u64 pc = w->pc, sp = w->sp, bp = w->bp;
    u8 bp_ok = w->bp_ok, precise = w->precise, stop = UWS_DEEP;
    int more = 1;
    for (u32 j = 0; j < UW_STEP; j++) {
        u32 i = n;
        if (i >= UW_FRAMES)
            break;
        *(u64 *)(e->data + off + i * 8) = pc;
        n = i + 1;
        if (i == UW_FRAMES - 1) {
            more = 0;                       /* UWS_DEEP: user space goes on from this frame */
            break;
        }
        /* the flags as unknowns (anded with a 1 read back from the record): one verifier state
         * per frame, not one per combination of their values */
        asm volatile("" ::: "memory");
        u8 one = *(volatile u8 *)&e->pad;
        bp_ok &= one;
        precise &= one;
        u64 addr = pc - 1 + precise;
        struct uw_map *m = uw_find_map(proc, addr);
        if (!m) {
            stop = UWS_NO_MAP;
            more = 0;
            break;
        }
        if (m->row_lo == UW_PENDING) {
            stop = UWS_NO_TABLE;
            more = 0;
            break;
        }
        u8 kind = UWK_NO_CFI, bpk = UWB_UNKNOWN;
        s64 cfa_off = 0, bp8 = 0;
        u64 vaddr = addr - m->bias;
        if (m->row_n && vaddr < (1ULL << 32)) {
            u8 over = 0;
            struct uw_row *r = uw_find_row(m, vaddr, &over);
            if (over) {
                stop = UWS_UNSUPPORTED;
                more = 0;
                break;
            }
            if (r) {
                kind = r->kind & 15;
                bpk = r->kind >> 4;
                cfa_off = r->cfa_off;
                bp8 = (s8)r->bp_off8;
            }
        }
        u64 cfa, ra = 0;
        if (kind == UWK_ENTRY) {
            stop = UWS_ENTRY;
            more = 0;
            break;
        } else if (kind == UWK_NO_CFI) {
            /* frame pointers, if rbp points at or above sp */
            u64 saved = 0;
            if (!bp_ok || bp < sp || read_u64(&saved, bp) || read_u64(&ra, bp + 8)) {
                stop = UWS_NO_CFI;
                more = 0;
                break;
            }
            if (bp + 8 == e->ra_slot)
                ra = e->ra;
            if (ra == 0) {
                stop = UWS_ENTRY;
                more = 0;
                break;
            }
            cfa = bp + 16;
            bp = saved;
        } else if (kind == UWK_CFA_RSP || kind == UWK_PLT || kind == UWK_CFA_RBP || kind == UWK_CFA_DEREF_RBP) {
            if (kind == UWK_CFA_RSP) {
                cfa = sp + cfa_off;
            } else if (kind == UWK_PLT) {
                cfa = sp + cfa_off + ((s64)(addr & 15) >= bp8 ? 8 : 0);
                bpk = UWB_SAME;
            } else {
                if (!bp_ok) {
                    stop = UWS_BAD_FRAME;
                    more = 0;
                    break;
                }
                cfa = bp + cfa_off;
                if (kind == UWK_CFA_DEREF_RBP && read_u64(&cfa, cfa)) {
                    stop = UWS_READ;
                    more = 0;
                    break;
                }
            }
            if (cfa <= sp) {
                stop = UWS_BAD_FRAME;
                more = 0;
                break;
            }
            if (read_u64(&ra, cfa - 8)) {
                stop = UWS_READ;
                more = 0;
                break;
            }
            if (cfa - 8 == e->ra_slot)
                ra = e->ra;
            if (bpk == UWB_CFA) {
                bp_ok = !read_u64(&bp, cfa + bp8 * 8);
            } else if (bpk == UWB_RBP) {
                bp_ok = bp_ok && !read_u64(&bp, bp + bp8 * 8);
            } else if (bpk != UWB_SAME) {
                bp_ok = 0;
            }
            if (ra == 0) {
                stop = UWS_ENTRY;
                more = 0;
                break;
            }
        } else {
            stop = kind == UWK_SIGNAL ? UWS_SIGNAL : UWS_UNSUPPORTED;
            more = 0;
            break;
        }
        pc = ra;
        sp = cfa;
        precise = 0;
    }
    w->pc = pc;
    w->sp = sp;
    w->bp = bp;
    w->n = n;
    w->bp_ok = bp_ok;
    w->precise = precise;
    w->stop = stop;
    return more;
}

/* The next run could not be reached: the frame in the state is written and user space goes on
 * from it. */
static __always_inline void walk_cut(struct ev_stack *e, struct walk_state *w)
{
    u32 off = w->off, n = w->n;
    if (off <= PY_MAX * 16 && n < UW_FRAMES) {
        *(u64 *)(e->data + off + n * 8) = w->pc;
        w->n = n + 1;
    }
    w->stop = UWS_UNSUPPORTED;
}

/* After the walk: e->npc and e->stop set and, when handing over, e->sp/e->bp and the CONT flags.
 * Returns the stack pointer to copy from, or 0 when nothing is to be copied. */
static __always_inline u64 walk_end(struct ev_stack *e, struct walk_state *w)
{
    if (w->mode == WALK_COPY)
        return e->sp;
    if (w->mode != WALK_ON)
        return 0;
    u8 stop = w->stop;
    e->npc = w->n;
    e->stop = stop;
#ifdef UW_VERIFY
    /* tests compare the walk with user space's over a copy from the sample's own registers */
    return e->sp;
#endif
#ifdef UW_DEEP_FINAL
    if (stop == UWS_DEEP)
        return 0;                           /* user space keeps no more frames than these */
#endif
    if (stop < UWS_NO_TABLE)
        return 0;
    /* hand over: user space goes on from the last pc with these registers and a copy from sp */
    e->sp = w->sp;
    e->bp = w->bp;
    if (!w->bp_ok)
        e->h.flags |= EVF_CONT_BP_UNKNOWN;
    if (!w->precise)
        e->h.flags |= EVF_CONT_IMPRECISE;
    return w->sp;
}

/* The record's length once its stack part is complete (the header is set). */
static __always_inline u32 walk_length(struct ev_stack *e, u64 from)
{
    u32 npy = reread(&e->npy);
    if (npy > PY_MAX)
        npy = PY_MAX;
    u32 npc = reread(&e->npc);
    if (npc > UW_FRAMES)
        npc = UW_FRAMES;
    u32 n = 0;
    if (from) {
        n = copy_stack(e, npy * 16 + npc * 8, from);
        if (!n) {
            e->h.flags |= EVF_STACK_ERR;
            count(C_STACK_ERR, 1);
        }
    }
    e->npy = npy;
    e->stack_len = n;
    e->pad = 0;
    u32 len = offsetof(struct ev_stack, data) + npy * 16 + npc * 8 + n;
    return len > sizeof(*e) ? sizeof(*e) : len;
}

/* The user registers of the current task (at a syscall tracepoint). */
static __always_inline void user_regs(u64 *ip, u64 *sp, u64 *bp)
{
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(
        (struct task_struct *)bpf_get_current_task_btf());
    bpf_probe_read_kernel(ip, sizeof(*ip), &regs->ip);
    bpf_probe_read_kernel(sp, sizeof(*sp), &regs->sp);
    bpf_probe_read_kernel(bp, sizeof(*bp), &regs->bp);
}
