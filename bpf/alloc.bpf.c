/* Allocator probes: the malloc family of libc or of another allocator library, per target.
 *
 * Session mode (kernel >= 6.13, uprobe_multi session links): `alloc_session` runs at entry of
 * every allocation function; it decides sampling and returns 1 (skip the return probe) for
 * unsampled calls, so only sampled calls pay for a return trap. The attach cookie is the fn_id.
 * Perf mode (older kernels): `<fn>_enter` at entry and `alloc_return` at every return.
 * Frees are entry-only probes at a site chosen by sampler/probes/sites.py (glibc free: +9).
 */

struct pending {
    u64 ts;
    u64 size;
    u64 weight;   /* 0: not sampled (a realloc of a sampled block) */
    u64 old;      /* realloc: the sampled old block; posix_memalign: the memptr out-parameter */
    u64 old_born; /* realloc: the old block's allocation time (its value in `live`) */
    u64 ra_slot;  /* the return address (and where it is on the stack) at entry: the return probe */
    u64 ra;       /* replaces it with a trampoline until the call returns (see vm.bpf.c) */
    u32 fn;
    u32 pad;
};

BPF_HASH(pending, u32, struct pending, 16384);

/* a * b, or the largest size when it overflows: the call then fails and is not counted (0
 * would read as realloc(p, 0), which frees). The barrier keeps LLVM from turning the check
 * into a 128-bit multiply, which BPF lacks. */
static __always_inline u64 mul_or_max(u64 a, u64 b)
{
    if (!a)
        return 0;
    u64 lim = ~0ULL / a;
    asm volatile("" : "+r"(lim));
    return b > lim ? ~0ULL : a * b;
}

static __always_inline u64 requested_size(u32 fn, u64 a, u64 b, u64 c)
{
    switch (fn) {
    case FN_CALLOC:
        return mul_or_max(a, b);
    case FN_REALLOC:
    case FN_ALIGNED_ALLOC:
    case FN_MEMALIGN:
        return b;
    case FN_REALLOCARRAY:
        return mul_or_max(b, c);
    case FN_POSIX_MEMALIGN:
        return c;
    case FN_PVALLOC:
        return a ? (a + 4095) & ~4095ULL : 4096;
    default:                                            /* malloc, valloc, operator new */
        return a;
    }
}

/* Whether a call is handed to another probed function (see FNF_DELEGATES). */
static __always_inline bool delegated(u32 fn, u64 a, u64 b)
{
    switch (fn) {
    case FN_REALLOC:
        return !a || !b;
    case FN_MEMALIGN:
    case FN_ALIGNED_ALLOC:
        return a <= 16;
    case FN_POSIX_MEMALIGN:
        return b <= 16;
    default:
        return false;
    }
}

/* Returns 0 when the return probe must run (a sampled call, or a realloc of a sampled
 * block whose free depends on the result), 1 otherwise. */
static __always_inline int on_alloc_entry(struct pt_regs *ctx, u32 cookie)
{
    /* arguments are read once, up front: the verifier rejects loads through a ctx pointer
     * that the compiler has offset */
    u64 a = PT_REGS_PARM1(ctx), b = PT_REGS_PARM2(ctx), c = PT_REGS_PARM3(ctx), sp = PT_REGS_SP(ctx);
    u32 fn = cookie & 0xff;
    u64 id = bpf_get_current_pid_tgid();
    count(C_HITS + (fn & 31), 1);
    s32 shift = count_hit(id >> 32, false);
    if ((cookie & FNF_DELEGATES) && delegated(fn, a, b))
        return 1;
    struct pending p = {};
    p.fn = fn;
    p.size = requested_size(fn, a, b, c);
    p.weight = sample_bytes(id >> 32, p.size, shift);
    struct live_key old = {.pid = id >> 32, .addr = a};
    if (fn == FN_REALLOC || fn == FN_REALLOCARRAY) {
        u64 *born = a ? live.lookup(&old) : 0;
        if (born) {
            p.old = a;
            p.old_born = *born;
        }
    } else if (p.weight && fn == FN_POSIX_MEMALIGN) {
        p.old = a;
    }
    if (!p.weight && !p.old)
        return 1;
    u32 tid = id;
    p.ts = bpf_ktime_get_ns();
    p.ra_slot = sp;               /* probes sit where sp still points at the return address */
    bpf_probe_read_user(&p.ra, sizeof(p.ra), (void *)sp);
    struct pending *outer = pending.lookup(&tid);
    if (outer && p.ts - outer->ts < 1000000000ULL)
        return 1;                 /* nested in a tracked call of another probed function */
    if (pending.update(&tid, &p)) {
        count(C_PENDING_FULL, 1);
        return 1;
    }
    /* realloc may release the old block before it returns, and another thread may get (and
     * sample) the same address meanwhile: take the old block out of `live` now, put it back
     * if the call fails. */
    if (p.old && p.old_born)
        live.delete(&old);
    return 0;
}

