/* The ABI between the BPF programs and user space: every value and layout that both sides use.
 *
 * sampler/bpf/abi.py is its Python side; tests/bpf/test_abi.py parses this file and checks every
 * enum, constant and struct there against it (names, values, field offsets). No maps, no code:
 * the loader pastes this file first, then common.h, then the programs (bcc rewrites map
 * operations only in one translation unit, so nothing is #included).
 */

/* Compile-time parameters (-D from sampler/bpf/loader.py): user stack bytes copied per sampled
 * event (a multiple of STACK_CHUNK) and Python frames captured per sampled event. */
#ifndef STACK_BYTES
#define STACK_BYTES 16384
#endif
#ifndef PY_MAX
#define PY_MAX 96
#endif
/* Native frames walked in BPF per sampled event; a deeper stack is copied from there on and
 * user space goes on (UWS_DEEP). */
#ifndef UW_FRAMES
#define UW_FRAMES 128
#endif
/* The stack is copied in aligned chunks: the end of a stack mapping is page aligned, so an
 * aligned chunk lies wholly inside or wholly outside it (a read that crosses the end fails). */
#define STACK_CHUNK 1024
/* The VM event budget's window: 2^30 ns (~1.07 s). */
#define VM_WINDOW_SHIFT 30
/* A process's sampling mean is SAMPLE_MEAN * 2^shift, shift in [SHIFT_MIN, SHIFT_MAX], set from
 * user space (sampler/control/sample_rate.py). The per-CPU countdown counts in 1/2^SHIFT_MAX
 * bytes of SAMPLE_MEAN, so that every shift divides exactly. */
#define SHIFT_MIN (-6)
#define SHIFT_MAX 10
/* Weight table: h(x) = x / (1 - exp(-x)) at x = i / WTAB_STEPS, Q(WTAB_SHIFT) fixed point; filled
 * from sampler/control/weights.py before any probe is attached. Beyond WTAB_MAX_X the weight is
 * the size. */
#define WTAB_STEPS 64
#define WTAB_MAX_X 24
#define WTAB_N (WTAB_STEPS * WTAB_MAX_X + 1)
#define WTAB_SHIFT 20

enum ev_type { EV_ALLOC = 1, EV_FREE = 2, EV_VM = 3, EV_PROC = 4, EV_CUDA = 5 };
/* SRC_CUDA/SRC_CUDA_DRIVER: a CUDA runtime/driver call (EV_CUDA, cuda.bpf.c); SRC_TORCH: a
 * sampled tensor of PyTorch's caching allocator (pytorch:malloc USDT, tagged address);
 * SRC_PYTHON: a sampled object of CPython's small-object allocator (allocsampler:pyalloc USDT of
 * the injected sampler), which never reaches malloc. */
enum ev_source {
    SRC_MALLOC = 1, SRC_MMAP = 2, SRC_FAULT = 3, SRC_CUDA = 4, SRC_CUDA_DRIVER = 5, SRC_TORCH = 6, SRC_PYTHON = 7,
};
/* FIRST_IS_IP: the captured ip is an instruction pointer (syscalls); otherwise a return address.
 * PY_MISS: a Python target whose thread is not (yet) in `pythreads`.
 * SITE_MODULE: a USDT probe inside the allocator: the stack starts below that module's frames. */
/* CONT_*: the BPF walk handed over (ev_stack.stop >= UWS_NO_TABLE): sp and bp are the registers
 * of the last walked pc, the stack is copied from there; its rbp is unknown (BP_UNKNOWN), its pc a
 * return address (IMPRECISE: look up pc - 1) rather than where execution is. */
enum ev_flags {
    EVF_FIRST_IS_IP = 1, EVF_SAMPLED = 2, EVF_STACK_ERR = 4, EVF_PY_MISS = 8, EVF_PY_TRUNC = 16,
    EVF_SITE_MODULE = 32, EVF_CONT_BP_UNKNOWN = 64, EVF_CONT_IMPRECISE = 128,
};
/* Native unwinding in BPF (common.h walk_native): compact rows from the binaries' CFI, built in
 * user space (sampler/stacks/unwind_rows.py) and loaded per file (sampler/stacks/kernel_tables.py).
 * A row holds from its pc to the next row's: kind | bp kind << 4, the CFA offset, and the saved
 * rbp's offset / 8 (UWK_PLT: the threshold of pc & 15 at which 8 is added to the CFA offset).
 * The return address is always at CFA - 8: any other rule is UWK_UNSUPPORTED. */
