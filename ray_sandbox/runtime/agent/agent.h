/* Operations served by a connection handler (one forked process per client connection). */
#ifndef RSB_AGENT_H
#define RSB_AGENT_H

#include <stdint.h>
#include <sys/types.h>

#include "wire.h"

#ifndef RSB_SOURCE_HASH
#define RSB_SOURCE_HASH "dev"
#endif

/* True while the host holds a checkpoint (its hold file exists next to the socket): a
 * client that goes away then detaches its command instead of killing it. */
int checkpoint_held(void);

/* Blocks SIGCHLD (EXEC waits for it inside ppoll); call once per handler. */
void exec_init_signals(void);
int64_t now_us(void);

/* EXEC: runs one command, streams its I/O; returns 1 if the connection must be closed
 * afterwards (peer gone, protocol error, or descendants outlived the command). */
int op_exec(struct conn *c, const struct frame *req);

/* File operations: each answers with its frames and returns -1 only if the peer is gone. */
int op_read(struct conn *c, const struct frame *req);
int op_write(struct conn *c, const struct frame *req);
int op_stat(struct conn *c, const struct frame *req);
int op_listdir(struct conn *c, const struct frame *req);
int op_mkdir(struct conn *c, const struct frame *req);
int op_remove(struct conn *c, const struct frame *req);
int op_symlink(struct conn *c, const struct frame *req);
int op_chmod(struct conn *c, const struct frame *req);
int op_rename(struct conn *c, const struct frame *req);
int op_walk(struct conn *c, const struct frame *req);
int op_reads(struct conn *c, const struct frame *req);

/* Who a command runs as, resolved from the sandbox's own /etc/passwd and /etc/group. */
#define MAX_GROUPS 256
struct user {
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    int ngroups; /* -1: leave supplementary groups alone */
    char home[4096];
};
/* Resolves "name", "uid", "uid:gid", "name:group"; NULL/"" means the agent's own identity.
 * Returns 0 or an errno, with a message in err. */
int resolve_user(const char *spec, struct user *u, char *err, size_t errlen);

#endif
