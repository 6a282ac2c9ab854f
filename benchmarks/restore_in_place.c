// A measurement prototype, not part of gym_fork: restore a single-threaded Python process to a
// snapshot *in place* (the same process, only the pages written since copied back) instead of
// switching to a forked copy. See restore_in_place.py for what it measures and why it is not used.
//
//   snapshot: register every private writable mapping with userfaultfd in asynchronous
//             write-protect mode (the kernel then marks each page written, no fault handler),
//             write-protect them, save the register context (getcontext) and clone a holder
//             process that keeps the memory as it is now (copy-on-write) and runs no code that
//             writes it (its own stack, raw system calls only).
//   restore:  read the layout (/proc/self/maps: every mapping of the snapshot still there,
//             unchanged; anonymous ones added since are unmapped), ask PAGEMAP_SCAN for the
//             written pages, read their snapshot content from the holder (process_vm_readv) into
//             a staging area -- a failure up to here changes nothing --, then, on a separate stack
//             with every signal blocked, copy them into place and setcontext() back into the
//             snapshot call, which returns a second time (like fork()).
// Needs Linux >= 6.7 (UFFD_FEATURE_WP_ASYNC, PAGEMAP_SCAN); x86-64.
#define _GNU_SOURCE
#include <Python.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <linux/userfaultfd.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

// Newer than Debian bookworm's kernel headers.
#define FEATURE_WP_UNPOPULATED (1 << 13)
#define FEATURE_WP_ASYNC (1 << 15)
struct page_region { uint64_t start, end, categories; };
struct pm_scan_arg { uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
                     category_inverted, category_mask, category_anyof_mask, return_mask; };
#define PAGEMAP_SCAN_IOCTL _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_WPALLOWED (1 << 0)
#define PAGE_IS_WRITTEN (1 << 1)
#define PM_SCAN_WP_MATCHING 1

#define PG 4096UL
#define MAXV 8192
#define MAXR 65536
#define STACK_SZ (256 * 1024)
#define STAGE_SZ (512UL << 20)

enum { RESUMED = -1000 };
enum { T_MAPS, T_SCAN, T_STAGE, N_RANGES, N_PAGES, N_UNMAPPED, N_STATS };

struct vma { unsigned long start, end, off, ino; char perm[5]; int anon, special; };

// Everything that must survive a restore lives here: a private mapping that is never
// registered, never copied, and so keeps its content across the jump.
struct ctl {
    volatile int resumed;
    int holder;
    ucontext_t snap_ctx, back_ctx, work_ctx;
    int nv; struct vma v[MAXV];
    int ncur; struct vma cur[MAXV];
    int ncopy; struct iovec copy[MAXR];
    int nunmap; struct iovec unmap[MAXV];
    struct page_region scan[MAXR];
    long stat[N_STATS];
    char maps[4 << 20];
};

static struct ctl *C;
static char *holder_stack, *work_stack, *stage;
static unsigned long own_lo, own_hi;  // one mapping for all of the above
static int uffd = -1, pagemap = -1;

