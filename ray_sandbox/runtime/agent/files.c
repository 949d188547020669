/* File operations. Each answers with ERROR {errno, message} on failure; errno is what the
 * host maps to its typed file errors. Paths are used as given (the host checks them). */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define READ_CHUNK (256u * 1024)
#define NFTW_FDS 32

struct freq {
    char path[PATH_MAX];
    char path2[PATH_MAX];
    mode_t mode;
    int has_mode, append, parents, recursive, follow;
    int64_t offset, length; /* length < 0: to the end */
    size_t chunk;           /* READ frame size */
};

static int parse_freq(const struct frame *f, struct freq *q)
{
    struct tlv_iter it;
    struct tlv t;
    int rc;
    memset(q, 0, sizeof *q);
    q->length = -1;
    q->chunk = READ_CHUNK;
    tlv_start(&it, f);
    while ((rc = tlv_next(&it, &t)) > 0) {
        switch (t.tag) {
        case G_PATH:
            if (tlv_str(&t, q->path, sizeof q->path) < 0)
                return ENAMETOOLONG;
            break;
        case G_PATH2:
            if (tlv_str(&t, q->path2, sizeof q->path2) < 0)
                return ENAMETOOLONG;
            break;
        case G_MODE: q->mode = (mode_t)(tlv_int(&t) & 07777); q->has_mode = 1; break;
        case G_APPEND: q->append = tlv_int(&t) != 0; break;
        case G_PARENTS: q->parents = tlv_int(&t) != 0; break;
        case G_RECURSIVE: q->recursive = tlv_int(&t) != 0; break;
        case G_FOLLOW: q->follow = tlv_int(&t) != 0; break;
        case G_OFFSET: q->offset = tlv_int(&t); break;
        case G_LENGTH: q->length = tlv_int(&t); break;
        case G_CHUNK:
            q->chunk = tlv_int(&t) > 0 && tlv_int(&t) < FRAME_MAX ? (size_t)tlv_int(&t) : FRAME_MAX;
            break;
        default: break;
        }
    }
    if (rc < 0 || !q->path[0])
        return EINVAL;
    return 0;
}

/* Parses the request or answers the error; returns 0 to proceed, else the op's result. */
#define PARSE_OR_ANSWER(c, req, q)                                                            \
    do {                                                                                      \
        int e_ = parse_freq(req, q);                                                          \
        if (e_)                                                                               \
            return send_error(c, e_, "bad request: %s", strerror(e_));                        \
    } while (0)

static int answer(struct conn *c, int ok, const char *what, const char *path)
{
    if (ok)
        return send_ok(c);
    int e = errno;
    return send_error(c, e, "%s %s: %s", what, path, strerror(e));
}

static int file_type(mode_t m)
{
    return S_ISREG(m) ? 1 : S_ISDIR(m) ? 2 : S_ISLNK(m) ? 3 : 4;
}

#define ENTRY_BATCH 32768u

/* Queued output past this is written out; the reply's OK/ERROR flushes the rest. */
static int flush_batch(struct conn *c)
{
    return c->out_len - c->out_off >= ENTRY_BATCH ? conn_flush_some(c) : 0;
}

static int emit_entry(struct conn *c, const char *path, const struct stat *st, int dirfd,
                      const char *linkname)
{
    char link[PATH_MAX];
    out_begin(c, T_ENTRY);
    out_str(c, G_PATH, path);
    out_int(c, G_TYPE, file_type(st->st_mode));
    out_int(c, G_SIZE, st->st_size);
    out_int(c, G_MODE, st->st_mode & 07777);
    out_int(c, G_UID, st->st_uid);
    out_int(c, G_GID, st->st_gid);
    out_int(c, G_MTIME_NS, (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec);
    out_int(c, G_INO, (int64_t)st->st_ino);
    out_int(c, G_NLINK, (int64_t)st->st_nlink);
    out_int(c, G_DEV, (int64_t)st->st_dev);
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlinkat(dirfd, linkname, link, sizeof link - 1);
        if (n >= 0)
            out_put(c, G_LINK, link, (size_t)n);
    }
    out_end(c);
    /* Entries go out in batches: one write per entry was half the syscalls of a walk (each
     * one costs tens of microseconds under gVisor's ptrace platform). */
    return flush_batch(c);
}

