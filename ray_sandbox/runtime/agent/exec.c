/* EXEC: start one command in its own session and stream its I/O over the connection.
 *
 * The handler is a child subreaper, so every descendant that loses its parent re-parents to
 * it; a timeout, SIGKILL request or lost client kills the process group and then, round by
 * round, every remaining child of the handler until none is left. */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <dirent.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define OUT_CHUNK 65536
#define GRACE_MS 100     /* output drain after the command exited */
#define KILL_ROUNDS 2000 /* ~2 s of 1 ms rounds to outlast a fork loop */

struct exec_req {
    char **argv;
    char **envp;
    const char *cwd;
    const char *user;
    int64_t timeout_ms;
    int64_t max_output;
    int pty;
    unsigned short rows, cols;
    char *arena;
    char *home_env;
};

struct run {
    pid_t pid;
    int status; /* valid once reaped */
    int reaped;
    int out_fd[2];  /* stdout, stderr (pty: master, -1) */
    int out_eof[2]; /* kept open until the end: closing a pty master hangs up the terminal */
    int in_fd;      /* stdin pipe or pty master; -1 once closed */
    int in_nonblock;
    const unsigned char *in_data; /* DATA frame being written; points into the conn buffer */
    size_t in_left;
    int close_stdin; /* CLOSE arrived while DATA was pending */
    int seen_close;
    int64_t total[2];
    int truncated, timed_out;
    int64_t started_us, ended_us;
};

static volatile sig_atomic_t got_sigchld;

static void on_sigchld(int sig)
{
    (void)sig;
    got_sigchld = 1;
}

void exec_init_signals(void)
{
    sigset_t block;
    struct sigaction sa = {.sa_handler = on_sigchld};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
    sigemptyset(&block);
    sigaddset(&block, SIGCHLD);
    sigprocmask(SIG_BLOCK, &block, NULL);
}

int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* Copies the request into one allocation: argv/envp arrays plus NUL-terminated strings. */
static int parse_req(const struct frame *f, struct exec_req *r, char *err, size_t errlen)
{
    struct tlv_iter it;
    struct tlv t;
    size_t nargs = 0, nenv = 0, bytes = 0;
    int env_set = 0, rc;
    memset(r, 0, sizeof *r);
    tlv_start(&it, f);
    while ((rc = tlv_next(&it, &t)) > 0) {
        if (t.tag == G_ARG || t.tag == G_ENV || t.tag == G_CWD || t.tag == G_USER) {
            if (memchr(t.val, 0, t.len)) {
                snprintf(err, errlen, "argument contains a NUL byte");
                return EINVAL;
            }
            bytes += t.len + 1;
        }
        nargs += t.tag == G_ARG;
        nenv += t.tag == G_ENV;
        env_set |= t.tag == G_ENV_SET;
    }
    if (rc < 0 || nargs == 0) {
        snprintf(err, errlen, rc < 0 ? "malformed exec request" : "empty argv");
        return EINVAL;
    }
    size_t nbase = 0;
    if (!env_set)
        while (environ && environ[nbase])
            nbase++;
    size_t slots = nargs + 1 + nbase + nenv + 2; /* +HOME, +NULL */
    r->arena = malloc(slots * sizeof(char *) + bytes);
    if (!r->arena) {
        snprintf(err, errlen, "out of memory");
        return ENOMEM;
    }
    r->argv = (char **)r->arena;
    r->envp = r->argv + nargs + 1;
    char *s = r->arena + slots * sizeof(char *);
    size_t ia = 0, ie = 0;
    for (; ie < nbase; ie++)
        r->envp[ie] = environ[ie];
    tlv_start(&it, f);
    while (tlv_next(&it, &t) > 0) {
        char *str = NULL;
        if (t.tag == G_ARG || t.tag == G_ENV || t.tag == G_CWD || t.tag == G_USER) {
            memcpy(s, t.val, t.len);
            s[t.len] = 0;
            str = s;
            s += t.len + 1;
        }
        switch (t.tag) {
        case G_ARG: r->argv[ia++] = str; break;
        case G_ENV: r->envp[ie++] = str; break;
        case G_CWD: r->cwd = str; break;
        case G_USER: r->user = str; break;
        case G_TIMEOUT_MS: r->timeout_ms = tlv_int(&t); break;
        case G_MAX_OUTPUT: r->max_output = tlv_int(&t); break;
        case G_PTY_ROWS: r->pty = 1; r->rows = (unsigned short)tlv_int(&t); break;
        case G_PTY_COLS: r->pty = 1; r->cols = (unsigned short)tlv_int(&t); break;
        default: break; /* unknown tags are ignored so newer clients can add fields */
        }
    }
    r->argv[ia] = NULL;
    r->envp[ie] = NULL;
    return 0;
}