/* A FREE record carries the block's allocation time, so that user space never applies a late
 * free to a newer block that got the same address. */
static __always_inline void submit_free(u32 pid, u32 tid, u32 fn, u64 addr, u64 born)
{
    struct ev_hdr *e = events.ringbuf_reserve(sizeof(struct ev_hdr));
    if (!e) {
        count_drop(pid, C_LOST_EVENTS);
        return;
    }
    init_hdr(e, EV_FREE, SRC_MALLOC, fn, pid, tid);
    e->addr = addr;
    e->arg = born;
    events.ringbuf_submit(e, rb_flags(sizeof(*e)));
}

static __always_inline void emit_free(u32 pid, u32 tid, u32 fn, u64 addr)
{
    struct live_key k = {.pid = pid, .addr = addr};
    u64 *bp = live.lookup(&k);
    if (!bp)                      /* not a sampled block */
        return;
    u64 born = *bp;
    if (live.delete(&k))          /* a concurrent double free won */
        return;
    submit_free(pid, tid, fn, addr, born);
}

/* Track a sampled block whose ALLOC record is already in the ring buffer. A full table cancels
 * the record with a FREE, so that user space never holds a block whose free it cannot see. */
static __always_inline void publish_live(u32 pid, u32 tid, u32 fn, u64 addr, u64 born)
{
    struct live_key k = {.pid = pid, .addr = addr};
    if (live.update(&k, &born)) {
        count_drop(pid, C_LIVE_FULL);
        submit_free(pid, tid, fn, addr, born);
    }
}

/* A sampled allocation: its record (with the user stack when the scratch record is free on this
 * CPU), then its address in `live`. Sent before the address is published: a free on another CPU
 * then always lands after this record in the ring buffer, never before it. With a stack, the
 * walker of `walker`'s program type sends it and publishes the address (walk.bpf.c). */
struct alloc_rec {
    u64 addr;
    u64 size;
    u64 weight;
    u64 old;
    u64 ret;
    u64 ip;
    u64 sp;
    u64 bp;
    u32 fn;
    u16 flags;
    u8 source;
    u8 pad;
};

static __always_inline void emit_alloc(void *ctx, u32 pid, u32 tid, struct alloc_rec *r, const int walker)
{
    struct ev_stack *e = scratch_acquire();
    struct ev_hdr *h = e ? &e->h : events.ringbuf_reserve(sizeof(struct ev_hdr));
    if (!h) {
        count_drop(pid, C_LOST_EVENTS);
        return;
    }
    init_hdr(h, EV_ALLOC, r->source, r->fn, pid, tid);
    h->flags = r->flags | EVF_SAMPLED;
    h->addr = r->addr;
    h->size = r->size;
    h->weight = r->weight;
    h->arg = r->old;
    h->ret = r->ret;
    u64 born = h->ts;
    if (e) {
        e->ra_slot = e->ra = 0;
        walk_user(ctx, e, r->ip, r->sp, r->bp, walker);
        /* the walker could not run: the record goes without its stack */
        h->flags |= EVF_STACK_ERR;
        count(C_STACK_ERR, 1);
        long err = events.ringbuf_output(h, sizeof(*h), rb_flags(sizeof(*h)));
        scratch_release();
        if (err) {
            count_drop(pid, C_LOST_EVENTS);
            return;
        }
    } else {
        h->flags |= EVF_STACK_ERR;
        count(C_STACK_ERR, 1);
        events.ringbuf_submit(h, rb_flags(sizeof(*h)));
    }
    /* tracked blocks: their frees are reported (torch: a tagged address); not mmap or faults */
    if (r->source == SRC_MALLOC || r->source == SRC_TORCH || r->source == SRC_PYTHON)
        publish_live(pid, tid, r->fn, r->addr, born);
}

