/* Test workload for the DWARF unwinder: a chain of frames without frame pointers (build with
 * -O2 -fomit-frame-pointer) through a shared library called via the PLT (unwind_lib.c), an rbp
 * frame, a stack-realigning function (DRAP) and a signal handler run by raise(), first on the
 * main thread, then on a pthread. At the deepest point each thread captures its registers and
 * stack (unwind_capture.c) into <out>.main / <out>.thread. Then it prints "ready" and blocks
 * reading stdin, so that the test can read /proc/PID/maps. */
#include <alloca.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "unwind_capture.c"

#define NOINLINE __attribute__((noinline))

int lib_call(int (*cb)(int), int x);

static const char *out_prefix;
static const char *which;
static volatile int sink;

NOINLINE void capture(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", out_prefix, which);
    unwind_capture(path);
}

NOINLINE int in_handler(int x)
{
    capture();
    return x + sink;
}

static void on_signal(int sig)
{
    sink += in_handler(sig);
}

/* 64-byte aligned locals with alloca: gcc realigns the stack through a DRAP register, and the
 * CFA becomes an expression, *(rbp - 16). */
NOINLINE int realigned(int x, int n)
{
    volatile char buf[64] __attribute__((aligned(64)));
    volatile char *v = alloca(n);
    v[0] = 1;
    buf[0] = (char)x;
    raise(SIGUSR1);
    return buf[0] + x + v[0];
}

/* Aligned locals alone: an rbp frame, CFA = rbp + 16. */
NOINLINE int framed(int x)
{
    volatile char buf[64] __attribute__((aligned(64)));
    buf[0] = (char)x;
    return realigned(buf[0], x + 8) + 1;
}

NOINLINE int level2(int x)
{
    return framed(x * 2) + 1;
}

NOINLINE int level1(int x)
{
    return lib_call(level2, x) + 2;
}

static void *thread_main(void *arg)
{
    which = "thread";
    sink += level1((int)(intptr_t)arg);
    puts("ready");
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0)
        ;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT_PREFIX\n", argv[0]);
        return 2;
    }
    out_prefix = argv[1];
    signal(SIGUSR1, on_signal);
    which = "main";
    sink += level1(1);
    pthread_t t;
    if (pthread_create(&t, NULL, thread_main, (void *)(intptr_t)2))
        return 1;
    pthread_join(t, NULL);
    return 0;
}
