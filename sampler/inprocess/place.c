/*
 * allocsampler-place: the one program that changes a running process for the inject tier
 * (sampler/inprocess/inject.py runs it; docs/security.md says what it trusts and why).
 *
 *   allocsampler-place place PID START CODE_FILE CODE_SPAN TOTAL_SPAN
 *       maps the sampler: prints "ok BASE TID STOP_NS INODE SIGNALS" (SIGNALS: held back meanwhile)
 *   allocsampler-place store PID START CODE_FILE BASE ENTRY STORE SYSCALL_AT < OPS
 *       writes words in the process (OPS: lines "ADDR EXPECTED VALUE FLAGS", hex), each one
 *       compare-and-exchange by a thread of the process running the sampler's inj_store_run:
 *       prints "ok TID STOP_NS", then "SEEN DONE" per op
 *   allocsampler-place check-fd PID FD
 *       the check `place` makes of the memfd the process answers with (tests run it alone)
 *   --held before `place` or `store`: the process may be stopped by SIGSTOP, and that stop is the
 *       recorder's own (a command it started, held at its entry point until the sampler is in):
 *       its thread is worked on in that stop and goes back to it afterwards
 * Anything else prints "error REASON" (exit 1), with the process as it was.
 *
 * START is the process's start time (/proc/PID/stat field 22): a pid that another process holds
 * now is refused. One thread is stopped with PTRACE_SEIZE + PTRACE_INTERRUPT (no SIGSTOP the process
 * could see). Its seccomp filters are read and run for every system call it will be made to make,
 * with their real arguments: a call the filters would not allow (kill, trap, errno, trace) is not
 * made. Then, for `place`, at the `syscall` instruction of its vDSO:
 *   mmap(NULL, TOTAL_SPAN, RW, PRIVATE|ANONYMOUS|NORESERVE)   the sampler's data and room for code;
 *                                                             the memfd's name is written there
 *   memfd_create("allocsampler", MFD_CLOEXEC|MFD_ALLOW_SEALING)
 *   mmap(base, CODE_SPAN, R|X, PRIVATE|FIXED, memfd, 0)       after the code is written and sealed
 *   close(memfd)
 * Every answer is treated as forged until checked: the memfd is duplicated with pidfd_getfd (never
 * reopened by number through /proc, which would reopen whatever file the process put there, with
 * root's rights) and must be an empty, unlinked, sealable tmpfs file called allocsampler, opened
 * read-write; the code is written through that duplicate and sealed before it is mapped; the maps
 * must then show our memfd's inode at base (sealed: its bytes can only be ours). For `store`, the process's
 * memory is opened after the stop (so it is the stopped thread's image), the sampler's whole code
 * must be at BASE, and the thread runs inj_store_run on the sampler's own stack.
 *
 * A separate process, in its own session and deaf to SIGINT/SIGTERM/SIGHUP, so that the recorder
 * dying mid-way cannot leave a thread running with our registers. No thread is left with them that
 * the process did not keep from us: a system call that outlasts the deadline (a slow seccomp
 * supervisor, mmap waiting for mmap_lock) is interrupted and waited for, what it did is undone, and
 * the registers are put back before this gives up; a call that faults before it starts (another
 * thread unmapped the vDSO) gives them back at once; only a thread that never stopped is left
 * untouched. The helper itself ends within ALLOCSAMPLER_PLACE_MAX_MS (HELPER_MAX_NS) whatever the
 * process does: a thread that its own process keeps inside our call past that (a supervisor that
 * never answers, a userfaultfd that never resolves) is left to return into our registers, which
 * only that process can cause and only it pays for. Signals that arrive for the thread
 * meanwhile are held back (no handler runs on our registers) and delivered again, with their own
 * siginfo, once it has its registers back.
 * A target that is already traced, a zombie, stopped by job control or in seccomp strict mode is
 * refused.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/magic.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "inject_abi.h"

#ifndef PTRACE_SECCOMP_GET_FILTER
#define PTRACE_SECCOMP_GET_FILTER 0x420c
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 2U
#endif

#define STOP_TIMEOUT_NS 2000000000LL
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516
#define MEMFD_NAME "allocsampler"
#define MAX_FILTERS 512
#define MAX_HELD 4096

static pid_t g_pid;
static unsigned long long g_start;
static int g_mem = -1;
static pid_t g_tid;                            /* the stopped thread */
static struct user_regs_struct g_back;         /* its registers to give back */
static int g_changed;                          /* we set other registers in it */
static siginfo_t g_held[MAX_HELD];             /* signals held back while it is ours */
static int g_nheld, g_held_total;
static int g_late;                             /* a call outlasted the deadline (interrupted, waited for) */
static int64_t g_deadline_ns = STOP_TIMEOUT_NS;
#define HELPER_MAX_NS 20000000000LL
static int64_t g_start_ns, g_end_ns;          /* the helper exits by g_end_ns, whatever the process does */
static int g_held_ok;                          /* --held: a SIGSTOP stop is the recorder's own */

static int64_t now_ns(void);

/* Gives a held signal back with its own siginfo: queued again (tgkill: the kernel lets no other
 * process queue a kernel-made siginfo), its delivery stop awaited, its siginfo put back there, and
 * delivered when the thread goes on. False when it did not come (blocked meanwhile: it stays
 * pending, with SI_TKILL's siginfo). */
