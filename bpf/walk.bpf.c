/* The stack walk's programs, one per kind of attach point that samples stacks
 * (common.h walk_user): each run walks UW_STEP frames and tail-calls itself for the next ones;
 * the last run copies what user space needs, sends the record, releases the scratch record and,
 * for a sampled block, publishes its address in `live` (after its record: see emit_alloc). */

static __always_inline void walk_send(void)
{
    u32 zero = 0;
    struct ev_stack *e = stack_scratch.lookup(&zero);
    struct walk_state *w = walk_states.lookup(&zero);
    if (!e || !w) {
        scratch_release();
        return;
    }
    u32 len = walk_length(e, walk_end(e, w));
    u32 pid = e->h.pid, tid = e->h.tid, fn = e->h.op;
    u8 type = e->h.type, source = e->h.source;
    u64 addr = e->h.addr, born = e->h.ts;
    long err = events.ringbuf_output(e, len, rb_flags(len));
    scratch_release();
    if (err) {
        count_drop(pid, C_LOST_EVENTS);
        return;
    }
    if (type == EV_ALLOC && (source == SRC_MALLOC || source == SRC_TORCH || source == SRC_PYTHON))
        publish_live(pid, tid, fn, addr, born);
}

/* One run: the caller's hand-over (first run), UW_STEP frames, then the next run or the end. */
static __always_inline int walk_run(void *ctx, const int walker)
{
    u32 zero = 0;
    struct ev_stack *e = stack_scratch.lookup(&zero);
    struct walk_state *w = walk_states.lookup(&zero);
    if (!e || !w) {
        scratch_release();
        return 0;
    }
    if (!w->started)
        walk_begin(e, w);
    if (walk_frames(e, w)) {
        walk_next(ctx, walker);
        walk_cut(e, w);                     /* the tail call did not happen */
    }
    walk_send();
    return 0;
}

int walker_kprobe(struct pt_regs *ctx) { return walk_run(ctx, WALKER_KPROBE); }
int walker_multi(struct pt_regs *ctx) { return walk_run(ctx, WALKER_MULTI); }
int walker_session(struct pt_regs *ctx) { return walk_run(ctx, WALKER_SESSION); }
int walker_tracepoint(void *ctx) { return walk_run(ctx, WALKER_TRACEPOINT); }
int walker_perf(void *ctx) { return walk_run(ctx, WALKER_PERF); }