// A system call that touches no memory but its arguments (no errno).
static long rsys(long n, long a, long b, long c, long d, long e, long f) {
    long r;
    register long r10 __asm__("r10") = d, r8 __asm__("r8") = e, r9 __asm__("r9") = f;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return r;
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static int read_maps(struct vma *out) {
    int fd = (int)rsys(SYS_open, (long)"/proc/self/maps", O_RDONLY, 0, 0, 0, 0);
    if (fd < 0) return -1;
    long n = 0, r;
    while ((r = rsys(SYS_read, fd, (long)(C->maps + n), sizeof(C->maps) - 1 - n, 0, 0, 0)) > 0) n += r;
    rsys(SYS_close, fd, 0, 0, 0, 0, 0);
    C->maps[n] = 0;
    int k = 0;
    char *p = C->maps;
    while (*p && k < MAXV) {
        struct vma *v = &out[k++];
        v->start = strtoul(p, &p, 16); p++;
        v->end = strtoul(p, &p, 16); p++;
        memcpy(v->perm, p, 4); v->perm[4] = 0; p += 5;
        v->off = strtoul(p, &p, 16); p++;
        strtoul(p, &p, 16); p++; strtoul(p, &p, 16);  // device
        v->ino = strtoul(p, &p, 10);
        while (*p == ' ') p++;
        int heap = !strncmp(p, "[heap]", 6), stack = !strncmp(p, "[stack]", 7);
        v->anon = v->ino == 0 && (*p == '\n' || heap || stack);
        v->special = *p == '[' && !heap && !stack;
        while (*p && *p != '\n') p++;
        if (*p) p++;
    }
    return *p ? -1 : k;
}

static int own(const struct vma *v) { return v->start < own_hi && v->end > own_lo; }

static int trackable(const struct vma *v) {
    return v->perm[1] == 'w' && v->perm[3] == 'p' && !v->special && !own(v);
}

static long scan(unsigned long s, unsigned long e, uint64_t flags, uint64_t mask, uint64_t inverted) {
    struct pm_scan_arg a = {.size = sizeof a, .flags = flags, .start = s, .end = e, .vec = (uint64_t)C->scan,
                            .vec_len = MAXR, .category_inverted = inverted, .category_mask = mask,
                            .return_mask = mask};
    return rsys(SYS_ioctl, pagemap, PAGEMAP_SCAN_IOCTL, (long)&a, 0, 0, 0);
}

static int find(const struct vma *v, int n, unsigned long a) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int m = (lo + hi) / 2;
        if (a < v[m].start) hi = m - 1; else if (a >= v[m].end) lo = m + 1; else return m;
    }
    return -1;
}

static void add_copy(unsigned long s, unsigned long e) {
    struct iovec *last = C->ncopy ? &C->copy[C->ncopy - 1] : NULL;
    if (last && (unsigned long)last->iov_base + last->iov_len == s) { last->iov_len += e - s; return; }
    C->copy[C->ncopy].iov_base = (void *)s;
    C->copy[C->ncopy++].iov_len = e - s;
}

// Insertion sort by start: the list comes sorted from the scan but for the stack range added at
// its end. (Not qsort(): glibc's may malloc(), and nothing after the scan may write memory that
// is not copied back or ours.)
static void sort_copy(void) {
    for (int i = 1; i < C->ncopy; i++) {
        struct iovec x = C->copy[i];
        int j = i - 1;
        while (j >= 0 && (unsigned long)C->copy[j].iov_base > (unsigned long)x.iov_base) { C->copy[j + 1] = C->copy[j]; j--; }
        C->copy[j + 1] = x;
    }
}

int ip_init(void) {
    // One mapping, its flags (NORESERVE, DONTDUMP) unlike any the process makes, so the kernel
    // never merges it with a neighbour that is tracked and copied.
    unsigned long ctl_sz = (sizeof(struct ctl) + PG - 1) & ~(PG - 1), total = ctl_sz + 2 * STACK_SZ + STAGE_SZ;
    char *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED || madvise(base, total, MADV_DONTDUMP)) return -1;
    C = (struct ctl *)base;
    holder_stack = base + ctl_sz;
    work_stack = holder_stack + STACK_SZ;
    stage = work_stack + STACK_SZ;
    own_lo = (unsigned long)base;
    own_hi = own_lo + total;
    C->holder = -1;
    uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (uffd < 0) return -2;
    struct uffdio_api api = {.api = UFFD_API, .features = FEATURE_WP_ASYNC | FEATURE_WP_UNPOPULATED};
    if (ioctl(uffd, UFFDIO_API, &api)) return -3;
    pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    return pagemap < 0 ? -4 : 0;
}

