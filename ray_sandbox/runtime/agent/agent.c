/* rsb-agent: init (PID 1) of a sandbox and its in-sandbox executor.
 *
 *   rsb-agent init SOCKET   listen on SOCKET, fork one handler per connection, reap zombies
 *   rsb-agent version       print the version the host compares with its own
 *
 * The init loop only accepts, forks and reaps, so nothing a command does can crash it; all
 * request work happens in the per-connection handler processes. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define VERSION_STR "rsb-agent/" STR(PROTOCOL_VERSION) "+" RSB_SOURCE_HASH
#define STR(x) STR_(x)
#define STR_(x) #x
/* An idle sandbox must not wake: under ptrace every wake-up costs several host context
 * switches, and a 0.5 s poll made 1,000 idle sandboxes need more than 2 cores
 * (docs/scale.md, "Density"). Deletion of the socket by user code is seen through inotify
 * (inside gVisor every change made in the sandbox raises its event); the poll below is only
 * the fallback without inotify, and the backstop against an event that never comes. */
#define RECHECK_US 500000 /* socket path check without inotify, or while it cannot listen */
#define BACKSTOP_US 60000000 /* socket path check with inotify */
#define HOLD_RECHECK_US 2000 /* how often a held listener checks whether the hold ended */
#define HOLD_NAME "checkpoint.hold"

static volatile sig_atomic_t init_sigchld;
static char hold[PATH_MAX]; /* set by serve() before any handler is forked */

static void on_init_sigchld(int sig)
{
    (void)sig;
    init_sigchld = 1;
}

static void log_err(const char *what, const char *arg)
{
    fprintf(stderr, "rsb-agent: %s %s: %s\n", what, arg, strerror(errno));
}

static int dispatch(struct conn *c, const struct frame *f)
{
    switch (f->type) {
    case T_PING:
        out_begin(c, T_OK);
        out_str(c, G_VERSION, VERSION_STR);
        out_end(c);
        return conn_flush(c) < 0;
    case T_EXEC: return op_exec(c, f);
    case T_READ: return op_read(c, f) < 0;
    case T_WRITE: return op_write(c, f) < 0;
    case T_STAT: return op_stat(c, f) < 0;
    case T_LISTDIR: return op_listdir(c, f) < 0;
    case T_MKDIR: return op_mkdir(c, f) < 0;
    case T_REMOVE: return op_remove(c, f) < 0;
    case T_SYMLINK: return op_symlink(c, f) < 0;
    case T_CHMOD: return op_chmod(c, f) < 0;
    case T_RENAME: return op_rename(c, f) < 0;
    case T_WALK: return op_walk(c, f) < 0;
    case T_READS: return op_reads(c, f) < 0;
    default:
        send_error(c, EPROTO, "unknown request type %d", f->type);
        return 1;
    }
}

/* One connection, served until the client closes it (or it must be retired). */
static void handler(int fd)
{
    struct conn c;
    struct frame f;
    /* Orphaned descendants of commands re-parent here, so a timeout can find them all. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
        log_err("prctl", "PR_SET_CHILD_SUBREAPER");
    exec_init_signals();
    if (conn_init(&c, fd) < 0)
        _exit(1);
    while (conn_recv(&c, &f) > 0)
        if (dispatch(&c, &f))
            break;
    _exit(0);
}

/* Bound and listening under a temporary name, then renamed into place: a client never finds
 * a socket at `path` that refuses connections because it is not listening yet. */
static int listen_at(const char *path, ino_t *ino)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    struct stat st;
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.new", path) >= (int)sizeof a.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(a.sun_path, tmp, strlen(tmp) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    if (unlink(tmp) < 0 && errno != ENOENT) { /* bind reports what is in the way */ }
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 256) < 0
        || rename(tmp, path) < 0 || stat(path, &st) < 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        errno = e;
        return -1;
    }
    *ino = st.st_ino;
    return fd;
}

/* User code may delete or replace the socket file: then listen anew. */
static int socket_gone(const char *path, ino_t ino)
{
    struct stat st;
    return stat(path, &st) < 0 || st.st_ino != ino || !S_ISSOCK(st.st_mode);
}

static void accept_all(int lfd)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
                log_err("accept", "");
                struct timespec ts = {0, 10000000};
                nanosleep(&ts, NULL);
            }
            return;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(lfd);
            handler(fd);
        }
        if (pid < 0)
            log_err("fork", "handler");
        close(fd);
    }
}

