/* USDT allocation probes.
 *
 * Preload tier: USDT probes of processes that sample their own allocations (our LD_PRELOAD
 * shim, or any allocator or application that follows the OpenTelemetry eBPF profiler's memory
 * contract): otel_memory:alloc(ptr, size, weighted_bytes) for sampled allocations only, and
 * otel_memory:free(ptr) for frees of sampled blocks only. No malloc call traps; sampled events
 * become the same records as the attach tier's.
 *
 * GPU: PyTorch's caching-allocator probes pytorch:malloc(ptr, device, size, stream) and
 * pytorch:free(ptr) in libc10_cuda (sampler/gpu/cuda.py; user space orders the arguments ptr, size,
 * device). Tensors are frequent: they are sampled here like malloc blocks, and tracked in `live`
 * under TORCH_TAG.
 *
 * Injected sampler (sampler/inprocess/inject.c): the same otel_memory probes, plus
 * allocsampler:pyalloc(ptr, size, weighted_bytes) for CPython's small objects (SRC_PYTHON), and
 * allocsampler:unfree(ptr), which undoes the thread's last otel_memory:free of ptr: a sampled block
 * handed to realloc is reported freed before the call (afterwards the address may already be
 * another thread's), and a realloc that fails gives it back.
 *
 * One program for every probe site of all of these, attached with uprobe_multi (one stack capture
 * compiled, not two), per process, or per family for the injected sampler under --children; the
 * cookie indexes `usdt_specs`, which says where each argument lives at
 * that site (sampler/probes/usdt.py pack_spec), like libbpf's usdt.bpf.h, and which probe it is (kind).
 */

#define PT_REGS_WORDS (sizeof(struct pt_regs) / 8)
#define MAX_USDT_SIZE (1ULL << 47)      /* the x86-64 user address space */
#define MAX_USDT_WEIGHT (1ULL << 40)    /* a sample standing for 1 TiB: far above any sampling mean */


BPF_ARRAY(usdt_specs, struct usdt_spec, USDT_SPECS);

/* Per thread: the last sampled block an otel_memory:free removed from `live`, for its unfree. */
struct usdt_undo {
    u64 addr;
    u64 born;
};
BPF_TABLE("lru_hash", u64, struct usdt_undo, usdt_undo, 4096);

static __always_inline u64 usdt_arg(const u64 *regs, const struct usdt_arg *a)
{
    if (a->kind == USDT_CONST)
        return a->val;
    u32 r = a->reg_off / 8;
    if (r >= PT_REGS_WORDS)
        return 0;
    u64 v = regs[r];
    if (a->kind == USDT_DEREF) {
        u64 x = 0;
        bpf_probe_read_user(&x, sizeof(x), (void *)(v + a->val));
        v = x;
    }
    u32 bits = (u32)a->size * 8;
    if (bits && bits < 64) {
        u32 shift = 64 - bits;
        v = a->is_signed ? (u64)((s64)(v << shift) >> shift) : (v << shift) >> shift;
    }
    return v;
}

int usdt_memory(struct pt_regs *ctx)
{
    u32 id_spec = bpf_get_attach_cookie(ctx);
    struct usdt_spec *spec = usdt_specs.lookup(&id_spec);
    if (!spec)
        return 0;
    /* the registers, copied once: argument registers differ per site */
    u64 regs[PT_REGS_WORDS] = {};
    bpf_probe_read_kernel(regs, sizeof(regs), ctx);
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    /* a family's link (any pid) fires in every process that maps its file: only the family's
     * targets count (not a fork without --children, one handed the memfd, or a process recorded
     * without --children, which has a link of its own) */
    struct target *tg = targets.lookup(&pid);
    if (!tg || ((spec->fn & USDT_FAMILY_LINK) && !(tg->flags & TGT_FAMILY)))
        return 0;
    u32 kind = spec->kind;
    u32 fn = spec->fn & 31;
    bool torch = kind == USDT_TORCH_ALLOC || kind == USDT_TORCH_FREE;
    u64 ptr = usdt_arg(regs, &spec->arg[0]);
    count(C_HITS + fn, 1);
    if (kind == USDT_FREE || kind == USDT_TORCH_FREE) {
        if (!ptr)
            return 0;
        if (!torch) {               /* sampled frees only: remember it for an unfree */
            struct live_key k = {.pid = pid, .addr = ptr};
            u64 *bp = live.lookup(&k);
            if (bp) {
                struct usdt_undo u = {.addr = ptr, .born = *bp};
                usdt_undo.update(&id, &u);
            }
        }
        emit_free(pid, tid, fn, torch ? ptr | TORCH_TAG : ptr);
        return 0;
    }
    if (kind == USDT_UNFREE) {
        struct usdt_undo *u = usdt_undo.lookup(&id);
        if (!u || u->addr != ptr || !ptr)
            return 0;
        u64 born = u->born;
        usdt_undo.delete(&id);
        struct live_key k = {.pid = pid, .addr = ptr};
        if (live.insert(&k, &born) == 0)
            submit_free(pid, tid, fn, ptr, born);
        return 0;
    }
    u64 size = usdt_arg(regs, &spec->arg[1]);
    /* the arguments are the process's to choose (docs/security.md): a size no address space holds
     * is dropped, a weight is capped, so a hostile emitter can skew only its own estimates, and
     * only as far as allocating for real would */
    if (!ptr || !size || size > MAX_USDT_SIZE)
        return 0;
    u64 weight = 0;
    if (torch) {                    /* every tensor: sampled here */
        weight = sample_bytes(pid, size, tg->shift);
        if (!weight)
            return 0;
    }
    /* otel_memory, pyalloc: weighted_bytes; pytorch: the device (read only for sampled tensors) */
    u64 arg2 = usdt_arg(regs, &spec->arg[2]);
    if (!torch) {                   /* sampled by the process */
        weight = arg2 < size ? size : arg2;     /* a probability above 1 is an emitter's bug */
        if (weight > MAX_USDT_WEIGHT)
            weight = MAX_USDT_WEIGHT;
        count(C_SAMPLED, 1);
    }
    struct alloc_rec r = {.addr = torch ? ptr | TORCH_TAG : ptr, .size = size, .weight = weight,
                          .old = torch ? arg2 : 0,                   /* the device (h->arg) */
                          .ip = PT_REGS_IP(ctx), .sp = PT_REGS_SP(ctx), .bp = PT_REGS_FP(ctx),
                          .fn = fn, .flags = EVF_FIRST_IS_IP | EVF_SITE_MODULE, .source = spec->source};
    emit_alloc(ctx, pid, tid, &r, WALKER_MULTI);
    return 0;
}
