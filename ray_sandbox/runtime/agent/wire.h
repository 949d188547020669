/* Wire format shared with protocol.py: frames are u32 big-endian payload length, u8 type,
 * payload. Request payloads are TLVs: u8 tag, u32 big-endian length, value; integers are
 * 8-byte big-endian two's complement. */
#ifndef RSB_WIRE_H
#define RSB_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define PROTOCOL_VERSION 1
#define FRAME_HDR 5
#define FRAME_MAX (1u << 20)      /* largest payload either side may send */
#define OUT_CAP (FRAME_MAX + 65536u) /* one max frame plus small frames queued before it */

/* client -> agent: requests */
enum {
    T_PING = 0x01, T_EXEC = 0x02, T_READ = 0x03, T_WRITE = 0x04, T_STAT = 0x05,
    T_LISTDIR = 0x06, T_MKDIR = 0x07, T_REMOVE = 0x08, T_SYMLINK = 0x09, T_CHMOD = 0x0a,
    T_RENAME = 0x0b, T_WALK = 0x0c, T_READS = 0x0d,
};
/* stream frames: DATA goes both ways (stdin, file content); CLOSE ends the client's stream */
enum { T_DATA = 0x20, T_CLOSE = 0x21, T_SIGNAL = 0x22, T_RESIZE = 0x23 };
/* agent -> client */
enum {
    T_OK = 0x40, T_ERROR = 0x41, T_STARTED = 0x42, T_STDOUT = 0x43, T_STDERR = 0x44,
    T_EXIT = 0x45, T_ENTRY = 0x46, T_END = 0x47,
};
/* TLV tags */
enum {
    G_ARG = 1, G_ENV = 2, G_ENV_SET = 3, G_CWD = 4, G_USER = 5, G_TIMEOUT_MS = 6,
    G_MAX_OUTPUT = 7, G_PTY_ROWS = 8, G_PTY_COLS = 9,
    G_PATH = 10, G_PATH2 = 11, G_MODE = 12, G_APPEND = 13, G_PARENTS = 14, G_RECURSIVE = 15,
    G_FOLLOW = 16, G_OFFSET = 17, G_LENGTH = 18, G_CHUNK = 19,
    G_ERRNO = 30, G_MESSAGE = 31, G_PID = 32, G_EXIT_CODE = 33, G_SIGNAL = 34,
    G_TIMED_OUT = 35, G_TRUNCATED = 36, G_DURATION_US = 37, G_RETIRE = 38, G_VERSION = 39,
    G_TYPE = 40, G_SIZE = 41, G_UID = 42, G_GID = 43, G_MTIME_NS = 44, G_LINK = 45,
    G_INO = 46, G_NLINK = 47, G_DEV = 48,
};

struct frame {
    uint8_t type;
    uint32_t len;
    const unsigned char *data; /* points into the connection's input buffer */
};

/* One client connection: buffered input, bounded output queue. The socket is non-blocking;
 * the blocking helpers poll. */
struct conn {
    int fd;
    unsigned char *in;
    size_t in_off, in_len;
    unsigned char *out;
    size_t out_off, out_len;
    size_t frame_start; /* offset of the frame being built by out_begin */
    int frame_bad;      /* a TLV did not fit: out_end drops the frame */
};

int conn_init(struct conn *c, int fd);
/* Reads whatever the socket has. >0 bytes read, 0 EOF, -1 error (errno EAGAIN: nothing yet). */
int conn_fill(struct conn *c);
/* Takes one complete buffered frame: 1 taken, 0 need more bytes, -1 protocol error. */
int conn_take(struct conn *c, struct frame *f);
/* Blocks for the next frame: 1 got one, 0 peer closed, -1 error. */
int conn_recv(struct conn *c, struct frame *f);
/* After an answer, the client's remaining stream frames (data it no longer needs to send)
 * run up to its CLOSE; skips them so the next request starts clean. 0 ok, 1 close. */
int conn_skip_to_close(struct conn *c);
/* Writes what the socket accepts now: 0 ok (maybe partial), -1 peer gone. */
int conn_flush_some(struct conn *c);
/* Writes everything queued, blocking: 0 ok, -1 peer gone. */
int conn_flush(struct conn *c);
/* Free output space (compacts the queue first). */
size_t conn_out_room(struct conn *c);
/* Makes room for a payload of `len` (blocking flush if needed); returns where it goes. */
unsigned char *conn_reserve(struct conn *c, size_t len);
/* Queues the frame whose payload was written at conn_reserve's pointer. */
void conn_commit(struct conn *c, uint8_t type, size_t len);
int conn_send(struct conn *c, uint8_t type, const void *data, size_t len);

/* TLV frame builder: begin, put fields, end (0 ok, -1 the frame did not fit and was dropped). */
void out_begin(struct conn *c, uint8_t type);
void out_put(struct conn *c, uint8_t tag, const void *data, size_t len);
void out_str(struct conn *c, uint8_t tag, const char *s);
void out_int(struct conn *c, uint8_t tag, int64_t v);
int out_end(struct conn *c);
/* Queues and flushes ERROR {errno, message}. */
int send_error(struct conn *c, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int send_ok(struct conn *c);

/* TLV reader over one frame's payload. */
struct tlv {
    uint8_t tag;
    uint32_t len;
    const unsigned char *val;
};
struct tlv_iter {
    const unsigned char *p, *end;
};
void tlv_start(struct tlv_iter *it, const struct frame *f);
/* 1 next field, 0 done, -1 malformed */
int tlv_next(struct tlv_iter *it, struct tlv *t);
int64_t tlv_int(const struct tlv *t);
/* Copies a string field into dst (NUL-terminated); -1 if it holds NUL or does not fit. */
int tlv_str(const struct tlv *t, char *dst, size_t cap);

uint32_t get_u32(const unsigned char *p);
void put_u32(unsigned char *p, uint32_t v);

#endif
