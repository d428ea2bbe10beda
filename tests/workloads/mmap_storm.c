/* mmap + munmap of 1 MiB in a tight loop: a burst of syscall events faster than a reader. */
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
int main(int argc, char **argv)
{
    time_t end = time(NULL) + (argc > 1 ? atoi(argv[1]) : 20);
    while (time(NULL) < end) {
        void *p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        munmap(p, 1 << 20);
    }
    return 0;
}