static int redeliver(const siginfo_t *info, int *deliver)
{
    if (syscall(SYS_tgkill, g_pid, g_tid, info->si_signo))
        return 0;
    int64_t deadline = now_ns() + 200000000LL;
    for (int i = 0; i < 64 && now_ns() < deadline; i++) {
        if (ptrace(PTRACE_CONT, g_tid, 0, (void *)(uintptr_t)*deliver))
            return 0;
        *deliver = 0;
        int status;
        pid_t r;
        while ((r = waitpid(g_tid, &status, __WALL | WNOHANG)) == 0 && now_ns() < deadline)
            ;
        if (r != g_tid || !WIFSTOPPED(status))
            return 0;
        int sig = WSTOPSIG(status);
        if (status >> 16 == PTRACE_EVENT_STOP || sig == (SIGTRAP | 0x80))
            continue;
        if (sig == info->si_signo) {
            siginfo_t copy = *info;
            ptrace(PTRACE_SETSIGINFO, g_tid, 0, &copy);
            *deliver = sig;
            return 1;
        }
        *deliver = sig; /* another signal, its own: delivered as it came */
    }
    return 0;
}

static void release(void)
{
    if (g_changed && ptrace(PTRACE_SETREGS, g_tid, 0, &g_back) == 0)
        g_changed = 0;
    int deliver = 0, i = 0;
    if (g_tid && !g_changed)
        for (; i < g_nheld && redeliver(&g_held[i], &deliver); i++)
            ;
    if (g_tid)
        ptrace(PTRACE_DETACH, g_tid, 0, (void *)(uintptr_t)deliver);
    for (; i < g_nheld; i++) /* what could not be given back with its siginfo: at least the signal */
        syscall(SYS_tgkill, g_pid, g_tid, g_held[i].si_signo);
    g_nheld = 0;
    g_tid = 0;
}

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("error ", stdout);
    vprintf(fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    fflush(stdout);
    release(); /* its own registers back (exiting would detach it with ours) */
    exit(1);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int read_file(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    if (r < 0)
        return -1;
    buf[r] = 0;
    return (int)r;
}

/* The state letter of a /proc/.../stat (0: gone), and its start time (field 22). */
static char stat_of(const char *path, unsigned long long *start)
{
    char buf[1024];
    if (read_file(path, buf, sizeof buf) <= 0)
        return 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return 0;
    if (start) {
        /* after ") ": field 3 (state) ... field 22 (starttime) */
        char *q = p + 2;
        for (int f = 3; f < 22 && q; f++) {
            q = strchr(q, ' ');
            if (q)
                q++;
        }
        *start = q ? strtoull(q, NULL, 10) : 0;
    }
    return p[2];
}

static char thread_state(pid_t tid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d/stat", g_pid, tid);
    return stat_of(path, NULL);
}

/* The pid still names the process the recorder planned for (not one that reused the number). */
static void check_start(void)
{
    char path[64];
    unsigned long long start = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", g_pid);
    if (!stat_of(path, &start))
        fail("process %d is gone", g_pid);
    if (start != g_start)
        fail("pid %d is another process now (started at %llu, not %llu): not touched", g_pid, start, g_start);
}

/* The system call a sleeping thread is in (-1: running or unknown). */
static long thread_syscall(pid_t tid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/task/%d/syscall", g_pid, tid);
    if (read_file(path, buf, sizeof buf) <= 0 || buf[0] < '0' || buf[0] > '9')
        return -1;
    return strtol(buf, NULL, 10);
}

/* Calls that return EINTR rather than restart when a stop interrupts them (signal(7)): a thread
 * waiting in one is the last choice, since the application would see that EINTR. */
static int returns_eintr(long nr)
{
    switch (nr) {
    case SYS_epoll_wait: case SYS_epoll_pwait: case SYS_poll: case SYS_ppoll: case SYS_select:
    case SYS_pselect6: case SYS_io_getevents: case SYS_semtimedop: case SYS_rt_sigtimedwait:
#ifdef SYS_epoll_pwait2
    case SYS_epoll_pwait2:
#endif
        return 1;
    default:
        return 0;
    }
}

/* The thread to stop: one running in user space, else one sleeping in a call the kernel restarts,
 * else the first. */
static pid_t pick_thread(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", g_pid);
    DIR *d = opendir(path);
    if (!d)
        fail("process %d is gone", g_pid);
    pid_t running = 0, restartable = 0, any = 0;
    struct dirent *e;
    int seen = 0;
    while ((e = readdir(d)) && seen < 100000) {
        pid_t tid = atoi(e->d_name);
        if (tid <= 0)
            continue;
        seen++;
        char st = thread_state(tid);
        if (st == 'R' && !running)
            running = tid;
        else if (st == 'S' && !restartable && !returns_eintr(thread_syscall(tid)))
            restartable = tid;
        else if ((st == 'S' || st == 'D' || st == 'R' || (g_held_ok && st == 'T')) && !any)
            any = tid;
    }
    closedir(d);
    pid_t t = running ? running : restartable ? restartable : any;
    if (!t)
        fail("process %d has no thread that can be stopped (zombie or stopped)", g_pid);
    return t;
}

static int status_field(const char *buf, const char *name)
{
    const char *p = strstr(buf, name);
    return p ? atoi(p + strlen(name)) : -1;
}

static void refuse_unsuitable(void)
{
    char path[64], buf[8192];
    snprintf(path, sizeof path, "/proc/%d/status", g_pid);
    if (read_file(path, buf, sizeof buf) <= 0)
        fail("process %d is gone", g_pid);
    int tracer = status_field(buf, "\nTracerPid:");
    if (tracer > 0)
        fail("process %d is already traced by pid %d (a debugger): not touched", g_pid, tracer);
    char *st = strstr(buf, "\nState:");
    if (st && (strchr(g_held_ok ? "tZX" : "TtZX", st[8 + strspn(st + 8, " \t")])))
        fail("process %d is stopped, traced or a zombie: not touched", g_pid);
    if (status_field(buf, "\nSeccomp:") == SECCOMP_MODE_STRICT)
        fail("process %d runs in seccomp strict mode (any other system call kills it): not touched", g_pid);
}

/* -- seccomp: the thread's filters, run on the calls we will make ------------------------------ */

static struct sock_filter *g_filters[MAX_FILTERS];
static int g_filter_len[MAX_FILTERS], g_nfilters;

/* Reads the stopped thread's filters (newest first); none in mode 0. */
static void read_filters(pid_t tid)
{
    char path[64], buf[8192];
    snprintf(path, sizeof path, "/proc/%d/task/%d/status", g_pid, tid);
    if (read_file(path, buf, sizeof buf) <= 0)
        fail("thread %d is gone", tid);
    int mode = status_field(buf, "\nSeccomp:");
    if (mode == SECCOMP_MODE_STRICT)
        fail("process %d runs in seccomp strict mode (any other system call kills it): not touched", g_pid);
    if (mode != SECCOMP_MODE_FILTER)
        return;
    for (g_nfilters = 0; g_nfilters < MAX_FILTERS; g_nfilters++) {
        struct sock_filter *f = calloc(BPF_MAXINSNS, sizeof *f);
        if (!f)
            fail("out of memory");
        long n = ptrace(PTRACE_SECCOMP_GET_FILTER, tid, (void *)(uintptr_t)g_nfilters, f);
        if (n < 0) {
            free(f);
            if (errno == ENOENT && g_nfilters > 0)
                return;
            fail("cannot read the seccomp filters of %d (%s): not placed, since a filtered call could kill it",
                 g_pid, strerror(errno));
        }
        if (n == 0 || n > BPF_MAXINSNS)
            fail("a seccomp filter of %d has %ld instructions: not placed", g_pid, n);
        g_filters[g_nfilters] = f;
        g_filter_len[g_nfilters] = (int)n;
    }
    fail("process %d has over %d seccomp filters: not placed", g_pid, MAX_FILTERS);
}

/* Classic BPF as seccomp runs it (kernel/seccomp.c checks the same subset at load); returns the
 * filter's action, or SECCOMP_RET_KILL_PROCESS for anything it could not run. */
static uint32_t run_filter(const struct sock_filter *f, int len, const struct seccomp_data *d)
{
    uint32_t A = 0, X = 0, M[BPF_MEMWORDS] = {0};
    const unsigned char *data = (const unsigned char *)d;
    for (int pc = 0; pc < len; pc++) {
        const struct sock_filter *i = &f[pc];
        uint32_t k = i->k, src = BPF_SRC(i->code) == BPF_X ? X : k;
        switch (BPF_CLASS(i->code)) {
        case BPF_LD:
            if (i->code == (BPF_LD | BPF_W | BPF_ABS)) {
                if (k > sizeof *d - 4 || k % 4)
                    return SECCOMP_RET_KILL_PROCESS;
                memcpy(&A, data + k, 4);
            } else if (i->code == (BPF_LD | BPF_W | BPF_LEN)) {
                A = sizeof *d;
            } else if (i->code == (BPF_LD | BPF_IMM)) {
                A = k;
            } else if (i->code == (BPF_LD | BPF_MEM) && k < BPF_MEMWORDS) {
                A = M[k];
            } else {
                return SECCOMP_RET_KILL_PROCESS;
            }
            break;
        case BPF_LDX:
            if (i->code == (BPF_LDX | BPF_W | BPF_LEN))
                X = sizeof *d;
            else if (i->code == (BPF_LDX | BPF_IMM))
                X = k;
            else if (i->code == (BPF_LDX | BPF_MEM) && k < BPF_MEMWORDS)
                X = M[k];
            else
                return SECCOMP_RET_KILL_PROCESS;
            break;
        case BPF_ST:
            if (k >= BPF_MEMWORDS)
                return SECCOMP_RET_KILL_PROCESS;
            M[k] = A;
            break;
        case BPF_STX:
            if (k >= BPF_MEMWORDS)
                return SECCOMP_RET_KILL_PROCESS;
            M[k] = X;
            break;
        case BPF_ALU:
            switch (BPF_OP(i->code)) {
            case BPF_ADD: A += src; break;
            case BPF_SUB: A -= src; break;
            case BPF_MUL: A *= src; break;
            case BPF_DIV: if (!src) return SECCOMP_RET_KILL_PROCESS; A /= src; break;
            case BPF_MOD: if (!src) return SECCOMP_RET_KILL_PROCESS; A %= src; break;
            case BPF_AND: A &= src; break;
            case BPF_OR: A |= src; break;
            case BPF_XOR: A ^= src; break;
            case BPF_LSH: A = src >= 32 ? 0 : A << src; break;
            case BPF_RSH: A = src >= 32 ? 0 : A >> src; break;
            case BPF_NEG: A = -A; break;
            default: return SECCOMP_RET_KILL_PROCESS;
            }
            break;
        case BPF_JMP: {
            int taken;
            switch (BPF_OP(i->code)) {
            case BPF_JA:
                if (k >= (uint32_t)(len - pc - 1))
                    return SECCOMP_RET_KILL_PROCESS;
                pc += (int)k;
                continue;
            case BPF_JEQ: taken = A == src; break;
            case BPF_JGT: taken = A > src; break;
            case BPF_JGE: taken = A >= src; break;
            case BPF_JSET: taken = (A & src) != 0; break;
            default: return SECCOMP_RET_KILL_PROCESS;
            }
            pc += taken ? i->jt : i->jf; /* forward only: the loop ends */
            break;
        }
        case BPF_RET:
            return BPF_RVAL(i->code) == BPF_A ? A : k;
        case BPF_MISC:
            if (BPF_MISCOP(i->code) == BPF_TAX)
                X = A;
            else
                A = X;
            break;
        default:
            return SECCOMP_RET_KILL_PROCESS;
        }
    }
    return SECCOMP_RET_KILL_PROCESS; /* fell off the end: the kernel refuses such filters */
}

/* Fails unless every filter lets this call through. A user-notification supervisor may answer it
 * (every answer is checked, and a slow one interrupted), but not in `store`, whose thread runs our
 * code to its end (g_no_notify); a filter that would kill, trap, fail or trace the call means it is
 * never made. */
static int g_no_notify;

static void check_call(uint64_t ip, long nr, const uint64_t *args, const char *what)
{
    struct seccomp_data d = {.nr = (int)nr, .arch = AUDIT_ARCH_X86_64, .instruction_pointer = ip};
    memcpy(d.args, args, sizeof d.args);
    int32_t action = (int32_t)SECCOMP_RET_ALLOW;
    for (int i = 0; i < g_nfilters; i++) {
        int32_t a = (int32_t)(run_filter(g_filters[i], g_filter_len[i], &d) & SECCOMP_RET_ACTION_FULL);
        if (a < action)
            action = a;
    }
    uint32_t act = (uint32_t)action;
    if (act == SECCOMP_RET_ALLOW || act == SECCOMP_RET_LOG || (act == SECCOMP_RET_USER_NOTIF && !g_no_notify))
        return;
    const char *how = act == SECCOMP_RET_KILL_PROCESS || act == SECCOMP_RET_KILL_THREAD ? "kill it"
                      : act == SECCOMP_RET_TRAP ? "send it SIGSYS"
                      : act == SECCOMP_RET_ERRNO ? "fail it"
                      : act == SECCOMP_RET_USER_NOTIF ? "hand it to a user-space supervisor"
                      : "hand it to a tracer";
    fail("the seccomp filter of %d would %s on %s: not placed", g_pid, how, what);
}

/* -- stops ------------------------------------------------------------------------------------- */

static void on_alarm(int sig)
{
    (void)sig; /* only interrupts waitpid */
}

/* Waits for the next stop of tid; returns the status. Before our registers are in the thread a
 * missed deadline gives up (it never stopped: nothing changed). After, the thread is interrupted
 * and waited for without a limit: it must get its registers back. */
static int wait_stop(pid_t tid, int64_t deadline)
{
    int interrupted = 0;
    int64_t give_up = 0;
    for (;;) {
        int64_t now = now_ns(), left = deadline - now;
        if (left <= 0 && !interrupted) {
            if (!g_changed)
                fail("thread %d did not stop within %lld ms (an uninterruptible wait): released untouched", tid,
                     (long long)(g_deadline_ns / 1000000));
            ptrace(PTRACE_INTERRUPT, tid, 0, 0);
            interrupted = g_late = 1;
            give_up = now + 1000000000LL > g_end_ns ? now + 1000000000LL : g_end_ns;   /* a second to stop */
        }
        if (interrupted) {
            left = give_up - now;
            if (left <= 0) {
                /* the process keeps its thread inside our call (it never stops for the interrupt):
                 * nothing can give it its registers back; exiting detaches it */
                printf("error thread %d of %d did not come back from a system call within %lld s (the process "
                       "holds it there): the helper gave up, and the thread returns from that call with the "
                       "helper's registers\n", tid, g_pid, (long long)((g_end_ns - g_start_ns) / 1000000000));
                fflush(stdout);
                exit(1);
            }
        }
        {
            struct itimerval it = {{0, 0},
                                   {(time_t)(left / 1000000000), (suseconds_t)(left % 1000000000 / 1000 + 1)}};
            setitimer(ITIMER_REAL, &it, NULL);
        }
        int status;
        pid_t r = waitpid(tid, &status, __WALL);
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
        if (r == tid) {
            if (WIFEXITED(status) || WIFSIGNALED(status)) {
                int ours = g_changed;
                g_changed = 0;
                g_tid = 0;
                if (!ours)
                    return -1; /* it ended before anything of ours was in it: another may do */
                fail("thread %d ended while being placed into", tid);
            }
            return status;
        }
        if (r < 0 && errno != EINTR)
            fail("waitpid(%d): %s", tid, strerror(errno));
    }
}

static int is_syscall_stop(int status)
{
    return WIFSTOPPED(status) && WSTOPSIG(status) == (SIGTRAP | 0x80);
}

/* A signal stopped at its delivery: held back (no handler runs on our registers), given back with
 * its siginfo on release. */
static void hold(int sig)
{
    g_held_total++;
    if (g_nheld >= MAX_HELD)
        return; /* a flood: the kernel had already merged standard signals, and caps queued ones */
    if (ptrace(PTRACE_GETSIGINFO, g_tid, 0, &g_held[g_nheld]))
        g_held[g_nheld] = (siginfo_t){.si_signo = sig, .si_code = SI_TKILL};
    g_nheld++;
}

static uint64_t g_syscall_at; /* the vDSO's `syscall` instruction */
static int syscall_insn_mapped(uint64_t at);

/* A signal the thread's own instruction raised (a fault), not one sent to it. */
static int synchronous(int sig)
{
    siginfo_t si;
    if (sig != SIGSEGV && sig != SIGBUS && sig != SIGILL && sig != SIGFPE && sig != SIGTRAP)
        return 0;
    return ptrace(PTRACE_GETSIGINFO, g_tid, 0, &si) == 0 && si.si_code > 0;
}

/* Runs one system call in the stopped thread from its saved registers (seccomp checked first). A
 * signal that arrives meanwhile is held back; a fault before the call starts (the vDSO gone or
 * changed under us) gives the thread its registers back at once. */
static long remote_syscall(long nr, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6,
                           const char *what)
{
    uint64_t args[6] = {a1, a2, a3, a4, a5, a6};
    check_call(g_syscall_at, nr, args, what);
    if (!syscall_insn_mapped(g_syscall_at))
        fail("the vDSO of %d changed under the helper (another thread unmapped or replaced it): %s not made, the "
             "thread given back its registers", g_pid, what);
    struct user_regs_struct r = g_back;
    r.rip = g_syscall_at;
    r.rax = nr;
    r.orig_rax = (uint64_t)-1; /* no restart logic applies to these registers */
    r.rdi = a1;
    r.rsi = a2;
    r.rdx = a3;
    r.r10 = a4;
    r.r8 = a5;
    r.r9 = a6;
    g_changed = 1;
    if (ptrace(PTRACE_SETREGS, g_tid, 0, &r))
        fail("PTRACE_SETREGS: %s", strerror(errno));
    int64_t deadline = now_ns() + g_deadline_ns;
    int stops = 0;
    for (;;) {
        if (ptrace(PTRACE_SYSCALL, g_tid, 0, 0))
            fail("PTRACE_SYSCALL: %s", strerror(errno));
        int status = wait_stop(g_tid, deadline);
        if (is_syscall_stop(status)) {
            if (++stops == 2)
                break; /* the exit stop */
            continue;
        }
        if (status >> 16 == PTRACE_EVENT_STOP)
            continue; /* our interrupt, or a group-stop notification: go on */
        if (!stops && synchronous(WSTOPSIG(status)))
            fail("%s faulted before it started in %d (signal %d at the vDSO's syscall instruction: another thread "
                 "changed the vDSO): the thread given back its registers", what, g_pid, WSTOPSIG(status));
        hold(WSTOPSIG(status));
    }
    if (ptrace(PTRACE_GETREGS, g_tid, 0, &r))
        fail("PTRACE_GETREGS: %s", strerror(errno));
    return (long)r.rax;
}

static int is_error(long v)
{
    return (unsigned long)v >= (unsigned long)-4095L;
}

/* The address of a `syscall` instruction (0f 05) in the process's vDSO (its maps line's path is
 * exactly "[vdso]"). */
static uint64_t find_syscall_insn(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/maps", g_pid);
    FILE *f = fopen(path, "re");
    if (!f)
        fail("cannot read the maps of %d", g_pid);
    char line[4096];
    uint64_t lo = 0, hi = 0;
    while (fgets(line, sizeof line, f)) {
        uint64_t a, b;
        int name = 0;
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &a, &b, &name) == 2 && name > 0 &&
            strcmp(line + name, "[vdso]\n") == 0) {
            lo = a;
            hi = b;
            break;
        }
    }
    fclose(f);
    if (!lo || hi <= lo || hi - lo > (1 << 20))
        fail("process %d has no vDSO to run a system call from", g_pid);
    static unsigned char buf[1 << 20];
    ssize_t n = pread(g_mem, buf, hi - lo, (off_t)lo);
    for (ssize_t i = 0; i + 1 < n; i++)
        if (buf[i] == 0x0f && buf[i + 1] == 0x05)
            return lo + (uint64_t)i;
    fail("no syscall instruction in the vDSO of %d", g_pid);
}

