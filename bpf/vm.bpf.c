/* Memory-mapping syscalls of the targets: mmap, munmap, mremap, brk, madvise, mprotect.
 *
 * A call by a target emits a small EV_VM record at syscall exit (munmap: at entry). Anonymous
 * private read/write mmaps and the new extent of a mremap are also a sampled allocation source
 * (SRC_MMAP): sampled ones carry a weight and a user stack. Partial unmaps are resolved in user
 * space.
 *
 * Budget: a process that maps and unmaps faster than user space can read (an mmap storm runs
 * ~360k calls/s here) sends at most VM_EVENTS_PER_S unsampled records per window; the others are
 * counted per process (drops.vm_suppressed), not sent. A family's forks (--children) share
 * their root's budget (struct target.budget): a server forking per connection sends at most
 * VM_EVENTS_PER_S in all, not that much per child. Records that the outstanding table needs
 * always pass: sampled ones, the unmap or move of a sampled mapping (found by its start in
 * `vm_live`), and executable file mappings (dlopen: user space looks for new allocators).
 * Sampled records are bounded by the process's sampling mean, raised in user space when they
 * come too fast (sampler/control/sample_rate.py).
 */

#define MAP_SHARED_ 0x01
#define MAP_PRIVATE_ 0x02
#define MAP_ANONYMOUS_ 0x20

#define PROT_EXEC_ 0x04

struct vm_args {
    u64 addr;
    u64 len;
    u64 arg;
    u32 op;
    s32 shift;       /* the process's sampling-mean shift */
    u32 budget;      /* whose budget it spends (struct target) */
    u32 pad;
};

BPF_HASH(vm_pending, u32, struct vm_args, 16384);
/* Sampled mappings by start address -> length, so that their unmap passes the budget. */
BPF_HASH(vm_live, struct live_key, u64, 16384);

/* Whether an unsampled record of this process may be sent in the current window. */
static __always_inline bool vm_admit(u32 pid)
{
    if (VM_EVENTS_PER_S == 0)
        return true;
    struct drops zero = {};
    struct drops *d = drops.lookup_or_try_init(&pid, &zero);
    if (!d)
        return true;
    u64 w = bpf_ktime_get_ns() >> VM_WINDOW_SHIFT;
    if (d->vm_window != w) {         /* a race between threads costs a few records, no more */
        d->vm_window = w;
        d->vm_sent = 0;
    }
    if (d->vm_sent >= VM_EVENTS_PER_S) {
        __sync_fetch_and_add(&d->vm_suppressed, 1);
        count(C_VM_SUPPRESSED, 1);
        return false;
    }
    __sync_fetch_and_add(&d->vm_sent, 1);
    return true;
}

/* The unmap of [addr, addr + len) starts at a sampled mapping: forget it (or its unmapped head),
 * and say so (the record must pass). */
static __always_inline bool vm_live_unmap(u32 pid, u64 addr, u64 len)
{
    struct live_key k = {.pid = pid, .addr = addr};
    u64 *lp = vm_live.lookup(&k);
    if (!lp)
        return false;
    u64 have = *lp;
    vm_live.delete(&k);
    if (len < have) {
        struct live_key rest = {.pid = pid, .addr = addr + len};
        u64 left = have - len;
        vm_live.update(&rest, &left);
    }
    return true;
}

static __always_inline int vm_enter(u32 op, u64 addr, u64 len, u64 arg)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    struct target *tg = targets.lookup(&pid);
    if (!tg)
        return 0;
    count(C_VM_HITS + op, 1);
    if (op == VM_MUNMAP) {
        /* reported at entry: once the range is free another thread's mmap may get it, and its
         * event must come after this one (a failing munmap is rare: it is taken as done) */
        if (!vm_live_unmap(pid, addr, len) && !vm_admit(tg->budget ? tg->budget : pid))
            return 0;
        struct ev_hdr *h = events.ringbuf_reserve(sizeof(struct ev_hdr));
        if (!h) {
            count_drop(pid, C_LOST_EVENTS);
            return 0;
        }
        init_hdr(h, EV_VM, SRC_MMAP, op, pid, tid);
        h->flags = EVF_FIRST_IS_IP;
        h->addr = addr;
        h->size = len;
        events.ringbuf_submit(h, rb_flags(sizeof(*h)));
        return 0;
    }
    struct vm_args v = {.addr = addr, .len = len, .arg = arg, .op = op, .shift = tg->shift,
                        .budget = tg->budget ? tg->budget : pid};
    if (vm_pending.update(&tid, &v))
        count(C_PENDING_FULL, 1);
    return 0;
}

