/* exec from a thread that is not the main thread, then leak 96 MiB in the new image. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static char *self;
static void *volatile sink;
__attribute__((noinline)) void leak_after_exec(void)
{
    for (int i = 0; i < 24 * 1024; i++) { char *p = malloc(4096); p[0] = 1; sink = p; }
}
static void *run(void *arg)
{
    execl(self, self, "again", (char *)0);
    return arg;
}
int main(int argc, char **argv)
{
    char buf[4];
    if (argc > 1) {
        usleep(1500000);                 /* the recorder re-attaches after the exec */
        leak_after_exec();
        fprintf(stderr, "leaked\n");
        read(0, buf, 1);
        return 0;
    }
    self = argv[0];
    fprintf(stderr, "ready\n");
    if (read(0, buf, 1) != 1)
        return 1;
    pthread_t t;
    pthread_create(&t, NULL, run, NULL);
    pthread_join(t, NULL);
    return 1;
}