enum uw_kind {
    UWK_CFA_RSP = 0, UWK_CFA_RBP = 1, UWK_CFA_DEREF_RBP = 2, UWK_SIGNAL = 3, UWK_ENTRY = 4,
    UWK_UNSUPPORTED = 5, UWK_NO_CFI = 6, UWK_PLT = 7,
};
enum uw_bp { UWB_SAME = 0, UWB_CFA = 1, UWB_RBP = 2, UWB_UNKNOWN = 3 };
/* Why the walk in BPF ended (ev_stack.stop). From UWS_NO_TABLE on, the stack is copied from the
 * last walked frame and user space goes on from there with the DWARF unwinder. */
enum uw_stop {
    UWS_NONE = 0,        /* no walk (no tables for this process): the stack is copied from sp */
    UWS_ENTRY = 1, UWS_NO_CFI = 2, UWS_BAD_FRAME = 3, UWS_READ = 4,
    UWS_NO_TABLE = 5,    /* the file's rows are not loaded yet (being built) or do not fit */
    UWS_NO_MAP = 6,      /* the address is in no mapping known to BPF (JIT code, a dlopen not seen yet) */
    UWS_SIGNAL = 7, UWS_UNSUPPORTED = 8, UWS_DEEP = 9,
};
/* uw_map.row_lo of a file whose rows are not (yet) in uw_rows */
#define UW_PENDING 0xffffffff
/* executable mappings per process that BPF knows (sorted by start); rows of one file at most
 * 2^UW_ROWS_LOG2; pages of the page index, and rows per page at most 2^UW_PAGE_ROWS_LOG2 */
#define UW_MAPS 256
#define UW_ROWS_LOG2 23
#define UW_PAGE_SHIFT 12
#define UW_PAGE_ROWS_LOG2 9

/* `targets` values: what is recorded for a process besides its allocator probes. */
/* TGT_FAMILY (--children): a process it forks is registered as a target by BPF at the fork
 * (proc.bpf.c), before the child first runs. TGT_HOLD (a command `record --` started): at its
 * exec, and at its new image's entry point (hold_entry, attached by user space), the process is
 * stopped (SIGSTOP) and user space told (PROC_EXEC, PROC_ENTRY), so that the sampler is placed
 * before the program's first allocation; user space sends SIGCONT. */
/* TGT_FORKED: an entry BPF made at a fork (counted in its family root's `members`). */
enum target_flags { TGT_SYSCALLS = 1, TGT_FAULTS = 2, TGT_FAMILY = 4, TGT_HOLD = 8, TGT_FORKED = 16 };
/* Processes BPF registers at their fork at once: per family root, and over every family, so that
 * no server (or forked process storm) fills `targets` for the processes user space adds itself.
 * A fork past either cap is counted (C_FAMILY_FULL) and not recorded. */
#define TARGETS_MAX 4096
#define FAMILY_MAX 1024
#define FAMILIES_MAX 3072

/* Allocator functions (the cookie of an allocator probe, low byte). */
enum fn_id {
    FN_MALLOC = 1, FN_CALLOC, FN_REALLOC, FN_REALLOCARRAY, FN_POSIX_MEMALIGN, FN_ALIGNED_ALLOC,
    FN_MEMALIGN, FN_VALLOC, FN_PVALLOC, FN_NEW, FN_FREE, FN_DELETE,
    FN_USDT_ALLOC, FN_USDT_FREE,    /* otel_memory:alloc / otel_memory:free (usdt.bpf.c) */
    FN_TORCH_ALLOC, FN_TORCH_FREE,  /* pytorch:malloc / pytorch:free (usdt.bpf.c) */
    FN_PY_ALLOC,                    /* allocsampler:pyalloc (usdt.bpf.c) */
    FN_USDT_UNFREE,                 /* allocsampler:unfree: the last otel_memory:free of this thread
                                       is undone (a realloc that failed); an EV_FREE record */
};
/* Cookie flag: this function hands some calls to another probed function (glibc: realloc(NULL, n)
 * to malloc and realloc(p, 0) to free; memalign-family calls with alignment <= 16 to malloc).
 * Those calls are left to the inner probe, so that their bytes are counted once. */