/* Appends HOME=<home> unless the environment already has HOME. */
static int add_home(struct exec_req *r, const char *home)
{
    size_t n = 0;
    for (; r->envp[n]; n++)
        if (strncmp(r->envp[n], "HOME=", 5) == 0)
            return 0;
    size_t len = strlen(home) + 6;
    r->home_env = malloc(len);
    if (!r->home_env)
        return -1;
    snprintf(r->home_env, len, "HOME=%s", home);
    r->envp[n] = r->home_env;
    r->envp[n + 1] = NULL;
    return 0;
}

static int open_pty(int *master, int *slave, const struct exec_req *r)
{
    int unlock = 0, n;
    char name[64];
    *master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*master < 0)
        return -1;
    if (ioctl(*master, TIOCSPTLCK, &unlock) < 0 || ioctl(*master, TIOCGPTN, &n) < 0)
        goto fail;
    snprintf(name, sizeof name, "/dev/pts/%d", n);
    *slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*slave < 0)
        goto fail;
    struct winsize ws = {.ws_row = r->rows ? r->rows : 24, .ws_col = r->cols ? r->cols : 80};
    if (ioctl(*master, TIOCSWINSZ, &ws) == 0)
        return 0;
    close_fd(slave);
fail:;
    int e = errno;
    close_fd(master);
    errno = e;
    return -1;
}

/* Looks the command up in the command's own PATH, like a shell: 127 not found, 126 found but
 * not executable. Returns only on failure, with the errno to report. */
static int exec_search(char *const argv[], char *const envp[])
{
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return errno;
    }
    const char *path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    for (char *const *e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0)
            path = *e + 5;
    int eacces = 0;
    char buf[PATH_MAX];
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        int dirlen = (int)(end - p);
        if (snprintf(buf, sizeof buf, "%.*s/%s", dirlen ? dirlen : 1, dirlen ? p : ".", file)
            < (int)sizeof buf) {
            execve(buf, argv, envp);
            if (errno == EACCES)
                eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP
                     && errno != ENAMETOOLONG)
                return errno;
        }
        if (!*end)
            break;
        p = end;
    }
    return eacces ? EACCES : ENOENT;
}

/* Written by the vforked child before it gives up; the parent reads it once vfork returns
 * (it is suspended until then), so no pipe is needed. */
struct child_fail {
    int stage; /* 1 user, 2 cwd, 3 stdio/session */
    int err;
};

static void child_fail(volatile struct child_fail *f, int stage)
{
    f->err = errno;
    f->stage = stage;
    _exit(127);
}

/* Runs in the vforked child (sharing the handler's memory until exec): only syscalls and
 * stack buffers here, and it never returns. */
static void child_exec(const struct exec_req *r, const struct user *u, const int fds[3],
                       volatile struct child_fail *fail)
{
    sigset_t none;
    sigemptyset(&none);
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (setsid() < 0)
        child_fail(fail, 3);
    if (r->pty && ioctl(fds[0], TIOCSCTTY, 0) < 0)
        child_fail(fail, 3);
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0)
            child_fail(fail, 3);
    if (u->ngroups >= 0) {
        if (setgroups((size_t)u->ngroups, u->groups) < 0 || setgid(u->gid) < 0
            || setuid(u->uid) < 0)
            child_fail(fail, 1);
    }
    if (r->cwd && chdir(r->cwd) < 0)
        child_fail(fail, 2);
    int e = exec_search(r->argv, r->envp);
    dprintf(2, e == ENOENT ? "%s: command not found\n" : "%s: %s\n", r->argv[0], strerror(e));
    _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
}

static void reap(struct run *run)
{
    int st;
    pid_t p;
    got_sigchld = 0;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        if (p == run->pid) {
            run->status = st;
            run->reaped = 1;
            run->ended_us = now_us();
        }
    }
}

/* SIGKILLs every live child of this process (and its process group); returns how many.
 * Needs /proc; without it only the command's own process group is killed. */
