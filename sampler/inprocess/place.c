/*
 * allocsampler-place: map the injected sampler's code into a running process without running any
 * code of ours in it (sampler/inprocess/inject.py runs it; docs/design.md: "Attach without a restart").
 *
 *   allocsampler-place PID CODE_FILE CODE_SPAN TOTAL_SPAN
 *
 * One thread of PID is stopped with PTRACE_SEIZE + PTRACE_INTERRUPT (no SIGSTOP the process could
 * see); at an existing `syscall` instruction of its vDSO it executes, with its registers set by us:
 *   memfd_create("allocsampler", MFD_CLOEXEC)      (the name written below the red zone of its stack)
 *   mmap(NULL, TOTAL_SPAN, RW, PRIVATE|ANONYMOUS|NORESERVE)   the sampler's data, and room for code
 *   mmap(base, CODE_SPAN, R|X, PRIVATE|FIXED, memfd, 0)       the code over the first CODE_SPAN
 *   close(memfd)
 * (we write CODE_FILE into the memfd through /proc/PID/fd between the first two); then its registers
 * are restored exactly, a system call it was stopped in rewound to restart as the kernel would, and
 * the thread detached. Prints one line: "ok BASE TID STOP_NS" or "error REASON" (exit 1).
 *
 * A separate process, in its own session and deaf to SIGINT/SIGTERM/SIGHUP, so that the recorder
 * dying mid-placement cannot leave a thread running with our registers: only this process, for the
 * few hundred microseconds the thread is stopped, has to live. Signals that arrive for the thread
 * meanwhile are held back (no handler runs on our registers) and sent to it again once it is
 * released; any failure after the registers changed restores them before this exits. A target that is already traced, a
 * zombie or stopped by job control is refused; a thread that does not stop within 2 s (an
 * uninterruptible wait) is released untouched (exiting detaches it).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <signal.h>
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
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define STOP_TIMEOUT_NS 2000000000LL
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516

static pid_t g_pid;
static int g_mem = -1;
static pid_t g_tid;                            /* the stopped thread */
static struct user_regs_struct g_back;         /* its registers to give back */
static int g_changed;                          /* we set other registers in it */
static int g_held[32], g_nheld;                /* signals held back while it is ours */

static void release(void)
{
    if (g_changed && ptrace(PTRACE_SETREGS, g_tid, 0, &g_back) == 0)
        g_changed = 0;
    if (g_tid)
        ptrace(PTRACE_DETACH, g_tid, 0, 0);
    for (int i = 0; i < g_nheld; i++)
        syscall(SYS_tgkill, g_pid, g_tid, g_held[i]);
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

/* The state letter of /proc/PID/task/TID/stat (0: gone). */
static char thread_state(pid_t tid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/task/%d/stat", g_pid, tid);
    if (read_file(path, buf, sizeof buf) <= 0)
        return 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' ? p[2] : 0;
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
    while ((e = readdir(d))) {
        pid_t tid = atoi(e->d_name);
        if (tid <= 0)
            continue;
        char st = thread_state(tid);
        if (st == 'R' && !running)
            running = tid;
        else if (st == 'S' && !restartable && !returns_eintr(thread_syscall(tid)))
            restartable = tid;
        else if ((st == 'S' || st == 'D' || st == 'R') && !any)
            any = tid;
    }
    closedir(d);
    pid_t t = running ? running : restartable ? restartable : any;
    if (!t)
        fail("process %d has no thread that can be stopped (zombie or stopped)", g_pid);
    return t;
}

static void refuse_unsuitable(void)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", g_pid);
    if (read_file(path, buf, sizeof buf) <= 0)
        fail("process %d is gone", g_pid);
    char *tp = strstr(buf, "\nTracerPid:");
    if (tp && atoi(tp + 11) != 0)
        fail("process %d is already traced by pid %d (a debugger): not touched", g_pid, atoi(tp + 11));
    char *st = strstr(buf, "\nState:");
    if (st && (strchr("TtZX", st[8 + strspn(st + 8, " \t")])))
        fail("process %d is stopped, traced or a zombie: not touched", g_pid);
}

static void on_alarm(int sig)
{
    (void)sig; /* only interrupts waitpid */
}

