/* Inlined frames for tests/binary/test_dwarf_lines.py: leaf() is inlined into middle(), which is inlined
 * into outer(), which main() calls. The one call of touch() in outer's code is leaf's: the tests
 * find it and expect the chain leaf -> middle -> outer, at the lines of the marker comments.
 * nested() is a GNU C nested function: a function of its own, defined inside with_nested(). */
#include <stdio.h>

#ifndef VARIANT
#define VARIANT "plain"
#endif
const char *variant = VARIANT; /* distinct builds get distinct build-ids */

__attribute__((noinline)) void touch(volatile int *p) { *p += 1; }

static inline __attribute__((always_inline)) int leaf(volatile int *p) {
    touch(p); /* @leaf-call */
    return *p;
}

static inline __attribute__((always_inline)) int middle(volatile int *p) {
    int r = leaf(p); /* @middle-call */
    return r + 1;
}

__attribute__((noinline)) int outer(volatile int *p) {
    return middle(p) * 2; /* @outer-call */
}

__attribute__((noinline)) int with_nested(volatile int *p) {
    __attribute__((noinline)) int nested(volatile int *q) {
        touch(q); /* @nested-call */
        return *q;
    }
    return nested(p) + 1;
}

int main(void) {
    volatile int v = 0;
    int r = outer(&v); /* @main-call */
    r += with_nested(&v);
    printf("%s %d\n", variant, r);
    return 0;
}
