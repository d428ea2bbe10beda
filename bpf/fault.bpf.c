/* Always-on tier: sampled user page faults (a software perf event with a sample period, on
 * every CPU) attribute the memory that processes bring into RSS to user stacks, without any
 * uprobe. Each sample stands for `sample_period` faults of one page. Processes are selected by
 * `targets` (TGT_FAULTS), by cgroup (`fault_cgroups`, the cgroup or any ancestor), or all
 * (`fault_cfg[0]`); the recorder itself (`fault_cfg[1]`) never is.
 */

/* The layout of struct bpf_perf_event_data (uapi/linux/bpf_perf_event.h, x86-64), declared here
 * because that header pulls in the kernel's perf headers: ~6 s of clang at every start. */
struct fault_sample_ctx {
    struct pt_regs regs;
    u64 sample_period;
    u64 addr;
};

#define FAULT_CGROUP_LEVELS 8
BPF_ARRAY(fault_cfg, u64, 2);
BPF_HASH(fault_cgroups, u64, u32, 256);

static __always_inline bool fault_selected(u32 pid)
{
    struct target *tg = targets.lookup(&pid);
    if (tg)
        return tg->flags & TGT_FAULTS;
    u32 k = 0, k_self = 1;
    u64 *all = fault_cfg.lookup(&k), *self = fault_cfg.lookup(&k_self);
    if (!all || !self || !pid || pid == *self)
        return false;
    if (*all == 1)
        return true;
    if (*all != 2)
        return false;
    u64 cg = bpf_get_current_cgroup_id();
    if (fault_cgroups.lookup(&cg))
        return true;
#pragma unroll
    for (int level = 1; level < FAULT_CGROUP_LEVELS; level++) {
        u64 a = bpf_get_current_ancestor_cgroup_id(level);
        if (!a || a == cg)
            break;
        if (fault_cgroups.lookup(&a))
            return true;
    }
    return false;
}

int on_page_fault(struct fault_sample_ctx *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    if (!fault_selected(pid))
        return 0;
    u64 addr = ctx->addr, period = ctx->sample_period;
    count(C_FAULTS, 1);
    /* the user context, also for a fault taken in the kernel on a user address (read() into a
     * fresh buffer): the site is the syscall's caller */
    u64 ip = 0, sp = 0, bp = 0;
    user_regs(&ip, &sp, &bp);
    struct alloc_rec r = {.addr = addr & ~4095ULL, .size = 4096, .weight = (period ? period : 1) * 4096,
                          .ip = ip, .sp = sp, .bp = bp, .flags = EVF_FIRST_IS_IP, .source = SRC_FAULT};
    emit_alloc(ctx, pid, tid, &r, WALKER_PERF);
    return 0;
}
