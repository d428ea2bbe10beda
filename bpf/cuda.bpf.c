/* GPU memory: CUDA runtime (libcudart) and driver (libcuda) allocation calls. (PyTorch's
 * caching-allocator USDT probes, pytorch:malloc / pytorch:free, are bpf/usdt.bpf.c's.)
 *
 * CUDA calls are rare (a caching allocator calls cudaMalloc once per segment), so every call
 * is recorded, unsampled: `cuda_call` is attached with two uprobe_multi links per library and
 * process, one at entry and one at return (one program: at return the instruction pointer is
 * the caller's return address, not the probed one). The cookie says what to read (sampler/gpu/cuda.py
 * builds it): bits 0-7 the function id, 8-11 the argument convention, 12-15 the source (layer),
 * CK_STACK: capture the caller's stack, CK_NULL_SKIP: a call with a NULL first argument does
 * nothing (cudaFree(NULL) initialises the context).
 *
 * Entry saves the arguments keyed by (thread, stack pointer, function): the runtime calls the
 * driver on the same thread, and the key tells nested calls apart (at return sp is entry sp + 8;
 * a tail call shares the stack slot, not the function).
 * Return reads out-parameters only when the call returned 0 (CUDA_SUCCESS) and sends one EV_CUDA
 * record: addr = the pointer or handle (out-parameter, else argument 1), size, arg = argument 4
 * (cuMemMap: the handle), ret = the return value, weight = the entry time (a free applies only
 * to a block allocated before it started). User space keeps the outstanding table.
 */


#define CK_FN(c) ((c) & 0xff)
#define CK_CONV(c) (((c) >> CK_CONV_SHIFT) & 0xf)
#define CK_SRC(c) (((c) >> CK_SRC_SHIFT) & 0xf)

struct cuda_key {
    u32 tid;
    u32 fn;         /* the cookie's low 16 bits */
    u64 sp;
};

struct cuda_call {
    u64 ts;
    u64 a;
    u64 b;
    u64 d;
    u32 cookie;
    u32 pad;
};

BPF_HASH(cuda_calls, struct cuda_key, struct cuda_call, 8192);

/* Per thread: the outermost CUDA call in progress, whose return address on the stack is the
 * kernel's trampoline until it returns; a nested call's stack capture puts the address back. */
struct cuda_outer {
    u64 ra_slot;
    u64 ra;
};
BPF_HASH(cuda_outer, u32, struct cuda_outer, 8192);

int cuda_call(struct pt_regs *ctx)
{
    u64 a = PT_REGS_PARM1(ctx), b = PT_REGS_PARM2(ctx), d = PT_REGS_PARM4(ctx);
    u64 sp = PT_REGS_SP(ctx), ip = PT_REGS_IP(ctx), rc = PT_REGS_RC(ctx), bp = PT_REGS_FP(ctx);
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    u32 cookie = bpf_get_attach_cookie(ctx);
    struct cuda_key k = {.tid = tid, .fn = cookie & 0xffff};

    if (ip == bpf_get_func_ip(ctx)) {                       /* entry */
        if ((cookie & CK_NULL_SKIP) && !a)
            return 0;
        count(C_CUDA_CALLS, 1);
        struct cuda_call c = {.ts = bpf_ktime_get_ns(), .a = a, .b = b, .d = d, .cookie = cookie};
        k.sp = sp;
        if (cuda_calls.update(&k, &c)) {
            count(C_PENDING_FULL, 1);
            return 0;
        }
        struct cuda_outer o = {.ra_slot = sp};
        bpf_probe_read_user(&o.ra, sizeof(o.ra), (void *)sp);
        struct cuda_outer *cur = cuda_outer.lookup(&tid);
        /* none, or left over from a call that never returned (a tail call shares the slot, whose
         * word is already the trampoline: keep the first) */
        if (!cur || cur->ra_slot < sp)
            cuda_outer.update(&tid, &o);
        return 0;
    }

    k.sp = sp - 8;                                          /* return: the slot `ret` popped */
    struct cuda_call *cp = cuda_calls.lookup(&k);
    if (!cp)
        return 0;
    struct cuda_call c = *cp;
    cuda_calls.delete(&k);
    u64 ra_slot = 0, ra = 0;
    struct cuda_outer *o = cuda_outer.lookup(&tid);
    if (o) {
        if (o->ra_slot <= k.sp) {
            cuda_outer.delete(&tid);            /* this call was the outermost (or o is stale) */
        } else {
            ra_slot = o->ra_slot;
            ra = o->ra;
        }
    }
    u32 conv = CK_CONV(c.cookie);
    bool ok = (u32)rc == 0;
    u64 addr = c.a, size = c.b;
    if (conv != CV_ARGS) {
        addr = 0;
        if (ok)
            bpf_probe_read_user(&addr, sizeof(addr), (void *)c.a);
        if (conv == CV_PITCH) {
            u64 pitch = 0;
            if (ok)
                bpf_probe_read_user(&pitch, sizeof(pitch), (void *)c.b);
            size = pitch * c.d;
        }
    }

    struct ev_stack *e = (c.cookie & CK_STACK) ? scratch_acquire() : 0;
    struct ev_hdr *h = e ? &e->h : events.ringbuf_reserve(sizeof(struct ev_hdr));
    if (!h) {
        count_drop(pid, C_LOST_EVENTS);
        return 0;
    }
    init_hdr(h, EV_CUDA, CK_SRC(c.cookie), CK_FN(c.cookie), pid, tid);
    h->addr = addr;
    h->size = size;
    h->weight = c.ts;
    h->arg = c.d;
    h->ret = rc;
    if (!e) {
        if (c.cookie & CK_STACK) {
            h->flags |= EVF_STACK_ERR;
            count(C_STACK_ERR, 1);
        }
        events.ringbuf_submit(h, rb_flags(sizeof(*h)));
        return 0;
    }
    e->ra_slot = ra_slot;
    e->ra = ra;
    walk_user(ctx, e, ip, sp, bp, WALKER_MULTI);
    /* the walker could not run: the record goes without its stack */
    h->flags |= EVF_STACK_ERR;
    count(C_STACK_ERR, 1);
    if (events.ringbuf_output(h, sizeof(*h), rb_flags(sizeof(*h))))
        count_drop(pid, C_LOST_EVENTS);
    scratch_release();
    return 0;
}