/* mkdir -p: intermediate directories get 0755; the last one `mode` (umask bypassed). */
static int make_dirs(const char *path, mode_t mode, int exist_ok)
{
    char buf[PATH_MAX];
    struct stat st;
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        if (mkdir(buf, 0755) < 0) {
            if (errno != EEXIST)
                return -1;
            if (stat(buf, &st) == 0 && !S_ISDIR(st.st_mode)) {
                errno = ENOTDIR;
                return -1;
            }
        }
        *p = '/';
    }
    if (mkdir(buf, mode) < 0) {
        if (errno == EEXIST && exist_ok && stat(buf, &st) == 0 && S_ISDIR(st.st_mode))
            return 0;
        return -1;
    }
    return chmod(buf, mode);
}

static void split_dir(const char *path, char *dir, size_t cap, const char **base)
{
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (size_t)(slash - path) : 0;
    snprintf(dir, cap, "%.*s", (int)(n ? n : 1), n ? path : (slash ? "/" : "."));
    *base = slash ? slash + 1 : path;
}

int op_read(struct conn *c, const struct frame *req)
{
    struct freq q;
    struct stat st;
    PARSE_OR_ANSWER(c, req, &q);
    /* O_NONBLOCK: opening a planted FIFO must not block. Only regular files are read: the
     * host reads until EOF, and a symlink to /dev/zero would never end. */
    int fd = open(q.path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return answer(c, 0, "open", q.path);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int dir = S_ISDIR(st.st_mode);
        close(fd);
        errno = dir ? EISDIR : EINVAL;
        return answer(c, 0, dir ? "read" : "read (not a regular file)", q.path);
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (q.offset > 0 && lseek(fd, q.offset, SEEK_SET) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return answer(c, 0, "seek", q.path);
    }
    int64_t left = q.length;
    int ok = 1;
    while (left != 0) {
        size_t want = left > 0 && (uint64_t)left < q.chunk ? (size_t)left : q.chunk;
        unsigned char *p = conn_reserve(c, want);
        if (!p) {
            close(fd);
            return -1;
        }
        ssize_t n = read(fd, p, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ok = n == 0;
            break;
        }
        conn_commit(c, T_DATA, (size_t)n);
        if (conn_flush_some(c) < 0) {
            close(fd);
            return -1;
        }
        if (left > 0)
            left -= n;
    }
    int e = errno;
    close(fd);
    errno = e;
    return answer(c, ok, "read", q.path);
}

/* Where WRITE puts the data: a temp file renamed over the target (readers never see a half
 * file) unless appending, or the target is not a regular file, or its directory refuses
 * new files. Returns the fd, with tmp[0] == 0 when writing in place. */
static int open_for_write(const struct freq *q, char *tmp, size_t cap)
{
    struct stat st;
    int exists = lstat(q->path, &st) == 0;
    mode_t mode = q->has_mode ? q->mode : 0644;
    tmp[0] = 0;
    if (exists && S_ISDIR(st.st_mode)) {
        errno = EISDIR;
        return -1;
    }
    if (!q->append && (!exists || S_ISREG(st.st_mode) || S_ISLNK(st.st_mode))) {
        char dir[PATH_MAX];
        const char *base;
        split_dir(q->path, dir, sizeof dir, &base);
        if (snprintf(tmp, cap, "%s/.%.200s.rsb-XXXXXX", strcmp(dir, "/") ? dir : "", base)
            >= (int)cap) {
            errno = ENAMETOOLONG;
            return -1;
        }
        int fd = mkostemp(tmp, O_CLOEXEC);
        if (fd >= 0) {
            if (fchmod(fd, mode) == 0)
                return fd;
            int e = errno;
            close(fd);
            unlink(tmp);
            errno = e;
            return -1;
        }
        tmp[0] = 0; /* the directory refuses new files: opening the target says why */
    }
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (q->append ? O_APPEND : O_TRUNC);
    return open(q->path, flags, mode);
}

static int write_all(int fd, const unsigned char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int op_write(struct conn *c, const struct frame *req)
{
    struct freq q;
    char tmp[PATH_MAX];
    int e = parse_freq(req, &q), fd = -1;
    const char *what = "write";
    if (!e && q.parents) {
        char dir[PATH_MAX];
        const char *base;
        split_dir(q.path, dir, sizeof dir, &base);
        if (make_dirs(dir, 0755, 1) < 0) {
            e = errno == EEXIST ? ENOTDIR : errno; /* a parent exists as a non-directory */
            what = "create parents of";
        }
    }
    if (!e && (fd = open_for_write(&q, tmp, sizeof tmp)) < 0) {
        e = errno;
        what = "open";
    }
    /* The client streams DATA up to CLOSE without waiting; an early error is answered at
     * once (the client stops sending when it sees it) and the rest is skipped. */
    if (e)
        return send_error(c, e, "%s %s: %s", what, q.path, strerror(e)) < 0
                   ? -1
                   : (conn_skip_to_close(c) ? -1 : 0);
    struct frame f;
    for (;;) {
        int r = conn_recv(c, &f);
        if (r <= 0 || (f.type != T_DATA && f.type != T_CLOSE)) {
            e = EPROTO;
            break;
        }
        if (f.type == T_CLOSE)
            break;
        if (write_all(fd, f.data, f.len) < 0) {
            e = errno;
            break;
        }
    }
    if (close(fd) < 0 && !e)
        e = errno;
    if (!e && tmp[0] && rename(tmp, q.path) < 0)
        e = errno;
    if (e && tmp[0])
        unlink(tmp);
    if (e == EPROTO)
        return -1;
    if (e)
        return send_error(c, e, "write %s: %s", q.path, strerror(e)) < 0
                   ? -1
                   : (f.type == T_CLOSE ? 0 : (conn_skip_to_close(c) ? -1 : 0));
    return send_ok(c);
}

int op_stat(struct conn *c, const struct frame *req)
{
    struct freq q;
    struct stat st;
    PARSE_OR_ANSWER(c, req, &q);
    if ((q.follow ? stat(q.path, &st) : lstat(q.path, &st)) < 0)
        return answer(c, 0, "stat", q.path);
    if (emit_entry(c, q.path, &st, AT_FDCWD, q.path) < 0)
        return -1;
    return conn_flush(c);
}

int op_listdir(struct conn *c, const struct frame *req)
{
    struct freq q;
    struct stat st;
    PARSE_OR_ANSWER(c, req, &q);
    DIR *d = opendir(q.path);
    if (!d)
        return answer(c, 0, "list", q.path);
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue; /* removed meanwhile */
        rc = emit_entry(c, de->d_name, &st, dirfd(d), de->d_name);
    }
    closedir(d);
    return rc < 0 ? -1 : send_ok(c);
}

/* One file of READS: at most `length` bytes as DATA frames, then END {SIZE, ERRNO}. Only a
 * regular file is read, and a symlink is not followed. -1: the peer is gone. */
static int read_one(struct conn *c, const char *path, int64_t length, size_t chunk)
{
    struct stat st;
    int64_t sent = 0;
    int err = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0)
        err = errno;
    else if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        err = EINVAL;
    else {
        int flags = fcntl(fd, F_GETFL);
        if (flags >= 0)
            fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    }
    while (!err && sent < length) {
        size_t want = (uint64_t)(length - sent) < chunk ? (size_t)(length - sent) : chunk;
        unsigned char *p = conn_reserve(c, want);
        if (!p) {
            close(fd);
            return -1;
        }
        ssize_t n = read(fd, p, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            err = errno;
        if (n <= 0)
            break;
        conn_commit(c, T_DATA, (size_t)n);
        sent += n;
        if (flush_batch(c) < 0) {
            close(fd);
            return -1;
        }
    }
    if (fd >= 0)
        close(fd);
    out_begin(c, T_END);
    out_int(c, G_SIZE, sent);
    out_int(c, G_ERRNO, err);
    if (out_end(c) < 0)
        return -1;
    return flush_batch(c);
}

/* READS: several files in one request (the host's filesystem diffs read hundreds of small
 * files; one round trip each cost more than the reading). The request holds PATH, LENGTH
 * pairs, served in order as they are parsed; a file that cannot be read ends at once with
 * its errno. */
int op_reads(struct conn *c, const struct frame *req)
{
    struct tlv_iter it;
    struct tlv t;
    char path[PATH_MAX];
    int have_path = 0, rc;
    size_t chunk = READ_CHUNK;
    tlv_start(&it, req);
    while ((rc = tlv_next(&it, &t)) > 0) {
        if (t.tag == G_CHUNK && tlv_int(&t) > 0 && tlv_int(&t) < FRAME_MAX)
            chunk = (size_t)tlv_int(&t);
        else if (t.tag == G_PATH) {
            if (tlv_str(&t, path, sizeof path) < 0)
                return send_error(c, ENAMETOOLONG, "bad request: %s", strerror(ENAMETOOLONG));
            have_path = 1;
        } else if (t.tag == G_LENGTH && have_path) {
            have_path = 0;
            if (read_one(c, path, tlv_int(&t), chunk) < 0)
                return -1;
        }
    }
    if (rc < 0)
        return send_error(c, EINVAL, "bad request: %s", strerror(EINVAL));
    return send_ok(c);
}

/* nftw has no context argument; a handler serves one request at a time. */
static struct conn *walk_conn;
static size_t walk_skip;
static int walk_err;

static int walk_cb(const char *fpath, const struct stat *st, int type, struct FTW *ftw)
{
    if (ftw->level == 0 || type == FTW_NS)
        return 0;
    if (emit_entry(walk_conn, fpath + walk_skip, st, AT_FDCWD, fpath) < 0) {
        walk_err = EPIPE;
        return 1;
    }
    return 0;
}

int op_walk(struct conn *c, const struct frame *req)
{
    struct freq q;
    struct stat st;
    PARSE_OR_ANSWER(c, req, &q);
    size_t n = strlen(q.path);
    while (n > 1 && q.path[n - 1] == '/')
        q.path[--n] = 0;
    if (lstat(q.path, &st) < 0)
        return answer(c, 0, "walk", q.path);
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return answer(c, 0, "walk", q.path);
    }
    walk_conn = c;
    walk_skip = n == 1 ? 1 : n + 1;
    walk_err = 0;
    int rc = nftw(q.path, walk_cb, NFTW_FDS, FTW_PHYS);
    if (walk_err)
        return -1;
    return answer(c, rc == 0, "walk", q.path);
}