/* The `syscall` instruction is still at `at` in an executable mapping: read again before each call,
 * since another thread of the process can unmap or replace the vDSO at any time. */
static int syscall_insn_mapped(uint64_t at)
{
    unsigned char insn[2];
    return pread(g_mem, insn, 2, (off_t)at) == 2 && insn[0] == 0x0f && insn[1] == 0x05;
}

/* The maps line that covers addr: its end, protection ("rwxp"), inode and path (0 if none). */
struct mapping {
    uint64_t start, end, inode;
    char prot[5];
    char path[256];
};

static int mapping_at(uint64_t addr, struct mapping *out)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/maps", g_pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        struct mapping m = {0};
        int name = 0;
        if (sscanf(line, "%lx-%lx %4s %*s %*s %lu %n", &m.start, &m.end, m.prot, &m.inode, &name) < 4)
            continue;
        if (addr < m.start || addr >= m.end)
            continue;
        if (name > 0) {
            snprintf(m.path, sizeof m.path, "%s", line + name);
            m.path[strcspn(m.path, "\n")] = 0;
        }
        *out = m;
        found = 1;
    }
    fclose(f);
    return found;
}

/* -- the memfd the process answers with -------------------------------------------------------- */

static int g_pidfd = -1;

/* Our duplicate of the process's fd `n`, when it is what we asked for: an empty, unlinked,
 * sealable memfd called allocsampler, open read-write; else -1 and why. */
