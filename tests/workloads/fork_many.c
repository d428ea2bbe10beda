/* A process whose family outgrows any recorder's tables (tests/record/test_families.py):
 * prints "ready", on a line forks N children that sleep until it exits, prints "forked N", and on a
 * second line (or end of input) exits, and they with it. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 1100;
    char line[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 1;
    int made = 0;
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        if (p == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);   /* they end with their parent */
            pause();
            _exit(0);
        }
        made += p > 0;
    }
    printf("forked %d\n", made);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 0;
    return 0;                                    /* the children get SIGKILL (PR_SET_PDEATHSIG) */
}