/* `sampling` is a constant per call site: only mmap and mremap exits can sample, and the
 * stack capture is compiled into those two programs alone (each copy costs clang ~1 s). */
static __always_inline int vm_exit(void *ctx, long ret, const bool sampling)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    struct vm_args *vp = vm_pending.lookup(&tid);
    if (!vp)
        return 0;
    struct vm_args v = *vp;
    vm_pending.delete(&tid);

    u64 weight = 0;
    bool ok = (unsigned long)ret < (unsigned long)-4095L;
    if (sampling && ok && v.op == VM_MMAP) {
        u32 prot = v.arg, flags = v.arg >> 32;
        if ((flags & (MAP_SHARED_ | MAP_PRIVATE_ | MAP_ANONYMOUS_)) == (MAP_PRIVATE_ | MAP_ANONYMOUS_)
            && (prot & 3))
            weight = sample_bytes(pid, v.len, v.shift);
    } else if (sampling && ok && v.op == VM_MREMAP) {
        weight = sample_bytes(pid, v.arg, v.shift);     /* new length */
    }
    bool moved = sampling && ok && v.op == VM_MREMAP && vm_live_unmap(pid, v.addr, v.len);
    if (weight || moved) {                   /* a moved sampled mapping stays sampled */
        struct live_key k = {.pid = pid, .addr = ret};
        u64 n = v.op == VM_MREMAP ? v.arg : v.len;
        vm_live.update(&k, &n);              /* full: its unmap only passes within the budget */
    } else if (!(v.op == VM_MMAP && (v.arg & PROT_EXEC_) && !((v.arg >> 32) & MAP_ANONYMOUS_))
               && !vm_admit(v.budget)) {
        return 0;
    }

    struct ev_stack *e = sampling && weight ? scratch_acquire() : 0;
    struct ev_hdr *h = e ? &e->h : events.ringbuf_reserve(sizeof(struct ev_hdr));
    if (!h) {
        count_drop(pid, C_LOST_EVENTS);
        return 0;
    }
    init_hdr(h, EV_VM, SRC_MMAP, v.op, pid, tid);
    h->flags = EVF_FIRST_IS_IP;
    h->addr = v.addr;
    h->size = v.len;
    h->weight = weight;
    h->arg = v.arg;
    h->ret = ret;
    if (weight)
        h->flags |= EVF_SAMPLED;
    if (e) {
        u64 ip = 0, sp = 0, bp = 0;
        user_regs(&ip, &sp, &bp);
        struct pending *outer = pending.lookup(&tid);     /* inside a sampled malloc (glibc's
                                                           * mmap of a large block) */
        e->ra_slot = outer ? outer->ra_slot : 0;
        e->ra = outer ? outer->ra : 0;
        walk_user(ctx, e, ip, sp, bp, WALKER_TRACEPOINT);
        /* the walker could not run: the record goes without its stack */
        h->flags |= EVF_STACK_ERR;
        count(C_STACK_ERR, 1);
        if (events.ringbuf_output(h, sizeof(*h), rb_flags(sizeof(*h))))
            count_drop(pid, C_LOST_EVENTS);
        scratch_release();
    } else {
        if (weight) {             /* sampled, but the scratch record is in use on this CPU */
            h->flags |= EVF_STACK_ERR;
            count(C_STACK_ERR, 1);
        }
        events.ringbuf_submit(h, rb_flags(sizeof(*h)));
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    return vm_enter(VM_MMAP, args->addr, args->len, (args->prot & 0xffffffff) | (args->flags << 32));
}
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return vm_exit(args, args->ret, true); }

TRACEPOINT_PROBE(syscalls, sys_enter_munmap) { return vm_enter(VM_MUNMAP, args->addr, args->len, 0); }

TRACEPOINT_PROBE(syscalls, sys_enter_mremap)
{
    return vm_enter(VM_MREMAP, args->addr, args->old_len, args->new_len);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mremap) { return vm_exit(args, args->ret, true); }

TRACEPOINT_PROBE(syscalls, sys_enter_brk) { return vm_enter(VM_BRK, args->brk, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_brk) { return vm_exit(args, args->ret, false); }

TRACEPOINT_PROBE(syscalls, sys_enter_madvise)
{
    return vm_enter(VM_MADVISE, args->start, args->len_in, (u32)args->behavior);
}
TRACEPOINT_PROBE(syscalls, sys_exit_madvise) { return vm_exit(args, args->ret, false); }

TRACEPOINT_PROBE(syscalls, sys_enter_mprotect)
{
    return vm_enter(VM_MPROTECT, args->start, args->len, args->prot);
}
TRACEPOINT_PROBE(syscalls, sys_exit_mprotect) { return vm_exit(args, args->ret, false); }