/* Waits for the next stop of tid (bounded by an alarm, not by polling: each stop is microseconds
 * away and a sleep would add its timer slack to every one); returns the status, or fails when it
 * ended or did not stop in time. */
static int wait_stop(pid_t tid, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0)
            fail("thread %d did not stop within %lld ms (an uninterruptible wait): released untouched", tid,
                 STOP_TIMEOUT_NS / 1000000);
        struct itimerval it = {{0, 0}, {(time_t)(left / 1000000000), (suseconds_t)(left % 1000000000 / 1000 + 1)}};
        setitimer(ITIMER_REAL, &it, NULL);
        int status;
        pid_t r = waitpid(tid, &status, __WALL);
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
        if (r == tid) {
            if (WIFEXITED(status) || WIFSIGNALED(status))
                fail("thread %d ended while being placed into", tid);
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

/* Runs one system call in the stopped thread; `base` are the registers to start from. A signal
 * that arrives meanwhile is held back (sent again on release). */
static long remote_syscall(pid_t tid, const struct user_regs_struct *base, uint64_t at, long nr, uint64_t a1,
                           uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6)
{
    struct user_regs_struct r = *base;
    r.rip = at;
    r.rax = nr;
    r.orig_rax = (uint64_t)-1; /* no restart logic applies to these registers */
    r.rdi = a1;
    r.rsi = a2;
    r.rdx = a3;
    r.r10 = a4;
    r.r8 = a5;
    r.r9 = a6;
    g_changed = 1;
    if (ptrace(PTRACE_SETREGS, tid, 0, &r))
        fail("PTRACE_SETREGS: %s", strerror(errno));
    int64_t deadline = now_ns() + STOP_TIMEOUT_NS;
    int stops = 0;
    for (;;) {
        if (ptrace(PTRACE_SYSCALL, tid, 0, 0))
            fail("PTRACE_SYSCALL: %s", strerror(errno));
        int status = wait_stop(tid, deadline);
        if (is_syscall_stop(status)) {
            if (++stops == 2)
                break; /* the exit stop */
            continue;
        }
        if (status >> 16 == PTRACE_EVENT_STOP)
            continue; /* a stray interrupt or group-stop notification: go on */
        if (g_nheld < (int)(sizeof g_held / sizeof *g_held))
            g_held[g_nheld++] = WSTOPSIG(status); /* a signal: held back, sent on release */
    }
    if (ptrace(PTRACE_GETREGS, tid, 0, &r))
        fail("PTRACE_GETREGS: %s", strerror(errno));
    return (long)r.rax;
}

/* The address of a `syscall` instruction (0f 05) in the process's vDSO. */
static uint64_t find_syscall_insn(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/maps", g_pid);
    FILE *f = fopen(path, "re");
    if (!f)
        fail("cannot read the maps of %d", g_pid);
    char line[512];
    uint64_t lo = 0, hi = 0;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "[vdso]")) {
            sscanf(line, "%lx-%lx", &lo, &hi);
            break;
        }
    }
    fclose(f);
    if (!lo || hi - lo > (1 << 20))
        fail("process %d has no vDSO to run a system call from", g_pid);
    static unsigned char buf[1 << 20];
    ssize_t n = pread(g_mem, buf, hi - lo, (off_t)lo);
    for (ssize_t i = 0; i + 1 < n; i++)
        if (buf[i] == 0x0f && buf[i + 1] == 0x05)
            return lo + (uint64_t)i;
    fail("no syscall instruction in the vDSO of %d", g_pid);
}

static void write_code(int target_fd, const char *code_file)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", g_pid, target_fd);
    int out = open(path, O_WRONLY | O_CLOEXEC);
    if (out < 0)
        fail("cannot open the memfd through %s: %s", path, strerror(errno));
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
    close(out);
}

