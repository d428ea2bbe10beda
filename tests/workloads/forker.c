/* Parent leaks a little, forks a child that leaks 32 MiB, waits for it; then exits. */
#include <stdlib.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/wait.h>
static void *volatile sink;
__attribute__((noinline)) void child_leak(void)
{
    for (int i = 0; i < 8192; i++) { char *p = malloc(4096); p[0] = 1; sink = p; }
}
int main(int argc, char **argv)
{
    usleep(argc > 1 ? atoi(argv[1]) * 1000 : 300000);   /* let the recorder attach */
    pid_t pid = fork();
    if (pid == 0) {
        usleep(500000);                                  /* time to attach to the child */
        child_leak();
        sleep(2);                                        /* one snapshot while it holds memory */
        return 0;
    }
    int status;
    waitpid(pid, &status, 0);
    return 3;                                            /* a distinctive exit status */
}
