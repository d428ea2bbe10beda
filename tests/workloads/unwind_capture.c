/* Captures the calling thread's registers and stack as BPF would at a probe, for the DWARF
 * unwinder's tests: unwind_capture(path) writes
 *     u64 rip, u64 rsp, u64 rbp, u64 length, then the length bytes at [rsp, rsp + length),
 * copied up to the end of the stack mapping, at most UNWIND_MAX_COPY bytes. rip is inside
 * unwind_capture, so the unwind starts there. Built as a shared library (ctypes) or included. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define UNWIND_MAX_COPY (64 * 1024)

static uint64_t unwind_stack_end(uint64_t sp)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    uint64_t lo, hi, end = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && lo <= sp && sp < hi)
            end = hi;
    if (f)
        fclose(f);
    return end;
}

__attribute__((noinline)) void unwind_capture(const char *path)
{
    uint64_t rip, rsp, rbp;
    /* rip is the address of the instruction that reads rsp, so the three are consistent. */
    __asm__ volatile("lea 0(%%rip), %0\n\tmov %%rsp, %1\n\tmov %%rbp, %2" : "=r"(rip), "=r"(rsp), "=r"(rbp));
    uint64_t end = unwind_stack_end(rsp), len = end > rsp ? end - rsp : 0;
    if (len > UNWIND_MAX_COPY)
        len = UNWIND_MAX_COPY;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    uint64_t hdr[4] = {rip, rsp, rbp, len};
    /* Calls made from here on only write below rsp: the copied bytes are the frames above. */
    if (fd < 0 || write(fd, hdr, sizeof hdr) != sizeof hdr || write(fd, (void *)rsp, len) != (ssize_t)len)
        abort();
    close(fd);
}
