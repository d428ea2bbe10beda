/*
 * A process that lies to the placement helper (tests/inprocess/test_inject_hostile.py runs it as nobody).
 *
 *   hostile MODE [ARG]
 *     notify-fd FILE    memfd_create is answered by a seccomp supervisor with an O_PATH fd of FILE
 *     notify-mmap       the anonymous mmap placement asks for is answered with an address of ours
 *     notify-slow [idle] memfd_create is answered after 3 s (idle: sleeps until the line, no
 *                       checksum: many of them on a small machine starve nothing else)
 *     notify-vdso       memfd_create's supervisor unmaps the process's vDSO, then lets the call go on:
 *                       the helper's next call, made at the vDSO's syscall instruction, would fault
 *     notify-never      memfd_create's supervisor receives the call and never answers, with the
 *                       caller in a killable wait (WAIT_KILLABLE_RECV): no interrupt brings it back
 *     kill-memfd        a seccomp filter kills the process on memfd_create
 *     strict            seccomp strict mode
 *     forge CODE        maps a copy of the sampler CODE (memfd "allocsampler", magic set) itself
 *     fds FILE          keeps fds for check-fd: 3 O_PATH of FILE, 4 our memfd name but not empty,
 *                       5 another name, 6 a good one
 *     exec PROG         execs PROG on "exec\n"
 *     fork-swap         on "fork\n" forks; the child maps a copy of the sampler it inherited, one byte
 *                       changed, over it and prints "PID ADDR VALUE" of a word of its own; on a
 *                       second line it prints that word and exits (the parent waits for it)
 * Prints "ready" (then, but for strict and exec, "PID" lines of its own state), computes a
 * checksum in its registers until a line arrives on stdin, then prints "ok CHECKSUM" where the
 * same computation done without interruption must agree.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int g_listener = -1;
static long g_answer;            /* what the supervisor answers with */
static int g_delay_s;
static int g_unmap_vdso, g_never;
static char g_data[1 << 16] __attribute__((aligned(4096)));

static int seccomp(unsigned op, unsigned flags, void *args)
{
    return (int)syscall(SYS_seccomp, op, flags, args);
}

static void filter(int nr, uint32_t action, int check_flags, uint32_t flags)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)nr, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* with check_flags: only calls with these flags (args[3]) and read-write (args[2]) */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[3])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, flags, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, check_flags ? SECCOMP_RET_ALLOW : action),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, PROT_READ | PROT_WRITE, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, check_flags ? SECCOMP_RET_ALLOW : action),
        BPF_STMT(BPF_RET | BPF_K, action),
    };
    struct sock_fprog prog = {sizeof f / sizeof *f, f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        exit(2);
#ifndef SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV
#define SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV (1UL << 5)
#endif
    unsigned flags_set = action == SECCOMP_RET_USER_NOTIF ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0;
    if (g_never)
        flags_set |= SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV;
    int r = seccomp(SECCOMP_SET_MODE_FILTER, flags_set, &prog);
    if (r < 0)
        exit(3);
    if (action == SECCOMP_RET_USER_NOTIF)
        __atomic_store_n(&g_listener, r, __ATOMIC_SEQ_CST);
}

static void *supervisor(void *x)
{
    (void)x;
    while (__atomic_load_n(&g_listener, __ATOMIC_SEQ_CST) < 0)
        usleep(1000);
    struct seccomp_notif *req = calloc(1, 4096);
    struct seccomp_notif_resp *resp = calloc(1, 4096);
    for (;;) {
        memset(req, 0, 4096);
        if (ioctl(g_listener, SECCOMP_IOCTL_NOTIF_RECV, req) < 0) {
            if (errno == EINTR)
                continue;
            return NULL;
        }
        if (g_never)
            for (;;)
                pause();            /* received, never answered */
        if (g_unmap_vdso) {
            char line[256];
            unsigned long lo = 0, hi = 0;
            FILE *maps = fopen("/proc/self/maps", "r");
            while (maps && fgets(line, sizeof line, maps))
                if (strstr(line, "[vdso]") && sscanf(line, "%lx-%lx", &lo, &hi) == 2)
                    break;
            if (maps)
                fclose(maps);
            if (lo)
                munmap((void *)lo, hi - lo);
        }
        if (g_delay_s)
            sleep((unsigned)g_delay_s);
        memset(resp, 0, 4096);
        resp->id = req->id;
        if (g_answer) {
            resp->val = g_answer;
        } else {
            resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        }
        ioctl(g_listener, SECCOMP_IOCTL_NOTIF_SEND, resp); /* ENOENT once the caller was interrupted */
    }
}

static uint64_t spin(volatile int *stop, uint64_t *rounds)
{
    uint64_t a = 1, b = 2, c = 3, d = 4, n = 0;
    while (!*stop) {
        for (int i = 0; i < 1000; i++) {
            a = a * 6364136223846793005ULL + b; b ^= a >> 7; c += a ^ d; d = c * 3 + n; n++;
        }
    }
    *rounds = n;
    return a ^ b ^ c ^ d;
}

static uint64_t again(uint64_t n)
{
    uint64_t a = 1, b = 2, c = 3, d = 4;
    for (uint64_t i = 0; i < n; i++) {
        a = a * 6364136223846793005ULL + b; b ^= a >> 7; c += a ^ d; d = c * 3 + i;
    }
    return a ^ b ^ c ^ d;
}

static volatile int g_stop;