static int take_memfd(long n, char *why, size_t whylen)
{
    int fd = (int)syscall(SYS_pidfd_getfd, g_pidfd, (int)n, 0);
    if (fd < 0) {
        snprintf(why, whylen, "pidfd_getfd(%ld): %s", n, strerror(errno));
        return -1;
    }
    struct statfs sf;
    struct stat st;
    char link[64], target[128] = {0};
    int flags = fcntl(fd, F_GETFL);
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t tl = readlink(link, target, sizeof target - 1);
    const char *bad = NULL;
    if (flags < 0 || (flags & O_PATH) || (flags & O_ACCMODE) != O_RDWR)
        bad = "it is not open read-write";
    else if (fstatfs(fd, &sf) || (sf.f_type != TMPFS_MAGIC && sf.f_type != HUGETLBFS_MAGIC))
        bad = "it is not on tmpfs";
    else if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_nlink != 0 || st.st_size != 0)
        bad = "it is not an empty unlinked file";
    else if (fcntl(fd, F_GET_SEALS) != 0)
        bad = "it cannot be sealed";
    else if (tl <= 0 || strcmp(target, "/memfd:" MEMFD_NAME " (deleted)") != 0)
        bad = "it is not our memfd";
    if (bad) {
        snprintf(why, whylen, "the process answered memfd_create with fd %ld, and %s", n, bad);
        close(fd);
        return -1;
    }
    return fd;
}