static __always_inline int on_alloc_return(struct pt_regs *ctx, const int walker)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id, pid = id >> 32;
    struct pending *pp = pending.lookup(&tid);
    if (!pp)
        return 0;
    struct pending p = *pp;
    pending.delete(&tid);

    u64 ret = PT_REGS_RC(ctx);
    u64 addr = ret;
    if (p.fn == FN_POSIX_MEMALIGN) {
        addr = 0;
        if ((int)ret == 0 && p.old)
            bpf_probe_read_user(&addr, sizeof(addr), (void *)p.old);
    } else if (p.old) {
        /* realloc frees the old block on success, and also for size 0 (glibc returns NULL);
         * a failed realloc leaves it allocated: back into `live` */
        if (ret || p.size == 0) {
            submit_free(pid, tid, p.fn, p.old, p.old_born);
        } else {
            struct live_key k = {.pid = pid, .addr = p.old};
            live.update(&k, &p.old_born);
        }
    }
    if (!p.weight || !addr)       /* failed allocations are never counted */
        return 0;
    /* ip: the return address into the caller */
    struct alloc_rec r = {.addr = addr, .size = p.size, .weight = p.weight, .old = p.old, .ret = ret,
                          .ip = PT_REGS_IP(ctx), .sp = PT_REGS_SP(ctx), .bp = PT_REGS_FP(ctx),
                          .fn = p.fn, .source = SRC_MALLOC};
    emit_alloc(ctx, pid, tid, &r, walker);
    return 0;
}

/* Session mode: one program for entry and return of every allocation function. At entry the
 * instruction pointer is the probed address; at return it is the caller's return address. */
int alloc_session(struct pt_regs *ctx)
{
    if (PT_REGS_IP(ctx) != bpf_get_func_ip(ctx))
        return on_alloc_return(ctx, WALKER_SESSION);
    return on_alloc_entry(ctx, bpf_get_attach_cookie(ctx));
}

/* Entry-only probe on free-like functions (session mode: uprobe_multi, cookie = fn_id). */
int free_multi(struct pt_regs *ctx)
{
    u64 addr = PT_REGS_PARM1(ctx);
    u32 fn = bpf_get_attach_cookie(ctx);
    u64 id = bpf_get_current_pid_tgid();
    count(C_HITS + (fn & 31), 1);
    count_hit(id >> 32, true);
    if (addr)
        emit_free(id >> 32, id, fn, addr);
    return 0;
}

/* Perf mode: entry programs per function without cookies (the _d variants delegate), and one
 * shared return program. */
#define ENTER(name, fn)                                                                          \
    int name##_enter(struct pt_regs *ctx) { on_alloc_entry(ctx, fn); return 0; }                \
    int name##_d_enter(struct pt_regs *ctx) { on_alloc_entry(ctx, fn | FNF_DELEGATES); return 0; }
ENTER(malloc, FN_MALLOC)
ENTER(calloc, FN_CALLOC)
ENTER(realloc, FN_REALLOC)
ENTER(reallocarray, FN_REALLOCARRAY)
ENTER(posix_memalign, FN_POSIX_MEMALIGN)
ENTER(aligned_alloc, FN_ALIGNED_ALLOC)
ENTER(memalign, FN_MEMALIGN)
ENTER(valloc, FN_VALLOC)
ENTER(pvalloc, FN_PVALLOC)
ENTER(new, FN_NEW)

int alloc_return(struct pt_regs *ctx)
{
    return on_alloc_return(ctx, WALKER_KPROBE);
}

#define FREE_ENTER(name, fn)                                          \
    int name##_enter(struct pt_regs *ctx)                             \
    {                                                                 \
        u64 addr = PT_REGS_PARM1(ctx);                                \
        u64 id = bpf_get_current_pid_tgid();                          \
        count(C_HITS + fn, 1);                                        \
        count_hit(id >> 32, true);                                    \
        if (addr)                                                     \
            emit_free(id >> 32, id, fn, addr);                        \
        return 0;                                                     \
    }
FREE_ENTER(free, FN_FREE)
FREE_ENTER(delete, FN_DELETE)