int main(int argc, char **argv)
{
    if (argc != 5)
        fail("usage: allocsampler-place PID CODE_FILE CODE_SPAN TOTAL_SPAN");
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction alarm_action = {.sa_handler = on_alarm}; /* no SA_RESTART: waitpid returns EINTR */
    sigaction(SIGALRM, &alarm_action, NULL);
    g_pid = atoi(argv[1]);
    const char *code_file = argv[2];
    uint64_t code_span = strtoull(argv[3], NULL, 0), total_span = strtoull(argv[4], NULL, 0);
    if (g_pid <= 1 || !code_span || total_span <= code_span)
        fail("bad arguments");
    struct stat cs;
    if (stat(code_file, &cs) || (uint64_t)cs.st_size > code_span)
        fail("the code file %s is missing or larger than its span", code_file);
    refuse_unsuitable();
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", g_pid);
    g_mem = open(path, O_RDWR | O_CLOEXEC);
    if (g_mem < 0)
        fail("cannot open /proc/%d/mem: %s", g_pid, strerror(errno));
    uint64_t sc = find_syscall_insn();

    pid_t tid = pick_thread();
    if (ptrace(PTRACE_SEIZE, tid, 0, (void *)(uintptr_t)PTRACE_O_TRACESYSGOOD))
        fail("ptrace is not permitted on %d (%s): Yama ptrace_scope, seccomp or an LSM forbids it, or another "
             "tracer is attached", g_pid, strerror(errno));
    g_tid = tid;
    if (ptrace(PTRACE_INTERRUPT, tid, 0, 0))
        fail("PTRACE_INTERRUPT: %s", strerror(errno));
    int64_t deadline = now_ns() + STOP_TIMEOUT_NS;
    for (;;) {
        int status = wait_stop(tid, deadline);
        if (status >> 16 == PTRACE_EVENT_STOP) {
            int s = WSTOPSIG(status);
            if (s != SIGTRAP) /* a group-stop (SIGSTOP, SIGTSTP...): job control stops it; leave it */
                fail("process %d is being stopped by signal %d: not touched", g_pid, s);
            break;
        }
        /* a signal-delivery-stop before our interrupt: deliver it, the interrupt stays pending */
        if (ptrace(PTRACE_CONT, tid, 0, (void *)(uintptr_t)WSTOPSIG(status)))
            fail("PTRACE_CONT: %s", strerror(errno));
    }
    int64_t t0 = now_ns();

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

    /* memfd_create's name, below the red zone of the thread's stack (restored after) */
    uint64_t name_at = (saved.rsp - 128 - 64) & ~(uint64_t)15;
    static const char name[16] = "allocsampler";
    char old[16];
    if (pread(g_mem, old, sizeof old, (off_t)name_at) != sizeof old ||
        pwrite(g_mem, name, sizeof name, (off_t)name_at) != sizeof name)
        fail("cannot write the stack of %d", g_pid);
    long fd = remote_syscall(tid, &back, sc, SYS_memfd_create, name_at, MFD_CLOEXEC, 0, 0, 0, 0);
    if (pwrite(g_mem, old, sizeof old, (off_t)name_at) != sizeof old) {
        /* below the red zone: nothing of the thread's lives there while it is stopped */
    }
    long base = -1, code = -1;
    if (fd >= 0) {
        write_code((int)fd, code_file);
        base = remote_syscall(tid, &back, sc, SYS_mmap, 0, total_span, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, (uint64_t)-1, 0);
        if ((uint64_t)base < (uint64_t)-4095L) {
            code = remote_syscall(tid, &back, sc, SYS_mmap, (uint64_t)base, code_span, PROT_READ | PROT_EXEC,
                                  MAP_PRIVATE | MAP_FIXED, (uint64_t)fd, 0);
            if (code != base) /* nothing of ours stays behind */
                remote_syscall(tid, &back, sc, SYS_munmap, (uint64_t)base, total_span, 0, 0, 0, 0);
        }
        remote_syscall(tid, &back, sc, SYS_close, (uint64_t)fd, 0, 0, 0, 0, 0);
    }
    int64_t stopped = now_ns() - t0;
    release();
    if (fd < 0)
        fail("memfd_create failed in %d (%s): seccomp or an old kernel", g_pid, strerror((int)-fd));
    if ((uint64_t)base >= (uint64_t)-4095L)
        fail("mmap of %lu bytes failed in %d (%s)", (unsigned long)total_span, g_pid, strerror((int)-base));
    if (code != base)
        fail("mmap of the code failed in %d (%s)", g_pid, strerror((int)-code));
    printf("ok 0x%lx %d %lld\n", (unsigned long)base, tid, (long long)stopped);
    return 0;
}