// Start (or restart) write tracking: register what is not registered yet and write-protect it
// whole; re-protect the pages written in what is.
static int track(void) {
    int n = read_maps(C->cur);
    if (n < 0) return -1;
    for (int i = 0; i < n; i++) {
        struct vma *v = &C->cur[i];
        if (!trackable(v)) continue;
        long k = scan(v->start, v->end, 0, PAGE_IS_WPALLOWED, PAGE_IS_WPALLOWED);
        if (k < 0) return -2;
        for (long j = 0; j < k; j++) {
            struct uffdio_register r = {.range = {C->scan[j].start, C->scan[j].end - C->scan[j].start},
                                        .mode = UFFDIO_REGISTER_MODE_WP};
            struct uffdio_writeprotect w = {.range = r.range, .mode = UFFDIO_WRITEPROTECT_MODE_WP};
            if (ioctl(uffd, UFFDIO_REGISTER, &r) || ioctl(uffd, UFFDIO_WRITEPROTECT, &w)) return -3;
        }
        if (scan(v->start, v->end, PM_SCAN_WP_MATCHING, PAGE_IS_WRITTEN, 0) < 0) return -4;
    }
    return 0;
}

static int holder_main(void *arg) {
    (void)arg;
    rsys(SYS_prctl, PR_SET_NAME, (long)"inplace-holder", 0, 0, 0, 0);
    rsys(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0, 0);
    for (;;) rsys(SYS_pause, 0, 0, 0, 0, 0, 0);
    return 0;
}

// Take the snapshot (the previous one's holder is killed). Returns the holder's pid; RESUMED
// when a restore jumped back here; another negative number on failure.
long ip_snapshot(void) {
    if (C->holder > 0) { kill(C->holder, SIGKILL); C->holder = -1; }
    PyOS_BeforeFork();  // as os.fork(): what Python allocates for it is in the layout below
    if (track() < 0 || (C->nv = read_maps(C->v)) < 0) { PyOS_AfterFork_Parent(); return -20; }
    for (int i = 0; i < C->nv; i++)
        if (own(&C->v[i]) && (C->v[i].start != own_lo || C->v[i].end != own_hi)) { PyOS_AfterFork_Parent(); return -22; }
    C->resumed = 0;
    getcontext(&C->snap_ctx);
    if (C->resumed) {
        C->resumed = 0;
        PyOS_AfterFork_Parent();
        return RESUMED;
    }
    int pid = clone(holder_main, holder_stack + STACK_SZ, SIGCHLD, NULL);
    PyOS_AfterFork_Parent();
    if (pid < 0) return -21;
    return C->holder = pid;
}

// Runs on work_stack with every signal blocked: writes nothing but the pages it restores.
static void copy_back(void) {
    for (int i = 0; i < C->nunmap; i++) rsys(SYS_munmap, (long)C->unmap[i].iov_base, C->unmap[i].iov_len, 0, 0, 0, 0);
    char *src = stage;
    for (int i = 0; i < C->ncopy; i++) {
        memcpy(C->copy[i].iov_base, src, C->copy[i].iov_len);
        src += C->copy[i].iov_len;
    }
    C->resumed = 1;
    setcontext(&C->snap_ctx);
}

