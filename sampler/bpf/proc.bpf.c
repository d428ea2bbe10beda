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

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32;
    if (targets.lookup(&pid))
        emit_proc(PROC_FORK, pid, id, args->child_pid);    /* user space tells threads apart */
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 pid = args->pid;
    if (targets.lookup(&pid))
        emit_proc(PROC_EXEC, pid, pid, args->old_pid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 pid = id >> 32, tid = id;
    if (!targets.lookup(&pid))
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
    return 0;
}