static void open_process(int need_mem)
{
    g_pidfd = (int)syscall(SYS_pidfd_open, g_pid, 0);
    if (g_pidfd < 0)
        fail("process %d is gone (%s)", g_pid, strerror(errno));
    if (g_start)
        check_start();
    if (need_mem) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/mem", g_pid);
        g_mem = open(path, O_RDWR | O_CLOEXEC);
        if (g_mem < 0)
            fail("cannot open /proc/%d/mem: %s", g_pid, strerror(errno));
        check_start(); /* the memory opened is that process's (the kernel binds it at open) */
    }
}

/* Seizes a thread and waits until it is stopped (another, when it ends first); fills g_back. */
static int64_t stop_thread(void)
{
    pid_t tid = 0;
    int status = -1;
    int64_t deadline = now_ns() + g_deadline_ns;
    for (int tries = 0; status == -1; tries++) {
        if (tries > 16)
            fail("the threads of %d kept ending before one could be stopped", g_pid);
        tid = pick_thread();
        if (ptrace(PTRACE_SEIZE, tid, 0, (void *)(uintptr_t)PTRACE_O_TRACESYSGOOD)) {
            if (errno == ESRCH)
                continue; /* ended meanwhile */
            fail("ptrace is not permitted on %d (%s): Yama ptrace_scope, seccomp or an LSM forbids it, or another "
                 "tracer is attached", g_pid, strerror(errno));
        }
        g_tid = tid;
        if (ptrace(PTRACE_INTERRUPT, tid, 0, 0) == 0)
            status = wait_stop(tid, deadline);
        else if (errno != ESRCH)
            fail("PTRACE_INTERRUPT: %s", strerror(errno));
        else
            g_tid = 0;
        while (status != -1 && status >> 16 != PTRACE_EVENT_STOP) {
            /* a signal-delivery-stop before our interrupt: deliver it, the interrupt stays pending */
            if (ptrace(PTRACE_CONT, tid, 0, (void *)(uintptr_t)WSTOPSIG(status)))
                fail("PTRACE_CONT: %s", strerror(errno));
            status = wait_stop(tid, deadline);
        }
    }
    /* a group-stop (SIGSTOP, SIGTSTP...): job control stops it; leave it, unless the stop is ours */
    if (WSTOPSIG(status) != SIGTRAP && !(g_held_ok && WSTOPSIG(status) == SIGSTOP))
        fail("process %d is being stopped by signal %d: not touched", g_pid, WSTOPSIG(status));
    int64_t t0 = now_ns();
    check_start();
    struct user_regs_struct saved, back;
    if (ptrace(PTRACE_GETREGS, tid, 0, &saved))
        fail("PTRACE_GETREGS: %s", strerror(errno));
    back = saved;
    /* Stopped inside a system call that the stop interrupted: restart it as the kernel would have,
     * by re-executing the `syscall` instruction (restart_syscall for a restart block). */
    if ((int64_t)saved.orig_rax >= 0) {
        long rc = (long)saved.rax;
        if (rc == -ERESTARTSYS || rc == -ERESTARTNOINTR || rc == -ERESTARTNOHAND) {
            back.rax = saved.orig_rax;
            back.rip -= 2;
        } else if (rc == -ERESTART_RESTARTBLOCK) {
            back.rax = SYS_restart_syscall;
            back.rip -= 2;
        }
    }
    g_back = back;
    read_filters(tid);
    return t0;
}

