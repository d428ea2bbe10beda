/* Catches std::bad_alloc from huge `new` requests: a recorder must not turn that into std::terminate. */
#include <cstdio>
#include <new>
#include <unistd.h>
int main() {
  char buf[16];
  fprintf(stderr, "ready\n");
  read(0, buf, 1);
  int caught = 0;
  for (int i = 0; i < 5; i++) {
    try { char* p = new char[(1ULL << 46) + i]; p[0] = 1; } catch (const std::bad_alloc&) { caught++; }
  }
  fprintf(stderr, "caught %d\n", caught);
  read(0, buf, 1);
  return 0;
}
