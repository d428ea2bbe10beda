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
 * One program for every probe site of both, attached with uprobe_multi (one stack capture
 * compiled, not two); the cookie indexes `usdt_specs`, which says where each argument lives at
 * that site (sampler/probes/usdt.py pack_spec), like libbpf's usdt.bpf.h, and which probe it is (kind).
 */

#define PT_REGS_WORDS (sizeof(struct pt_regs) / 8)


BPF_ARRAY(usdt_specs, struct usdt_spec, USDT_SPECS);

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
    u32 kind = spec->kind;
    bool torch = kind == USDT_TORCH_ALLOC || kind == USDT_TORCH_FREE;
    u64 ptr = usdt_arg(regs, &spec->arg[0]);
    if (kind == USDT_FREE || kind == USDT_TORCH_FREE) {
        u32 fn = torch ? FN_TORCH_FREE : FN_USDT_FREE;
        count(C_HITS + fn, 1);
        if (ptr)
            emit_free(pid, tid, fn, torch ? ptr | TORCH_TAG : ptr);
        return 0;
    }
    u32 fn = torch ? FN_TORCH_ALLOC : FN_USDT_ALLOC;
    count(C_HITS + fn, 1);
    u64 size = usdt_arg(regs, &spec->arg[1]);
    if (!ptr || !size)
        return 0;
    u64 weight = 0;
    if (torch) {                    /* every tensor: sampled here */
        struct target *tg = targets.lookup(&pid);
        weight = sample_bytes(pid, size, tg ? tg->shift : 0);
        if (!weight)
            return 0;
    }
    /* otel_memory: weighted_bytes; pytorch: the device (read only for sampled tensors) */
    u64 arg2 = usdt_arg(regs, &spec->arg[2]);
    if (!torch) {                   /* sampled by the process */
        weight = arg2 < size ? size : arg2;     /* a probability above 1 is an emitter's bug */
        count(C_SAMPLED, 1);
    }
    struct alloc_rec r = {.addr = torch ? ptr | TORCH_TAG : ptr, .size = size, .weight = weight,
                          .old = torch ? arg2 : 0,                   /* the device (h->arg) */
                          .ip = PT_REGS_IP(ctx), .sp = PT_REGS_SP(ctx), .bp = PT_REGS_FP(ctx),
                          .fn = fn, .flags = EVF_FIRST_IS_IP | EVF_SITE_MODULE,
                          .source = torch ? SRC_TORCH : SRC_MALLOC};
    emit_alloc(pid, tid, &r);
    return 0;
}
