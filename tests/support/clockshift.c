/* A forward (or backward) step of one process's wall clock, for tests: LD_PRELOAD this into
 * redis-server and write an offset in seconds ("+3600") to the file named by CLOCKSHIFT_FILE;
 * gettimeofday(), time() and clock_gettime(CLOCK_REALTIME*) then report the real time plus
 * that offset (read again at most every 10 ms). Monotonic clocks are left alone, as a real
 * clock step leaves them.
 *
 * libfaketime does the same with FAKETIME_TIMESTAMP_FILE, but it cannot start Debian's
 * redis-server: jemalloc calls clock_gettime() while libfaketime initialises and the two
 * recurse (libfaketime issue #130). This shim never allocates: it uses raw system calls only.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile long long offset_us = 0;
static volatile long long next_read_ns = 0;

static long long monotonic_ns(void) {
    struct timespec ts;
    syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void refresh(void) {
    long long now = monotonic_ns();
    if (now < next_read_ns) return;
    next_read_ns = now + 10000000LL;
    const char *path = getenv("CLOCKSHIFT_FILE");
    if (path == NULL) return;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY);
    if (fd < 0) return;
    char buf[64];
    long n = (long)syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return;
    buf[n] = 0;
    int i = 0, negative = 0;
    long long seconds = 0;
    while (buf[i] == ' ' || buf[i] == '+') i++;
    if (buf[i] == '-') { negative = 1; i++; }
    while (buf[i] >= '0' && buf[i] <= '9') seconds = seconds * 10 + (buf[i++] - '0');
    offset_us = (negative ? -seconds : seconds) * 1000000LL;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    int r = (int)syscall(SYS_gettimeofday, tv, tz);
    if (r == 0 && tv != NULL) {
        refresh();
        long long us = (long long)tv->tv_sec * 1000000LL + tv->tv_usec + offset_us;
        tv->tv_sec = us / 1000000LL;
        tv->tv_usec = us % 1000000LL;
    }
    return r;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int r = (int)syscall(SYS_clock_gettime, clock, ts);
    if (r == 0 && ts != NULL && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        refresh();
        ts->tv_sec += offset_us / 1000000LL;
    }
    return r;
}

time_t time(time_t *out) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    if (out != NULL) *out = tv.tv_sec;
    return tv.tv_sec;
}