// Restore the last snapshot in place. Returns only on refusal or failure (a negative code),
// with nothing changed; on success ip_snapshot() returns RESUMED.
long ip_restore(void) {
    long t0 = now_ns();
    if (C->holder <= 0) return -30;
    int n = C->ncur = read_maps(C->cur);
    if (n < 0) return -31;
    C->ncopy = C->nunmap = 0;
    for (int i = 0; i < C->nv; i++) {  // every mapping of the snapshot, unchanged
        struct vma *s = &C->v[i];
        if (own(s)) continue;
        int j = find(C->cur, n, s->start);
        if (j < 0) return -32;
        struct vma *c = &C->cur[j];
        int stack_grew = !strcmp(c->perm, s->perm) && c->end == s->end && s->anon && c->anon && c->start <= s->start;
        if (!(c->start == s->start && c->end == s->end && !strcmp(c->perm, s->perm) && c->ino == s->ino &&
              c->off == s->off) && !stack_grew) return -33;
    }
    for (int j = 0; j < n; j++) {  // new private anonymous mappings go
        struct vma *c = &C->cur[j];
        if (own(c) || find(C->v, C->nv, c->start) >= 0 || find(C->v, C->nv, c->end - 1) >= 0) continue;
        if (!(c->anon && c->perm[3] == 'p')) return -34;
        C->unmap[C->nunmap].iov_base = (void *)c->start;
        C->unmap[C->nunmap++].iov_len = c->end - c->start;
    }
    long t1 = now_ns();
    unsigned long lo = 0, hi = 0;
    for (int i = 0; i < C->nv; i++)
        if (trackable(&C->v[i])) { if (!hi) lo = C->v[i].start; hi = C->v[i].end; }
    // From here on nothing may write the process's memory but this frame's stack (copied back
    // below) and the control mapping: a page written now but not listed would keep its new content.
    long k = scan(lo, hi, 0, PAGE_IS_WRITTEN, 0);
    if (k < 0 || k >= MAXR) return -35;
    for (long j = 0, vi = 0; j < k; j++) {  // unregistered mappings read as written: clip to tracked ones
        unsigned long a = C->scan[j].start, b = C->scan[j].end;
        while (vi < C->nv && C->v[vi].end <= a) vi++;
        for (long x = vi; x < C->nv && C->v[x].start < b; x++) {
            if (!trackable(&C->v[x])) continue;
            unsigned long s0 = a > C->v[x].start ? a : C->v[x].start, e0 = b < C->v[x].end ? b : C->v[x].end;
            if (s0 < e0) add_copy(s0, e0);
        }
    }
    // The live part of the main stack: this call's own frames may lie over the snapshot's.
    unsigned long sp_now = (unsigned long)&k & ~(PG - 1);
    unsigned long sp_snap = (unsigned long)C->snap_ctx.uc_mcontext.gregs[REG_RSP] & ~(PG - 1);
    int si = find(C->v, C->nv, sp_snap);
    if (si < 0) return -36;
    unsigned long from = (sp_now < sp_snap ? sp_now : sp_snap) - 16 * PG;
    add_copy(from > C->v[si].start ? from : C->v[si].start, C->v[si].end);
    sort_copy();
    int m = 0;
    unsigned long total = 0;
    for (int i = 0; i < C->ncopy; i++) {  // merge overlaps
        unsigned long s0 = (unsigned long)C->copy[i].iov_base, e0 = s0 + C->copy[i].iov_len;
        unsigned long pe = m ? (unsigned long)C->copy[m - 1].iov_base + C->copy[m - 1].iov_len : 0;
        if (m && pe >= s0) { if (e0 > pe) C->copy[m - 1].iov_len = e0 - (unsigned long)C->copy[m - 1].iov_base; }
        else C->copy[m++] = C->copy[i];
    }
    C->ncopy = m;
    for (int i = 0; i < m; i++) total += C->copy[i].iov_len;
    if (total > STAGE_SZ) return -37;
    long t2 = now_ns();
    unsigned long off = 0;
    for (int i = 0; i < m; i += 1024) {
        int cnt = m - i < 1024 ? m - i : 1024;
        unsigned long len = 0;
        for (int j = 0; j < cnt; j++) len += C->copy[i + j].iov_len;
        struct iovec local = {stage + off, len};
        if (process_vm_readv(C->holder, &local, 1, C->copy + i, cnt, 0) != (ssize_t)len) return -38;
        off += len;
    }
    long t3 = now_ns();
    C->stat[T_MAPS] = t1 - t0; C->stat[T_SCAN] = t2 - t1; C->stat[T_STAGE] = t3 - t2;
    C->stat[N_RANGES] = m; C->stat[N_PAGES] = total / PG; C->stat[N_UNMAPPED] = C->nunmap;
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);  // setcontext() puts back the snapshot's mask
    getcontext(&C->work_ctx);
    C->work_ctx.uc_stack.ss_sp = work_stack;
    C->work_ctx.uc_stack.ss_size = STACK_SZ;
    C->work_ctx.uc_link = NULL;
    makecontext(&C->work_ctx, copy_back, 0);
    swapcontext(&C->back_ctx, &C->work_ctx);
    return -39;  // not reached
}

long ip_stat(int i) { return i >= 0 && i < N_STATS ? C->stat[i] : 0; }