static int kill_children(void)
{
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    pid_t self = getpid(), mypg = getpgrp();
    int found = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        char path[64], buf[512];
        if (de->d_name[0] < '1' || de->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%.20s/stat", de->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0)
            continue;
        buf[n] = 0;
        char *rp = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
        char state;
        int ppid, pgrp;
        if (!rp || sscanf(rp + 1, " %c %d %d", &state, &ppid, &pgrp) != 3)
            continue;
        if (ppid != self || state == 'Z')
            continue;
        pid_t pid = (pid_t)atoi(de->d_name);
        kill(pid, SIGKILL);
        if (pgrp > 1 && pgrp != mypg)
            kill(-pgrp, SIGKILL);
        found++;
    }
    closedir(d);
    return found;
}

static void kill_tree(struct run *run)
{
    kill(-run->pid, SIGKILL);
    for (int round = 0; round < KILL_ROUNDS; round++) {
        reap(run);
        if (kill_children() == 0)
            break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    reap(run);
}

static void close_streams(struct run *run)
{
    if (run->in_fd == run->out_fd[0]) /* pty: one fd for both directions */
        run->in_fd = -1;
    close_fd(&run->in_fd);
    close_fd(&run->out_fd[0]);
    close_fd(&run->out_fd[1]);
}

static void stdin_close(struct run *run, int pty)
{
    if (pty) { /* a terminal has no EOF: send the EOF character, as a user would */
        if (run->in_fd >= 0 && write(run->in_fd, "\x04", 1) < 0) { /* child gone */ }
    } else {
        close_fd(&run->in_fd);
    }
}

/* Writes pending stdin; drops it when the command closed its end. */
static void stdin_pump(struct run *run, int pty)
{
    while (run->in_left > 0 && run->in_fd >= 0) {
        ssize_t n = write(run->in_fd, run->in_data, run->in_left);
        if (n > 0) {
            run->in_data += n;
            run->in_left -= (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && errno == EAGAIN) {
            return;
        } else {
            run->in_left = 0;
            if (!pty)
                close_fd(&run->in_fd);
        }
    }
    run->in_left = 0;
    if (run->close_stdin) {
        run->close_stdin = 0;
        stdin_close(run, pty);
    }
}

/* Handles buffered client frames. Returns -1 on a protocol error. */
static int client_frames(struct conn *c, struct run *run, const struct exec_req *r)
{
    struct frame f;
    int rc;
    while (run->in_left == 0 && (rc = conn_take(c, &f)) != 0) {
        if (rc < 0)
            return -1;
        switch (f.type) {
        case T_DATA:
            if (run->in_fd < 0 || run->seen_close || f.len == 0)
                break;
            if (!run->in_nonblock) {
                fcntl(run->in_fd, F_SETFL, fcntl(run->in_fd, F_GETFL) | O_NONBLOCK);
                run->in_nonblock = 1;
            }
            run->in_data = f.data;
            run->in_left = f.len;
            stdin_pump(run, r->pty);
            break;
        case T_CLOSE:
            if (run->seen_close)
                break;
            run->seen_close = 1;
            if (run->in_left)
                run->close_stdin = 1;
            else
                stdin_close(run, r->pty);
            break;
        case T_SIGNAL:
            if (f.len != 4)
                return -1;
            if (get_u32(f.data) == SIGKILL)
                kill_tree(run);
            else if (!run->reaped)
                kill(-run->pid, (int)get_u32(f.data));
            break;
        case T_RESIZE:
            if (f.len != 4)
                return -1;
            if (r->pty) {
                struct winsize ws = {.ws_row = (unsigned short)(f.data[0] << 8 | f.data[1]),
                                     .ws_col = (unsigned short)(f.data[2] << 8 | f.data[3])};
                ioctl(run->out_fd[0], TIOCSWINSZ, &ws);
            }
            break;
        default:
            return -1;
        }
    }
    return 0;
}

/* Reads one chunk of output into the connection's queue; drops it beyond max_output. */
static void pump_output(struct conn *c, struct run *run, int stream, int64_t max_output)
{
    unsigned char *p = c->out + c->out_len + FRAME_HDR;
    ssize_t n = read(run->out_fd[stream], p, OUT_CHUNK);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) { /* EOF, or EIO from a pty whose last slave closed */
        run->out_eof[stream] = 1;
        if (run->in_fd == run->out_fd[stream]) {
            run->in_fd = -1;
            run->in_left = 0;
        }
        return;
    }
    int64_t keep = n;
    if (max_output > 0 && run->total[stream] + n > max_output) {
        keep = max_output - run->total[stream];
        if (keep < 0)
            keep = 0;
        run->truncated = 1;
    }
    run->total[stream] += keep;
    if (keep > 0)
        conn_commit(c, stream ? T_STDERR : T_STDOUT, (size_t)keep);
}

/* The I/O loop. Returns 0 when the command is done, -1 when the client is gone. */
static int exec_loop(struct conn *c, struct run *run, const struct exec_req *r,
                     const sigset_t *waitmask)
{
    int64_t deadline = r->timeout_ms > 0 ? run->started_us + r->timeout_ms * 1000 : -1;
    int64_t grace = -1;
    for (;;) {
        if (got_sigchld)
            reap(run);
        int64_t now = now_us();
        if (deadline >= 0 && now >= deadline && !run->timed_out) {
            run->timed_out = 1;
            kill_tree(run);
            continue;
        }
        if (run->reaped && grace < 0)
            grace = now + GRACE_MS * 1000;
        int outputs_open = (run->out_fd[0] >= 0 && !run->out_eof[0])
                           || (run->out_fd[1] >= 0 && !run->out_eof[1]);
        if (run->reaped && (!outputs_open || now >= grace))
            return 0;

        struct pollfd pf[4];
        int room = conn_out_room(c) >= FRAME_HDR + OUT_CHUNK;
        pf[0] = (struct pollfd){.fd = c->fd,
                                .events = (short)((run->in_left ? 0 : POLLIN)
                                                  | (c->out_len ? POLLOUT : 0))};
        for (int s = 0; s < 2; s++)
            pf[1 + s] = (struct pollfd){.fd = room && !run->out_eof[s] ? run->out_fd[s] : -1,
                                        .events = POLLIN};
        pf[3] = (struct pollfd){.fd = run->in_left ? run->in_fd : -1, .events = POLLOUT};
        int64_t wait = -1;
        if (deadline >= 0 && !run->timed_out)
            wait = deadline - now;
        if (grace >= 0 && (wait < 0 || grace - now < wait))
            wait = grace - now;
        struct timespec ts = {wait / 1000000, (wait % 1000000) * 1000};
        int n = ppoll(pf, 4, wait >= 0 ? &ts : NULL, waitmask);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (pf[0].revents & (POLLERR | POLLNVAL))
            return -1;
        if (pf[0].revents & POLLOUT && conn_flush_some(c) < 0)
            return -1;
        if (pf[0].revents & (POLLIN | POLLHUP)) {
            if (run->in_left == 0) {
                int got = conn_fill(c);
                if (got == 0 || (got < 0 && errno != EAGAIN))
                    return -1;
            } else {
                return -1; /* hang-up while stdin was blocked: the client is gone */
            }
        }
        if (client_frames(c, run, r) < 0) {
            errno = EPROTO;
            return -1;
        }
        if (pf[3].revents)
            stdin_pump(run, r->pty);
        for (int s = 0; s < 2; s++)
            if (pf[1 + s].revents && conn_out_room(c) >= FRAME_HDR + OUT_CHUNK)
                pump_output(c, run, s, r->max_output);
    }
}

/* The host let go of this command to checkpoint the sandbox (gVisor cannot save a socket
 * connected to the host): keep it running without a client, so it is in the image and goes
 * on in the sandbox and its restored copies. Its output is read and dropped, as a closed
 * pipe would kill it with SIGPIPE; stdin stays open. Returns when it exited and its output
 * streams are closed. */
static void detach_run(struct conn *c, struct run *run, const sigset_t *waitmask)
{
    close(c->fd);
    c->fd = -1;
    unsigned char sink[OUT_CHUNK];
    for (;;) {
        if (got_sigchld)
            reap(run);
        if (run->reaped && run->out_eof[0] && (run->out_fd[1] < 0 || run->out_eof[1]))
            return;
        struct pollfd pf[2];
        for (int s = 0; s < 2; s++)
            pf[s] = (struct pollfd){.fd = run->out_eof[s] ? -1 : run->out_fd[s],
                                    .events = POLLIN};
        if (ppoll(pf, 2, NULL, waitmask) < 0)
            continue;
        for (int s = 0; s < 2; s++) {
            if (!pf[s].revents)
                continue;
            ssize_t n = read(run->out_fd[s], sink, sizeof sink);
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
                run->out_eof[s] = 1;
        }
    }
}

static int send_exit(struct conn *c, const struct run *run, int retire, int64_t duration_us)
{
    int st = run->status, sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
    out_begin(c, T_EXIT);
    out_int(c, G_EXIT_CODE, sig ? 128 + sig : WEXITSTATUS(st));
    out_int(c, G_SIGNAL, sig);
    out_int(c, G_TIMED_OUT, run->timed_out);
    out_int(c, G_TRUNCATED, run->truncated);
    out_int(c, G_DURATION_US, duration_us);
    out_int(c, G_RETIRE, retire);
    return out_end(c) < 0 ? -1 : conn_flush(c);
}

static const char *stage_name(int stage)
{
    return stage == 1 ? "switch user" : stage == 2 ? "chdir" : "set up stdio";
}

int op_exec(struct conn *c, const struct frame *req)
{
    struct exec_req r;
    struct user u;
    char err[512];
    int e = parse_req(req, &r, err, sizeof err);
    if (e == 0)
        e = resolve_user(r.user, &u, err, sizeof err);
    if (e == 0 && add_home(&r, u.home) < 0) {
        e = ENOMEM;
        snprintf(err, sizeof err, "out of memory");
    }
    if (e) {
        free(r.arena);
        free(r.home_env);
        return send_error(c, e, "%s", err) < 0 ? 1 : conn_skip_to_close(c);
    }

    struct run run = {.out_fd = {-1, -1}, .in_fd = -1};
    volatile struct child_fail fail = {0, 0};
    int child[3] = {-1, -1, -1}, ok;
    if (r.pty) {
        ok = open_pty(&run.out_fd[0], &child[0], &r) == 0;
        if (ok) {
            child[1] = child[2] = child[0];
            run.in_fd = run.out_fd[0];
            if (u.ngroups >= 0 && fchown(child[0], u.uid, (gid_t)-1) < 0) { /* cosmetic */ }
        }
    } else {
        int p[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
        ok = pipe2(p[0], O_CLOEXEC) == 0 && pipe2(p[1], O_CLOEXEC) == 0
             && pipe2(p[2], O_CLOEXEC) == 0;
        child[0] = p[0][0], run.in_fd = p[0][1];
        run.out_fd[0] = p[1][0], child[1] = p[1][1];
        run.out_fd[1] = p[2][0], child[2] = p[2][1];
    }

    sigset_t waitmask; /* SIGCHLD stays blocked except inside ppoll */
    sigprocmask(SIG_SETMASK, NULL, &waitmask);
    sigdelset(&waitmask, SIGCHLD);

    run.started_us = now_us();
    /* vfork: on gVisor's ptrace platform every address space is a host process, so not
     * copying the handler's halves the cost of starting a command. */
    run.pid = ok ? vfork() : -1;
    if (run.pid == 0)
        child_exec(&r, &u, child, &fail);
    e = errno;
    for (int i = 0; i < 3; i++)
        if (i == 0 || child[i] != child[0])
            close_fd(&child[i]);
    if (run.pid > 0 && fail.stage) {
        waitpid(run.pid, NULL, 0);
        e = fail.err;
    }
    int close_conn;
    if (run.pid <= 0 || fail.stage) {
        close_streams(&run);
        const char *what = run.pid <= 0 ? "start" : stage_name(fail.stage);
        const char *arg = fail.stage == 2 ? r.cwd : fail.stage == 1 ? r.user : r.argv[0];
        close_conn = send_error(c, e, "%s %s: %s", what, arg ? arg : "", strerror(e)) < 0
                     || conn_skip_to_close(c);
    } else {
        out_begin(c, T_STARTED);
        out_int(c, G_PID, run.pid);
        out_end(c);
        if (exec_loop(c, &run, &r, &waitmask) < 0) {
            if (checkpoint_held())
                detach_run(c, &run, &waitmask);
            else
                kill_tree(&run);
            close_streams(&run);
            close_conn = 1;
        } else {
            close_streams(&run);
            /* Background descendants outlived the command: retire this handler so they
             * re-parent to init instead of being killed with the next command's tree. */
            pid_t left;
            while ((left = waitpid(-1, NULL, WNOHANG)) > 0)
                ;
            int retire = left == 0;
            close_conn = send_exit(c, &run, retire, run.ended_us - run.started_us) < 0 || retire
                         || (!run.seen_close && conn_skip_to_close(c));
        }
    }
    free(r.arena);
    free(r.home_env);
    return close_conn;
}
