/* Framing and TLV encoding over a non-blocking unix stream socket. */
#include "wire.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define IN_CAP (FRAME_HDR + FRAME_MAX)
#define TLV_HDR 5

uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = v >> 24;
    p[1] = v >> 16;
    p[2] = v >> 8;
    p[3] = v;
}

int conn_init(struct conn *c, int fd)
{
    memset(c, 0, sizeof *c);
    c->fd = fd;
    c->in = malloc(IN_CAP);
    c->out = malloc(OUT_CAP);
    return c->in && c->out ? 0 : -1;
}

static int wait_fd(int fd, short events)
{
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        int r = poll(&p, 1, -1);
        if (r >= 0)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

int conn_fill(struct conn *c)
{
    if (c->in_off > 0 && (c->in_off == c->in_len || IN_CAP - c->in_len < 65536)) {
        memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
        c->in_len -= c->in_off;
        c->in_off = 0;
    }
    if (c->in_len == IN_CAP) { /* a full frame is always takeable before this happens */
        errno = EPROTO;
        return -1;
    }
    for (;;) {
        ssize_t n = read(c->fd, c->in + c->in_len, IN_CAP - c->in_len);
        if (n >= 0) {
            c->in_len += (size_t)n;
            return (int)(n > 0);
        }
        if (errno != EINTR)
            return -1;
    }
}

int conn_take(struct conn *c, struct frame *f)
{
    size_t avail = c->in_len - c->in_off;
    if (avail < FRAME_HDR)
        return 0;
    const unsigned char *h = c->in + c->in_off;
    uint32_t len = get_u32(h);
    if (len > FRAME_MAX)
        return -1;
    if (avail < FRAME_HDR + (size_t)len)
        return 0;
    f->type = h[4];
    f->len = len;
    f->data = h + FRAME_HDR;
    c->in_off += FRAME_HDR + len;
    return 1;
}

int conn_recv(struct conn *c, struct frame *f)
{
    for (;;) {
        int r = conn_take(c, f);
        if (r != 0)
            return r;
        r = conn_fill(c);
        if (r > 0)
            continue;
        if (r == 0)
            return 0;
        if (errno != EAGAIN || wait_fd(c->fd, POLLIN) < 0)
            return -1;
    }
}

int conn_skip_to_close(struct conn *c)
{
    struct frame f;
    for (;;) {
        if (conn_recv(c, &f) <= 0)
            return 1;
        if (f.type == T_CLOSE)
            return 0;
        if (f.type != T_DATA && f.type != T_SIGNAL && f.type != T_RESIZE)
            return 1;
    }
}

int conn_flush_some(struct conn *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 0;
        return -1;
    }
    c->out_off = c->out_len = 0;
    return 0;
}

int conn_flush(struct conn *c)
{
    while (c->out_len > 0) {
        if (conn_flush_some(c) < 0)
            return -1;
        if (c->out_len > 0 && wait_fd(c->fd, POLLOUT) < 0)
            return -1;
    }
    return 0;
}

size_t conn_out_room(struct conn *c)
{
    if (c->out_off > 0) {
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
    }
    return OUT_CAP - c->out_len;
}

unsigned char *conn_reserve(struct conn *c, size_t len)
{
    if (len > FRAME_MAX)
        return NULL;
    if (conn_out_room(c) < FRAME_HDR + len && conn_flush(c) < 0)
        return NULL;
    return c->out + c->out_len + FRAME_HDR;
}

void conn_commit(struct conn *c, uint8_t type, size_t len)
{
    unsigned char *h = c->out + c->out_len;
    put_u32(h, (uint32_t)len);
    h[4] = type;
    c->out_len += FRAME_HDR + len;
}

int conn_send(struct conn *c, uint8_t type, const void *data, size_t len)
{
    unsigned char *p = conn_reserve(c, len);
    if (!p)
        return -1;
    if (len)
        memcpy(p, data, len);
    conn_commit(c, type, len);
    return 0;
}

/* Frames built with out_* are small (metadata): reserve a generous bound up front. */
#define SMALL_FRAME_MAX (3 * 4096 + 1024)

void out_begin(struct conn *c, uint8_t type)
{
    c->frame_bad = conn_reserve(c, SMALL_FRAME_MAX) == NULL;
    c->frame_start = c->out_len;
    if (!c->frame_bad) {
        c->out[c->frame_start + 4] = type;
        c->out_len += FRAME_HDR;
    }
}

void out_put(struct conn *c, uint8_t tag, const void *data, size_t len)
{
    if (c->frame_bad)
        return;
    size_t used = c->out_len - c->frame_start - FRAME_HDR;
    if (used + TLV_HDR + len > SMALL_FRAME_MAX) {
        c->frame_bad = 1;
        return;
    }
    unsigned char *p = c->out + c->out_len;
    p[0] = tag;
    put_u32(p + 1, (uint32_t)len);
    if (len)
        memcpy(p + TLV_HDR, data, len);
    c->out_len += TLV_HDR + len;
}

void out_str(struct conn *c, uint8_t tag, const char *s)
{
    out_put(c, tag, s, strlen(s));
}

void out_int(struct conn *c, uint8_t tag, int64_t v)
{
    unsigned char b[8];
    uint64_t u = (uint64_t)v;
    for (int i = 7; i >= 0; i--, u >>= 8)
        b[i] = (unsigned char)u;
    out_put(c, tag, b, sizeof b);
}

int out_end(struct conn *c)
{
    if (c->frame_bad) {
        c->out_len = c->frame_start;
        return -1;
    }
    put_u32(c->out + c->frame_start, (uint32_t)(c->out_len - c->frame_start - FRAME_HDR));
    return 0;
}

int send_error(struct conn *c, int err, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    out_begin(c, T_ERROR);
    out_int(c, G_ERRNO, err);
    out_str(c, G_MESSAGE, msg);
    if (out_end(c) < 0)
        return -1;
    return conn_flush(c);
}

int send_ok(struct conn *c)
{
    return conn_send(c, T_OK, NULL, 0) < 0 ? -1 : conn_flush(c);
}

void tlv_start(struct tlv_iter *it, const struct frame *f)
{
    it->p = f->data;
    it->end = f->data + f->len;
}

int tlv_next(struct tlv_iter *it, struct tlv *t)
{
    if (it->p == it->end)
        return 0;
    if (it->end - it->p < TLV_HDR)
        return -1;
    t->tag = it->p[0];
    t->len = get_u32(it->p + 1);
    if ((size_t)(it->end - it->p - TLV_HDR) < t->len)
        return -1;
    t->val = it->p + TLV_HDR;
    it->p += TLV_HDR + t->len;
    return 1;
}

int64_t tlv_int(const struct tlv *t)
{
    uint64_t v = 0;
    for (uint32_t i = 0; i < t->len && i < 8; i++)
        v = v << 8 | t->val[i];
    return (int64_t)v;
}

int tlv_str(const struct tlv *t, char *dst, size_t cap)
{
    if (t->len >= cap || memchr(t->val, 0, t->len))
        return -1;
    memcpy(dst, t->val, t->len);
    dst[t->len] = 0;
    return 0;
}
