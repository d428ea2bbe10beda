/* Preload tier: USDT probes of processes that sample their own allocations (our LD_PRELOAD
 * shim, or any allocator or application that follows the OpenTelemetry eBPF profiler's memory
 * contract): otel_memory:alloc(ptr, size, weighted_bytes) for sampled allocations only, and
 * otel_memory:free(ptr) for frees of sampled blocks only. No malloc call traps; sampled events
 * become the same records as the attach tier's.
 *
 * One program for every probe site, attached with uprobe_multi; the cookie indexes `usdt_specs`,
 * which says where each argument lives at that site (sampler/usdt.py pack_spec), like libbpf's
 * usdt.bpf.h.
 */

enum usdt_arg_kind { USDT_CONST = 1, USDT_REG, USDT_DEREF };
enum usdt_kind { USDT_ALLOC = 1, USDT_FREE = 2 };
#define USDT_SPECS 1024
#define PT_REGS_WORDS (sizeof(struct pt_regs) / 8)

struct usdt_arg {
    s64 val;        /* constant, or displacement of a dereference */
    u16 reg_off;    /* register: offset in struct pt_regs */
    u8 kind;
    u8 size;        /* bytes */
    u8 is_signed;
    u8 pad[3];
};

struct usdt_spec {
    struct usdt_arg arg[3];
    u32 nargs;
    u32 kind;
};

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
    u64 ptr = usdt_arg(regs, &spec->arg[0]);
    if (spec->kind == USDT_FREE) {
        count(C_HITS + FN_USDT_FREE, 1);
        if (ptr)
            emit_free(pid, tid, FN_USDT_FREE, ptr);
        return 0;
    }
    count(C_HITS + FN_USDT_ALLOC, 1);
    u64 size = usdt_arg(regs, &spec->arg[1]);
    u64 weight = usdt_arg(regs, &spec->arg[2]);
    if (!ptr || !size)
        return 0;
    if (weight < size)              /* an inclusion probability above 1 is an emitter's bug */
        weight = size;
    count(C_SAMPLED, 1);
    struct alloc_rec r = {.addr = ptr, .size = size, .weight = weight,
                          .ip = PT_REGS_IP(ctx), .sp = PT_REGS_SP(ctx), .bp = PT_REGS_FP(ctx),
                          .fn = FN_USDT_ALLOC, .flags = EVF_FIRST_IS_IP | EVF_SITE_MODULE,
                          .source = SRC_MALLOC};
    emit_alloc(pid, tid, &r);
    return 0;
}