int checkpoint_held(void)
{
    return hold[0] && access(hold, F_OK) == 0;
}

/* HOLD_NAME in the directory of the socket path. */
static void hold_path(const char *sock, char *out, size_t size)
{
    const char *slash = strrchr(sock, '/');
    int dir = slash ? (int)(slash - sock) : 1;
    snprintf(out, size, "%.*s/%s", dir, slash ? sock : ".", HOLD_NAME);
}

static void ensure_stdio(void)
{
    for (int i = 0; i < 3; i++) {
        if (fcntl(i, F_GETFD) >= 0)
            continue;
        int fd = open("/dev/null", O_RDWR);
        if (fd >= 0 && fd != i) {
            dup2(fd, i);
            close(fd);
        }
    }
}

/* An inotify fd that becomes readable when an entry of the socket's directory is removed,
 * renamed or created, or the directory itself goes; -1 if inotify is unavailable. The host's
 * own writes there (the hold file) raise no event inside gVisor: the host connects to wake
 * the listener instead. */
static int watch_socket_dir(const char *path)
{
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) + (slash == path) : 1,
             slash ? path : ".");
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    if (inotify_add_watch(fd, dir, IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
                                       | IN_DELETE_SELF | IN_MOVE_SELF | IN_ATTRIB) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Read every pending event; only their arrival matters. */
static void drain(int fd)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    while (read(fd, buf, sizeof buf) > 0)
        ;
}

static void serve(const char *path)
{
    /* gVisor does not shield a PID namespace's init from signals sent inside it (Linux
     * does): ignore every signal that can be ignored. SIGKILL and SIGSTOP cannot be. */
    for (int sig = 1; sig < NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD)
            signal(sig, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_init_sigchld};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
    sigset_t block, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    sigdelset(&waitmask, SIGCHLD);
    /* Outside a PID namespace (tests on the host) orphans should still come to us. */
    if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
        log_err("prctl", "PR_SET_CHILD_SUBREAPER");

    int lfd = -1, failed = 0, changed = 0;
    ino_t ino = 0;
    int64_t checked = 0;
    hold_path(path, hold, sizeof hold);
    int ifd = watch_socket_dir(path);
    if (ifd < 0)
        log_err("inotify", path); /* not fatal: the socket path is polled instead */
    for (;;) {
        /* gVisor cannot checkpoint a bound host socket: while the host holds a checkpoint
         * (HOLD_NAME next to the socket) the listener is closed and its path removed; the
         * host waits for that. A sandbox restored from the image wakes up here in its own,
         * fresh socket directory without the hold file and listens again. */
        int held = checkpoint_held();
        if (held && lfd >= 0) {
            close(lfd);
            unlink(path);
            lfd = -1;
        }
        int64_t now = now_us();
        int64_t recheck = ifd >= 0 && lfd >= 0 ? BACKSTOP_US : RECHECK_US;
        if (!held && (lfd < 0 || changed || now - checked >= recheck)) {
            checked = now;
            changed = 0;
            if (lfd < 0 || socket_gone(path, ino)) {
                if (lfd >= 0)
                    close(lfd);
                lfd = listen_at(path, &ino);
                if (lfd < 0 && !failed++)
                    log_err("listen", path);
                if (lfd >= 0)
                    failed = 0;
            }
        }
        struct pollfd p[2] = {{.fd = lfd, .events = POLLIN}, {.fd = ifd, .events = POLLIN}};
        int64_t wait_us = held ? HOLD_RECHECK_US : recheck;
        struct timespec ts = {wait_us / 1000000, (wait_us % 1000000) * 1000};
        int n = ppoll(p, 2, &ts, &waitmask);
        if (init_sigchld) {
            init_sigchld = 0;
            while (waitpid(-1, NULL, WNOHANG) > 0)
                ;
        }
        if (n > 0 && p[1].revents & POLLIN) {
            drain(ifd);
            changed = 1;
        }
        /* A connection may be the host waking us to see a new hold file: check first. */
        if (n > 0 && p[0].revents & POLLIN && !checkpoint_held())
            accept_all(lfd);
    }
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "version") == 0) {
        puts(VERSION_STR);
        return 0;
    }
    if (argc != 3 || strcmp(argv[1], "init") != 0) {
        fprintf(stderr, "usage: rsb-agent init SOCKET | rsb-agent version\n");
        return 2;
    }
    ensure_stdio();
    serve(argv[2]);
    return 1;
}