#define FNF_DELEGATES 0x100

/* Memory-mapping syscalls. */
enum vm_op { VM_MMAP = 1, VM_MUNMAP, VM_MREMAP, VM_BRK, VM_MADVISE, VM_MPROTECT };
/* PROC_ENTRY: a TGT_HOLD process reached its entry point (ev_hdr.addr: the ip), stopped there. */
enum proc_op { PROC_FORK = 1, PROC_EXEC, PROC_EXIT, PROC_ENTRY };

/* Counters (per CPU, summed in user space). Hit counters are indexed by fn_id / 32 + vm_op. */
enum counter {
    C_LOST_EVENTS = 0,   /* ring buffer full */
    C_LIVE_FULL,         /* sampled allocation not tracked: live table full */
    C_PENDING_FULL,      /* per-thread pending table full */
    C_SAMPLED,
    C_STACK_ERR,         /* no stack captured (registers unreadable, scratch busy) */
    C_PY_MISS,           /* Python target, thread state unknown */
    C_FAULTS,            /* sampled page faults of targets */
    C_CUDA_CALLS,        /* CUDA runtime/driver calls of targets (cuda.bpf.c) */
    C_VM_SUPPRESSED,     /* unsampled syscall events not sent: the process was over its budget */
    C_FAMILY_FULL,       /* forks of family targets not registered: past FAMILY_MAX or FAMILIES_MAX */
    C_HITS = 16,         /* + fn_id: allocator probe hits */
    C_VM_HITS = 48,      /* + vm_op: syscall hits by targets */
    C_N = 64,
};

/* USDT argument specs (usdt.bpf.c; sampler/probes/usdt.py packs them), like libbpf's usdt.bpf.h. */
enum usdt_arg_kind { USDT_CONST = 1, USDT_REG, USDT_DEREF };
/* usdt_spec.kind: which probe a site is (otel_memory's, ours: sampler/probes/usdt.py; pytorch's:
 * sampler/gpu/cuda.py). */
enum usdt_kind {
    USDT_ALLOC = 1, USDT_FREE = 2, USDT_TORCH_ALLOC = 3, USDT_TORCH_FREE = 4, USDT_PY_ALLOC = 5, USDT_UNFREE = 6,
};
/* Tensor addresses of the caching allocator share `live` with malloc blocks under this tag. */
#define TORCH_TAG (1ULL << 63)
#define USDT_SPECS 1024
#define USDT_MAX_ARGS 3
/* In usdt_spec.fn: the spec of a family's link (one link, any pid), which counts only TGT_FAMILY
 * targets: a process recorded without --children that maps the same file has its own link. */
#define USDT_FAMILY_LINK 0x10000

/* CUDA calls (cuda.bpf.c; sampler/gpu/cuda.py builds the cookie): bits 0-7 the function id, 8-11
 * the argument convention, 12-15 the source (layer), then the flags below. */
enum cuda_conv {
    CV_OUT = 0,     /* (T *out, size_t n, ...): *arg1 on success, size arg2 */
    CV_PITCH = 1,   /* (T *out, size_t *pitch, size_t w, size_t h, ...): size *arg2 x arg4 */
    CV_ARGS = 2,    /* pointer/handle arg1, size arg2 (frees, register, map, unmap) */
};
#define CK_CONV_SHIFT 8
#define CK_SRC_SHIFT 12
#define CK_STACK 0x10000        /* capture the caller's stack */
#define CK_NULL_SKIP 0x20000    /* a call with a NULL first argument does nothing */

