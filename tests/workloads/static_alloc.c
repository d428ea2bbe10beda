/* A statically linked target: its allocator lives in the executable itself. */
#include <stdlib.h>
#include <stdio.h>
#include <unistd.h>
int main(void)
{
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        free(malloc(100));
        usleep(10000);
    }
}