static void *stdin_watch(void *x)
{
    (void)x;
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        exit(4);
    g_stop = 1;
    return NULL;
}

static int memfd(const char *name, unsigned flags)
{
    return (int)syscall(SYS_memfd_create, name, flags);
}

static volatile uint64_t g_word = 0x1122334455667788ULL;

/* The child of a placed process replaces the sampler's code it inherited with a changed copy. */
static int fork_swap(void)
{
    char line[256];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 4;
    pid_t child = fork();
    if (child > 0) {
        int status;
        return waitpid(child, &status, 0) == child && WIFEXITED(status) ? WEXITSTATUS(status) : 13;
    }
    unsigned long lo = 0, hi = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    while (maps && fgets(line, sizeof line, maps))
        if (strstr(line, "/memfd:allocsampler") && strstr(line, " r-xp ") &&
            sscanf(line, "%lx-%lx", &lo, &hi) == 2)
            break;
    if (!lo)
        return 11;
    /* page by page: the mapping is longer than the file (the kernel's copy fails past its end) */
    int fd = memfd("allocsampler", MFD_CLOEXEC);
    size_t len = 0;
    while (lo + len < hi && write(fd, (void *)(lo + len), 4096) == 4096)
        len += 4096;
    char b = (char)(*(volatile char *)(lo + 64) ^ 1);
    if (fd < 0 || !len || pwrite(fd, &b, 1, 64) != 1 ||
        mmap((void *)lo, hi - lo, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED, fd, 0) != (void *)lo)
        return 12;
    printf("%d %lx %lx\n", getpid(), (unsigned long)(uintptr_t)&g_word, (unsigned long)g_word);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 4;
    printf("%lx\n", (unsigned long)g_word);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    const char *mode = argv[1];
    pthread_t sup, watch;
    if (strcmp(mode, "exec") == 0) {
        printf("ready\n");
        fflush(stdout);
        char line[64];
        if (!fgets(line, sizeof line, stdin))
            return 4;
        execv(argv[2], argv + 2);
        return 5;
    }
    if (strcmp(mode, "fork-swap") == 0)
        return fork_swap();
    if (!strncmp(mode, "notify-", 7)) {
        pthread_create(&sup, NULL, supervisor, NULL);
        if (!strcmp(mode, "notify-fd")) {
            g_answer = open(argv[2], O_PATH | O_CLOEXEC);
            if (g_answer < 0)
                return 6;
            filter(SYS_memfd_create, SECCOMP_RET_USER_NOTIF, 0, 0);
        } else if (!strcmp(mode, "notify-mmap")) {
            g_answer = (long)(uintptr_t)g_data;
            filter(SYS_mmap, SECCOMP_RET_USER_NOTIF, 1, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE);
        } else {
            g_delay_s = !strcmp(mode, "notify-slow") ? 3 : 0;
            g_unmap_vdso = !strcmp(mode, "notify-vdso");
            g_never = !strcmp(mode, "notify-never");
            filter(SYS_memfd_create, SECCOMP_RET_USER_NOTIF, 0, 0);
        }
    } else if (!strcmp(mode, "kill-memfd")) {
        filter(SYS_memfd_create, SECCOMP_RET_KILL_PROCESS, 0, 0);
    } else if (!strcmp(mode, "forge")) {
        int fd = memfd("allocsampler", MFD_CLOEXEC);
        int in = open(argv[2], O_RDONLY);
        char buf[65536];
        ssize_t n;
        off_t off = 0;
        while ((n = read(in, buf, sizeof buf)) > 0)
            off += pwrite(fd, buf, (size_t)n, off);
        char *base = mmap(NULL, 0x20000 + (1 << 22), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        mmap(base, 0x20000, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED, fd, 0);
        /* the data's magic, at the offset of `inj` (the first thing after INJ_DATA_OFFSET) */
        *(uint64_t *)(base + strtoul(argv[3], NULL, 0)) = 0x31504d53434f4c41ULL;
        printf("%p\n", (void *)base);
    } else if (!strcmp(mode, "fds")) {
        int fds[4];
        fds[0] = open(argv[2], O_PATH);
        fds[1] = memfd("allocsampler", MFD_ALLOW_SEALING);
        if (write(fds[1], "x", 1) != 1)
            return 7;
        fds[2] = memfd("other", MFD_ALLOW_SEALING);
        fds[3] = memfd("allocsampler", MFD_ALLOW_SEALING);
        for (int i = 0; i < 4; i++)
            if (dup2(fds[i], 3 + i) < 0)
                return 8;
    }
    pthread_create(&watch, NULL, stdin_watch, NULL);
    printf("ready\n");
    fflush(stdout);
    if (!strcmp(mode, "strict")) {
        /* only read, write, exit: the checksum is written with write(2) */
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_STRICT))
            return 9;
        uint64_t n;
        uint64_t sum = spin(&g_stop, &n);
        char out[64];
        int len = snprintf(out, sizeof out, "ok %d\n", sum == again(n));
        if (write(1, out, (size_t)len) != len)
            syscall(SYS_exit, 10);
        syscall(SYS_exit, 0);
    }
    if (!strcmp(mode, "notify-slow") && argc > 2 && !strcmp(argv[2], "idle")) {
        pthread_join(watch, NULL);
        printf("ok 1\n");
        fflush(stdout);
        return 0;
    }
    uint64_t n;
    uint64_t sum = spin(&g_stop, &n);
    printf("ok %d\n", sum == again(n));
    fflush(stdout);
    return 0;
}