static int rm_cb(const char *fpath, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if ((type == FTW_DP ? rmdir(fpath) : unlink(fpath)) < 0 && errno != ENOENT) {
        walk_err = errno;
        return 1;
    }
    return 0;
}

int op_remove(struct conn *c, const struct frame *req)
{
    struct freq q;
    struct stat st;
    PARSE_OR_ANSWER(c, req, &q);
    if (lstat(q.path, &st) < 0)
        return answer(c, 0, "remove", q.path);
    if (!S_ISDIR(st.st_mode))
        return answer(c, unlink(q.path) == 0, "remove", q.path);
    if (!q.recursive)
        return answer(c, rmdir(q.path) == 0, "remove", q.path);
    walk_err = 0;
    if (nftw(q.path, rm_cb, NFTW_FDS, FTW_DEPTH | FTW_PHYS) != 0 && walk_err)
        errno = walk_err;
    return answer(c, walk_err == 0 && lstat(q.path, &st) < 0, "remove", q.path);
}

int op_mkdir(struct conn *c, const struct frame *req)
{
    struct freq q;
    PARSE_OR_ANSWER(c, req, &q);
    mode_t mode = q.has_mode ? q.mode : 0755;
    int ok;
    if (q.parents)
        ok = make_dirs(q.path, mode, 1) == 0;
    else
        ok = mkdir(q.path, mode) == 0 && chmod(q.path, mode) == 0;
    return answer(c, ok, "mkdir", q.path);
}

int op_symlink(struct conn *c, const struct frame *req)
{
    struct freq q;
    PARSE_OR_ANSWER(c, req, &q);
    return answer(c, symlink(q.path2, q.path) == 0, "symlink", q.path);
}

int op_chmod(struct conn *c, const struct frame *req)
{
    struct freq q;
    PARSE_OR_ANSWER(c, req, &q);
    return answer(c, chmod(q.path, q.mode) == 0, "chmod", q.path);
}

int op_rename(struct conn *c, const struct frame *req)
{
    struct freq q;
    PARSE_OR_ANSWER(c, req, &q);
    return answer(c, rename(q.path, q.path2) == 0, "rename", q.path);
}