static uint64_t arg(const char *s)
{
    char *end;
    errno = 0;
    uint64_t v = strtoull(s, &end, 0);
    if (errno || *end || end == s)
        fail("bad argument %s", s);
    return v;
}

/* -- place ------------------------------------------------------------------------------------- */

static void write_code(int out, const char *code_file)
{
    int in = open(code_file, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        fail("cannot open %s: %s", code_file, strerror(errno));
    char buf[65536];
    ssize_t n;
    off_t off = 0;
    while ((n = read(in, buf, sizeof buf)) > 0) {
        if (pwrite(out, buf, (size_t)n, off) != n)
            fail("writing the code into the memfd: %s", strerror(errno));
        off += n;
    }
    close(in);
}

/* The bytes at addr in the process are the file's (the whole file), but that a recorder's uprobe may
 * have put an int3 over a nop (the sampler's USDT probe sites are nops). */
static int same_code(uint64_t addr, const char *code_file)
{
    int in = open(code_file, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return 0;
    static unsigned char a[65536], b[65536];
    ssize_t n;
    int same = 1;
    uint64_t off = 0;
    while (same && (n = read(in, a, sizeof a)) > 0) {
        same = pread(g_mem, b, (size_t)n, (off_t)(addr + off)) == n;
        for (ssize_t i = 0; same && i < n; i++)
            same = a[i] == b[i] || (a[i] == 0x90 && b[i] == 0xcc);
        off += (uint64_t)n;
    }
    close(in);
    return same && off > 0;
}

static int do_place(char **argv)
{
    g_pid = (pid_t)arg(argv[0]);
    g_start = arg(argv[1]);
    const char *code_file = argv[2];
    uint64_t code_span = arg(argv[3]), total_span = arg(argv[4]);
    if (g_pid <= 1 || !code_span || total_span <= code_span || code_span % 4096 || total_span % 4096)
        fail("bad arguments");
    struct stat cs;
    if (stat(code_file, &cs) || (uint64_t)cs.st_size > code_span)
        fail("the code file %s is missing or larger than its span", code_file);
    refuse_unsuitable();
    open_process(1);
    g_syscall_at = find_syscall_insn();
    int64_t t0 = stop_thread();
    /* every call first, with the arguments known now (checked again, exact, when made): a call the
     * filters refuse is found before anything changed */
    static const struct { long nr; uint64_t a[6]; const char *what; } plan[] = {
        {SYS_mmap, {0, 0, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, (uint64_t)-1, 0}, "mmap"},
        {SYS_memfd_create, {0, MFD_CLOEXEC | MFD_ALLOW_SEALING, 0, 0, 0, 0}, "memfd_create"},
        {SYS_mmap, {0, 0, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED, 0, 0}, "mmap of the code"},
        {SYS_close, {0}, "close"},
        {SYS_munmap, {0}, "munmap"},
    };
    for (size_t i = 0; i < sizeof plan / sizeof *plan; i++)
        check_call(g_syscall_at, plan[i].nr, plan[i].a, plan[i].what);

    const char *why = NULL;
    char whybuf[256];
    long base = remote_syscall(SYS_mmap, 0, total_span, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, (uint64_t)-1, 0, "mmap");
    struct mapping m;
    if (is_error(base))
        fail("mmap of %lu bytes failed in %d (%s)", (unsigned long)total_span, g_pid, strerror((int)-base));
    /* forged or not, it must be a fresh anonymous read-write region of that size: the name goes there */
    if (base % 4096 || !mapping_at((uint64_t)base, &m) || m.inode || m.path[0] || strcmp(m.prot, "rw-p") ||
        m.end < (uint64_t)base + total_span)
        fail("the process answered mmap with %#lx, which is not the region asked for: not placed", base);
    long fd = -1, code = -1;
    int ours = -1;
    static const char name[16] = MEMFD_NAME;
    if (g_late)
        why = "mmap took over the deadline";
    else if (pwrite(g_mem, name, sizeof name, (off_t)base) != sizeof name)
        why = "cannot write the memfd's name";
    else {
        fd = remote_syscall(SYS_memfd_create, (uint64_t)base, MFD_CLOEXEC | MFD_ALLOW_SEALING, 0, 0, 0, 0,
                            "memfd_create");
        if (is_error(fd) && g_late) {
            snprintf(whybuf, sizeof whybuf, "memfd_create did not return within %lld ms in %d (interrupted)",
                     (long long)(g_deadline_ns / 1000000), g_pid);
            why = whybuf;
            fd = -1;
        } else if (is_error(fd)) {
            snprintf(whybuf, sizeof whybuf, "memfd_create failed in %d (%s)", g_pid, strerror((int)-fd));
            why = whybuf;
            fd = -1;
        } else if (g_late) {
            why = "memfd_create took over the deadline";
        } else if ((ours = take_memfd(fd, whybuf, sizeof whybuf)) < 0) {
            why = whybuf;
        }
    }
    if (!why) {
        write_code(ours, code_file);
        if (fcntl(ours, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)) {
            snprintf(whybuf, sizeof whybuf, "sealing the memfd: %s", strerror(errno));
            why = whybuf;
        }
    }
    if (!why) {
        code = remote_syscall(SYS_mmap, (uint64_t)base, code_span, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED,
                              (uint64_t)fd, 0, "mmap of the code");
        struct stat os;
        fstat(ours, &os);
        if (code != base) {
            snprintf(whybuf, sizeof whybuf, "mmap of the code failed in %d (%s)", g_pid,
                     is_error(code) ? strerror((int)-code) : "another address");
            why = whybuf;
        } else if (!mapping_at((uint64_t)base, &m) || m.inode != os.st_ino || strcmp(m.prot, "r-xp")) {
            /* our sealed memfd's inode at base: its bytes are ours (F_SEAL_WRITE) */
            why = "the code is not where it was mapped (the process changed its maps meanwhile)";
        } else if (g_late) {
            why = "mmap of the code took over the deadline";
        }
    }
    if (fd >= 0)
        remote_syscall(SYS_close, (uint64_t)fd, 0, 0, 0, 0, 0, "close");
    if (why) /* nothing of ours stays behind */
        remote_syscall(SYS_munmap, (uint64_t)base, total_span, 0, 0, 0, 0, "munmap");
    int64_t stopped = now_ns() - t0;
    unsigned long inode = 0;
    if (ours >= 0) {
        struct stat os;
        if (!fstat(ours, &os))
            inode = (unsigned long)os.st_ino;
        close(ours);
    }
    pid_t tid = g_tid;
    release();
    if (why)
        fail("%s: not placed (the process was given back as it was)", why);
    printf("ok 0x%lx %d %lld %lu %d\n", (unsigned long)base, tid, (long long)stopped, inode, g_held_total);
    return 0;
}

/* -- store ------------------------------------------------------------------------------------- */

static struct inj_store g_req;

static int page_listed(uint64_t page)
{
    for (uint64_t i = 0; i < g_req.npages; i++)
        if (g_req.pages[i].addr == page)
            return 1;
    return 0;
}

static int do_store(char **argv)
{
    g_pid = (pid_t)arg(argv[0]);
    g_start = arg(argv[1]);
    const char *code_file = argv[2];
    uint64_t base = arg(argv[3]), entry = arg(argv[4]), store = arg(argv[5]), sys_at = arg(argv[6]);
    if (g_pid <= 1 || base % 4096 || store % 64)
        fail("bad arguments");
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        if (g_req.nops >= INJ_STORE_OPS)
            fail("more than %d writes at once", INJ_STORE_OPS);
        struct inj_store_op *op = &g_req.ops[g_req.nops];
        unsigned long long a, e, v, f;
        if (sscanf(line, "%llx %llx %llx %llx", &a, &e, &v, &f) != 4 || a % 8)
            fail("bad write %s", line);
        *op = (struct inj_store_op){.addr = a, .expected = e, .value = v, .flags = f};
        g_req.nops++;
    }
    refuse_unsuitable();
    open_process(0);
    int64_t t0 = stop_thread();
    /* the stopped thread's image: it cannot exec while stopped (another thread's exec kills it) */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", g_pid);
    g_mem = open(path, O_RDWR | O_CLOEXEC);
    if (g_mem < 0)
        fail("cannot open /proc/%d/mem: %s", g_pid, strerror(errno));
    if (!same_code(base, code_file))
        fail("the sampler's code is not at %#lx in %d (another image, or changed): nothing written",
             (unsigned long)base, g_pid);
    struct mapping m;
    if (!mapping_at(base + store, &m) || strcmp(m.prot, "rw-p") || m.inode ||
        m.end < base + store + sizeof(struct inj_store))
        fail("the sampler's data is not mapped in %d: nothing written", g_pid);
    for (uint64_t i = 0; i < g_req.nops; i++) {
        uint64_t a = g_req.ops[i].addr, page = a & ~4095ULL;
        if (!mapping_at(a, &m) || m.prot[3] != 'p')
            fail("%#lx is not in a private mapping of %d: nothing written", (unsigned long)a, g_pid);
        if (m.prot[1] == 'w' || page_listed(page))
            continue;
        if (g_req.npages >= INJ_STORE_PAGES)
            fail("writes over more than %d read-only pages at once", INJ_STORE_PAGES);
        uint64_t prot = (m.prot[0] == 'r' ? PROT_READ : 0) | (m.prot[2] == 'x' ? PROT_EXEC : 0);
        g_req.pages[g_req.npages++] =
            (struct inj_store_page){.addr = page, .len = 4096, .prot = prot, .write_prot = prot | PROT_WRITE};
        uint64_t rw[6] = {page, 4096, prot | PROT_WRITE, 0, 0, 0};
        uint64_t back[6] = {page, 4096, prot, 0, 0, 0};
        g_no_notify = 1;
        check_call(base + sys_at, SYS_mprotect, rw, "mprotect");
        check_call(base + sys_at, SYS_mprotect, back, "mprotect");
    }
    g_req.state = 0;
    if (pwrite(g_mem, &g_req, offsetof(struct inj_store, stack), (off_t)(base + store)) !=
        (ssize_t)offsetof(struct inj_store, stack))
        fail("cannot write the sampler's data in %d", g_pid);

    struct user_regs_struct r = g_back;
    r.rip = base + entry;
    r.rsp = (base + store + sizeof(struct inj_store)) & ~15ULL;
    r.rsp -= 8; /* as after a call */
    r.orig_rax = (uint64_t)-1;
    r.rax = 0;
    g_changed = 1;
    if (ptrace(PTRACE_SETREGS, g_tid, 0, &r))
        fail("PTRACE_SETREGS: %s", strerror(errno));
    int64_t deadline = g_end_ns; /* once it runs our code it finishes it, unless mprotect is held past our bound */
    for (;;) {
        if (ptrace(PTRACE_CONT, g_tid, 0, 0))
            fail("PTRACE_CONT: %s", strerror(errno));
        int status = wait_stop(g_tid, deadline);
        if (status >> 16 == PTRACE_EVENT_STOP || is_syscall_stop(status))
            continue;
        int sig = WSTOPSIG(status);
        struct user_regs_struct now;
        if (ptrace(PTRACE_GETREGS, g_tid, 0, &now))
            fail("PTRACE_GETREGS: %s", strerror(errno));
        int in_code = now.rip >= base && now.rip < base + store;
        if (sig == SIGTRAP && in_code)
            break; /* the int3 at its end (state says whether it got there) */
        if (in_code && (sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGFPE))
            fail("the writes faulted in %d (signal %d: the process unmapped a page meanwhile)", g_pid, sig);
        hold(sig);
    }
    static struct inj_store done;
    if (pread(g_mem, &done, offsetof(struct inj_store, stack), (off_t)(base + store)) !=
            (ssize_t)offsetof(struct inj_store, stack) ||
        done.state != INJ_STORE_DONE)
        fail("the writes did not complete in %d", g_pid);
    int64_t stopped = now_ns() - t0;
    pid_t tid = g_tid;
    release();
    printf("ok %d %lld\n", tid, (long long)stopped);
    for (uint64_t i = 0; i < g_req.nops; i++)
        printf("%llx %llu\n", (unsigned long long)done.ops[i].seen, (unsigned long long)done.ops[i].done);
    return 0;
}

/* -- check-fd ---------------------------------------------------------------------------------- */

static int do_check_fd(char **argv)
{
    g_pid = (pid_t)arg(argv[0]);
    open_process(0);
    char why[256];
    int fd = take_memfd((long)arg(argv[1]), why, sizeof why);
    if (fd < 0)
        fail("%s", why);
    printf("ok\n");
    return 0;
}

int main(int argc, char **argv)
{
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction alarm_action = {.sa_handler = on_alarm}; /* no SA_RESTART: waitpid returns EINTR */
    sigaction(SIGALRM, &alarm_action, NULL);
    const char *ms = getenv("ALLOCSAMPLER_PLACE_DEADLINE_MS");
    if (ms && atoll(ms) > 0)
        g_deadline_ns = atoll(ms) * 1000000LL;
    const char *max = getenv("ALLOCSAMPLER_PLACE_MAX_MS");
    g_start_ns = now_ns();
    g_end_ns = g_start_ns + (max && atoll(max) > 0 ? atoll(max) * 1000000LL : HELPER_MAX_NS);
    if (argc > 1 && strcmp(argv[1], "--held") == 0) {
        g_held_ok = 1;
        argc--;
        argv++;
    }
    if (argc == 7 && strcmp(argv[1], "place") == 0)
        return do_place(argv + 2);
    if (argc == 9 && strcmp(argv[1], "store") == 0)
        return do_store(argv + 2);
    if (argc == 4 && strcmp(argv[1], "check-fd") == 0)
        return do_check_fd(argv + 2);
    fail("usage: allocsampler-place [--held] place PID START CODE_FILE CODE_SPAN TOTAL_SPAN | store PID START CODE_FILE "
         "BASE ENTRY STORE SYSCALL_AT < OPS | check-fd PID FD");
}