struct ev_hdr {
    u8 type;
    u8 source;
    u16 op;          /* fn_id, vm_op or proc_op */
    u32 pid;
    u32 tid;
    u16 pad;
    u16 flags;
    u64 ts;
    u64 addr;        /* ALLOC/FREE: block; VM: syscall address argument; PROC: child pid */
    u64 size;        /* requested bytes (VM: length) */
    u64 weight;      /* unbiased weight in bytes, sampled events only */
    u64 arg;         /* VM: prot | flags << 32, advice, or new length */
    u64 ret;         /* VM: syscall return value */
};

/* A sampled event with its stack: user registers, the Python frames of the thread (npy pairs of
 * u64: code object | entry byte << 56, instruction word), the native pcs walked in BPF (npc u64,
 * innermost first, the first one ip), then stack_len bytes copied from sp. Only the used part of
 * `data` is sent. */
struct ev_stack {
    struct ev_hdr h;
    u64 ip;
    u64 sp;
    u64 bp;
    u64 ra_slot;     /* when nonzero: the stack word at ra_slot holds a uretprobe trampoline */
    u64 ra;          /* address instead of this original return address (an event inside a
                      * call whose return probe, ours or another tool's, is pending) */
    u16 stack_len;
    u16 npy;
    u16 npc;         /* native pcs walked in BPF (u64 each, after the Python frames) */
    u8 stop;         /* uw_stop */
    u8 pad;
    /* + 2 chunks of slack: the verifier's bounds on `off + n` in copy_stack are loose */
    u8 data[PY_MAX * 16 + UW_FRAMES * 8 + STACK_BYTES + 2 * STACK_CHUNK];
};

struct uw_row {
    u32 pc;          /* vaddr in the file */
    s16 cfa_off;
    u8 kind;         /* uw_kind | uw_bp << 4 */
    u8 bp_off8;      /* an s8: bcc has no ctype for it */
};

/* One executable mapping of a file: vaddr = address - bias; its rows are uw_rows[row_lo, row_lo + row_n).
 * Its page index is uw_pages[page_lo, page_lo + page_n): entry i holds the rows (relative to
 * row_lo) in force at the start of page page_first + i (vaddr >> UW_PAGE_SHIFT) and of the next
 * page, as first | last << 32: a pc's row lies between them, at most 2^UW_PAGE_ROWS_LOG2 apart
 * (a page with more hands over). */
struct uw_map {
    u64 start;
    u64 end;
    u64 bias;
    u32 row_lo;      /* UW_PENDING: not loaded */
    u32 row_n;       /* 0: the file has no CFI (frame pointers only) */
    u32 page_lo;
    u32 page_n;
    u32 page_first;
    u32 pad;
};

/* A process's mappings are uw_maps[slot * UW_MAPS, + n): looked up by key, not indexed in a map
 * value, so that the searches' indices need not be tracked exactly by the verifier. */
struct uw_proc {
    u32 slot;
    u32 n;
};

/* `targets` map values. */
struct target {
    u32 flags;       /* target_flags */
    s32 shift;       /* of the sampling mean (also in pid_hits, read where that is looked up) */
    u32 budget;      /* the process whose syscall-event budget it spends: a family's root (its
                        forks share one), 0 for its own */
    u32 members;     /* a family root's: forks registered by BPF and alive now */
};

/* CPython targets: per-process layout of the frame chain (sampler/python/runtime.py PyLayout). */
struct py_layout {
    u32 version;
    u16 tstate_frame;
    u16 cframe_frame;    /* 0xffff: no _PyCFrame indirection */
    u16 frame_code;
    u16 frame_back;
    u16 frame_instr;
    u16 frame_entry;     /* 0xffff: none */
};

struct usdt_arg {
    s64 val;        /* constant, or displacement of a dereference */
    u16 reg_off;    /* register: offset in struct pt_regs */
    u8 kind;        /* usdt_arg_kind */
    u8 size;        /* bytes */
    u8 is_signed;
    u8 pad[3];
};

struct usdt_spec {
    struct usdt_arg arg[USDT_MAX_ARGS];
    u32 nargs;
    u32 kind;       /* usdt_kind */
    u32 fn;         /* fn_id its records carry */
    u32 source;     /* ev_source of its allocations (read, not branched on: one verifier state) */
};
