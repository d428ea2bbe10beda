/* A small key-value server over TCP (scenario of tests/analysis/test_diagnoses.py): its keyspace grows
 * while clients add keys and plateaus while they overwrite them.
 *
 * usage: kv_server PORT      prints "ready" on stdout once listening; one thread, poll().
 * Protocol, one command per line:
 *   SET KEY N   store N bytes under KEY (replacing its value), reply "OK"
 *   STATS       reply "used BYTES keys COUNT requested REQ": BYTES is what the server holds for its
 *               keys (malloc_usable_size of every entry, key and value), REQ what it asked malloc
 *               for (the bytes a sampler of requests estimates): its own ground truth
 *   QUIT        close the connection */
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUCKETS (1 << 20)
#define MAXCONN 64
#define BUF 65536

struct entry {
    struct entry *next;
    char *key;
    char *value;
    size_t n;
};

static struct entry *table[BUCKETS];
static size_t used, keys, requested;

static unsigned long hash(const char *s)
{
    unsigned long h = 5381;
    while (*s)
        h = h * 33 + (unsigned char)*s++;
    return h;
}

__attribute__((noinline)) static char *store_value(size_t n)
{
    char *v = malloc(n);
    memset(v, 'v', n);
    return v;
}

__attribute__((noinline)) static struct entry *new_entry(const char *key)
{
    struct entry *e = calloc(1, sizeof *e);
    e->key = strdup(key);
    used += malloc_usable_size(e) + malloc_usable_size(e->key);
    requested += sizeof *e + strlen(key) + 1;
    keys++;
    return e;
}

static void kv_set(const char *key, size_t n)
{
    struct entry **b = &table[hash(key) & (BUCKETS - 1)], *e = *b;
    while (e && strcmp(e->key, key))
        e = e->next;
    if (!e) {
        e = new_entry(key);
        e->next = *b;
        *b = e;
    } else {
        used -= malloc_usable_size(e->value);
        requested -= e->n;
        free(e->value);
    }
    e->value = store_value(n);
    e->n = n;
    used += malloc_usable_size(e->value);
    requested += n;
}

struct conn {
    int fd;
    size_t len;
    char buf[BUF];
};

/* Handles the complete lines in c->buf; returns -1 when the connection should close. */
static int handle(struct conn *c)
{
    char out[BUF];
    size_t olen = 0, start = 0;
    for (size_t i = 0; i < c->len; i++) {
        if (c->buf[i] != '\n')
            continue;
        c->buf[i] = 0;
        char *line = c->buf + start, key[256];
        size_t n;
        start = i + 1;
        if (sscanf(line, "SET %255s %zu", key, &n) == 2 && n <= (1 << 20)) {
            kv_set(key, n);
            memcpy(out + olen, "OK\n", 3);
            olen += 3;
        } else if (!strcmp(line, "STATS")) {
            olen += snprintf(out + olen, sizeof out - olen, "used %zu keys %zu requested %zu\n", used, keys,
                             requested);
        } else if (!strcmp(line, "QUIT")) {
            return -1;
        }
        if (olen > sizeof out - 128) {
            if (write(c->fd, out, olen) < 0)
                return -1;
            olen = 0;
        }
    }
    memmove(c->buf, c->buf + start, c->len - start);
    c->len -= start;
    if (olen && write(c->fd, out, olen) < 0)
        return -1;
    return 0;
}

int main(int argc, char **argv)
{
    int port = argc > 1 ? atoi(argv[1]) : 7379, one = 1;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001)};
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 16))
        return perror("listen"), 1;
    printf("ready\n");
    fflush(stdout);
    struct pollfd pfd[MAXCONN + 1] = {{.fd = ls, .events = POLLIN}};
    struct conn *conns[MAXCONN + 1] = {0};
    int n = 1;
    for (;;) {
        if (poll(pfd, n, -1) < 0)
            continue;
        if (pfd[0].revents & POLLIN && n <= MAXCONN) {
            int fd = accept(ls, 0, 0);
            if (fd >= 0) {
                conns[n] = calloc(1, sizeof(struct conn));
                conns[n]->fd = fd;
                pfd[n++] = (struct pollfd){.fd = fd, .events = POLLIN};
            }
        }
        for (int i = 1; i < n; i++) {
            if (!(pfd[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            struct conn *c = conns[i];
            ssize_t r = read(c->fd, c->buf + c->len, BUF - 1 - c->len);
            if (r <= 0 || (c->len += r, handle(c)) < 0 || c->len >= BUF - 1) {
                close(c->fd);
                free(c);
                conns[i] = conns[n - 1];
                pfd[i--] = pfd[--n];
            }
        }
    }
}
