/* Shared library for unwind_self.c: reached through the PLT, calls back into the executable, so
 * the unwinder crosses two images and a PLT-called frame. */
#define NOINLINE __attribute__((noinline))

NOINLINE int lib_call(int (*cb)(int), int x)
{
    /* Work after the call keeps it a call (no sibling-call jump). */
    return cb(x + 1) * 3 + 1;
}
