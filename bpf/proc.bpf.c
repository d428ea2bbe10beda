/* Target lifecycle: forks (for --children), execs (the image and its allocator change) and
 * process exits (the last thread: group_dead). */

static __always_inline void emit_proc(u32 op, u32 pid, u32 tid, u64 other)
{
    struct ev_hdr *e = events.ringbuf_reserve(sizeof(struct ev_hdr));
    if (!e) {
        count_drop(pid, C_LOST_EVENTS);
        return;
    }
    init_hdr(e, EV_PROC, 0, op, pid, tid);
    e->addr = other;
    events.ringbuf_submit(e, rb_flags(sizeof(*e)));
}

#define CLONE_THREAD_FLAG 0x00010000

/* A new task, in its parent's context before it first runs (copy_process). Threads are not
 * forks. A fork of a TGT_FAMILY target (--children) is registered here, so that it is recorded
 * from its first instruction: it gets the parent's target entry, its CPython layout, the forking
 * thread's PyThreadState (the child's only thread), and the parent's unwind table, which holds
 * for its copy of the address space until user space writes the child its own (on this event).
 * The injected sampler's probe sites are attached once per family (any pid) and check `targets`,
 * so the child's samples need nothing else. */
TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id, child = args->pid;
    struct target *tg = targets.lookup(&pid);
    if (!tg)
        return 0;
    if (tg->flags & TGT_FAMILY) {
        u32 root = tg->budget ? tg->budget : pid;
        struct target *rt = root == pid ? tg : targets.lookup(&root);
        if (!rt)
            rt = tg;                /* its root exited: the members it forked count here */
        int zero = 0;
        u64 *all = family_n.lookup(&zero);
        if (!all || rt->members >= FAMILY_MAX || *all >= FAMILIES_MAX) {
            count(C_FAMILY_FULL, 1);
            return 0;               /* counted, not recorded: no fork event */
        }
        __sync_fetch_and_add(&rt->members, 1);
        __sync_fetch_and_add(all, 1);
        struct target c = *tg;
        c.budget = root;            /* a fork storm spends its root's budget */
        c.flags |= TGT_FORKED;
        c.members = 0;
        targets.update(&child, &c);
        struct py_layout *py = pyprocs.lookup(&pid);
        if (py) {
            struct py_layout l = *py;
            pyprocs.update(&child, &l);
        }
        u64 *ts = pythreads.lookup(&tid);
        if (ts) {
            u64 v = *ts;
            pythreads.update(&child, &v);
        }
        struct uw_proc *uw = uw_procs.lookup(&pid);
        if (uw) {
            struct uw_proc v = *uw;
            uw_procs.update(&child, &v);
        }
    }
    emit_proc(PROC_FORK, pid, id, child);
    return 0;
}

#define SIGSTOP_NR 19

/* A held process stops before its new image runs an instruction (the signal is delivered on the
 * way back to user space); user space puts hold_entry on the image's entry point, then lets it go. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 pid = args->pid;
    struct target *tg = targets.lookup(&pid);
    if (!tg)
        return 0;
    if (tg->flags & TGT_HOLD)
        bpf_send_signal(SIGSTOP_NR);
    emit_proc(PROC_EXEC, pid, pid, args->old_pid);
    return 0;
}

/* At the entry point of a held process's image (a uprobe_multi link for that pid): the dynamic
 * linker has loaded and relocated every library, the program has not started. It stops there
 * until user space has placed the sampler. */
int hold_entry(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    struct target *tg = targets.lookup(&pid);
    if (!tg || !(tg->flags & TGT_HOLD))
        return 0;
    bpf_send_signal(SIGSTOP_NR);
    emit_proc(PROC_ENTRY, pid, id, PT_REGS_IP(ctx));
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    struct target *tg = targets.lookup(&pid);
    if (!tg)
        return 0;
    /* a thread that dies inside a tracked call never returns: drop its pending state */
    pending.delete(&tid);
    vm_pending.delete(&tid);
    pythreads.delete(&tid);       /* the tid may be reused by a thread without a PyThreadState */
#ifdef EXIT_HAS_GROUP_DEAD
    if (!args->group_dead)
        return 0;
#else
    if ((u32)id != pid)
        return 0;
#endif
    emit_proc(PROC_EXIT, pid, id, 0);
    if (tg->flags & TGT_FORKED) {   /* its place in its family's caps is free again */
        u32 root = tg->budget;
        struct target *rt = targets.lookup(&root);
        if (rt && rt->members)
            __sync_fetch_and_add(&rt->members, -1);   /* (BPF has atomic add only) */
        int zero = 0;
        u64 *all = family_n.lookup(&zero);
        if (all && *all)
            __sync_fetch_and_add(all, -1);
    }
    /* a child registered at its fork may exit before user space has seen it: nothing stays */
    targets.delete(&pid);
    pyprocs.delete(&pid);
    uw_procs.delete(&pid);
    return 0;
}
