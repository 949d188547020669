/* User lookup without NSS: a static binary cannot load NSS modules, and the sandbox's own
 * /etc/passwd and /etc/group are the only databases that matter inside it. */
#include "agent.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LINE_MAX_LEN 4096
#define NFIELDS 7

/* Reads the next line of a colon-separated database, split into fields (in place).
 * Over-long lines are skipped whole. Returns the number of fields, or -1 at EOF. */
static int next_record(FILE *f, char *line, char **fields)
{
    for (;;) {
        if (!fgets(line, LINE_MAX_LEN, f))
            return -1;
        size_t n = strlen(line);
        if (n > 0 && line[n - 1] == '\n') {
            line[n - 1] = 0;
        } else if (!feof(f)) {
            int ch;
            while ((ch = fgetc(f)) != EOF && ch != '\n')
                ;
            continue;
        }
        if (line[0] == '#' || line[0] == 0)
            continue;
        int nf = 0;
        char *p = line;
        while (nf < NFIELDS) {
            fields[nf++] = p;
            p = strchr(p, ':');
            if (!p)
                break;
            *p++ = 0;
        }
        return nf;
    }
}

/* Parses a decimal id; -1 if s is not one. */
static long long parse_id(const char *s)
{
    if (!*s)
        return -1;
    long long v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > 0xfffffffeLL)
            return -1;
        v = v * 10 + (*s - '0');
    }
    return v > 0xfffffffeLL ? -1 : v;
}

struct pwent {
    char name[256];
    uid_t uid;
    gid_t gid;
    char home[4096];
};

/* Finds a passwd entry by name (name != NULL) or by uid. 1 found, 0 not found. */
static int find_passwd(const char *name, uid_t uid, struct pwent *out)
{
    FILE *f = fopen("/etc/passwd", "re");
    if (!f)
        return 0;
    char line[LINE_MAX_LEN];
    char *fl[NFIELDS];
    int found = 0, nf;
    while (!found && (nf = next_record(f, line, fl)) >= 0) {
        if (nf < 4)
            continue;
        long long u = parse_id(fl[2]), g = parse_id(fl[3]);
        if (u < 0 || g < 0)
            continue;
        if (name ? strcmp(fl[0], name) != 0 : (uid_t)u != uid)
            continue;
        snprintf(out->name, sizeof out->name, "%s", fl[0]);
        out->uid = (uid_t)u;
        out->gid = (gid_t)g;
        snprintf(out->home, sizeof out->home, "%s", nf >= 6 && fl[5][0] ? fl[5] : "/");
        found = 1;
    }
    fclose(f);
    return found;
}

static int member_of(char *members, const char *name)
{
    for (char *tok = strtok(members, ","); tok; tok = strtok(NULL, ","))
        if (strcmp(tok, name) == 0)
            return 1;
    return 0;
}

/* Looks up group `group` by name (sets *gid, returns 1/0) or, with group == NULL, collects
 * the groups listing `user` as a member into u->groups. */
static int scan_groups(const char *group, gid_t *gid, const char *user, struct user *u)
{
    FILE *f = fopen("/etc/group", "re");
    if (!f)
        return 0;
    char line[LINE_MAX_LEN];
    char *fl[NFIELDS];
    int found = 0, nf;
    while ((nf = next_record(f, line, fl)) >= 0) {
        if (nf < 3)
            continue;
        long long g = parse_id(fl[2]);
        if (g < 0)
            continue;
        if (group) {
            if (strcmp(fl[0], group) == 0) {
                *gid = (gid_t)g;
                found = 1;
                break;
            }
        } else if (nf >= 4 && u->ngroups < MAX_GROUPS && member_of(fl[3], user)) {
            u->groups[u->ngroups++] = (gid_t)g;
        }
    }
    fclose(f);
    return found;
}

int resolve_user(const char *spec, struct user *u, char *err, size_t errlen)
{
    struct pwent pw;
    u->ngroups = -1;
    if (!spec || !*spec) {
        u->uid = getuid();
        u->gid = getgid();
        snprintf(u->home, sizeof u->home, "%s", find_passwd(NULL, u->uid, &pw) ? pw.home : "/");
        return 0;
    }
    char buf[512];
    if (snprintf(buf, sizeof buf, "%s", spec) >= (int)sizeof buf) {
        snprintf(err, errlen, "user spec too long");
        return EINVAL;
    }
    char *group = strchr(buf, ':');
    if (group)
        *group++ = 0;
    if (!buf[0] || (group && !group[0])) {
        snprintf(err, errlen, "invalid user spec %s", spec);
        return EINVAL;
    }
    long long id = parse_id(buf);
    int known = id >= 0 ? find_passwd(NULL, (uid_t)id, &pw) : find_passwd(buf, 0, &pw);
    if (!known && id < 0) {
        snprintf(err, errlen, "unknown user %s (not in /etc/passwd)", buf);
        return ENOENT;
    }
    /* Like runc: an unknown numeric uid runs with gid 0 and HOME=/. */
    u->uid = known ? pw.uid : (uid_t)id;
    u->gid = known ? pw.gid : 0;
    snprintf(u->home, sizeof u->home, "%s", known ? pw.home : "/");
    if (group) {
        long long gid = parse_id(group);
        if (gid >= 0) {
            u->gid = (gid_t)gid;
        } else if (!scan_groups(group, &u->gid, NULL, u)) {
            snprintf(err, errlen, "unknown group %s (not in /etc/group)", group);
            return ENOENT;
        }
    }
    /* Like initgroups: the primary group, plus the user's memberships unless a group was
     * given explicitly. */
    u->groups[0] = u->gid;
    u->ngroups = 1;
    if (!group && known)
        scan_groups(NULL, NULL, pw.name, u);
    return 0;
}
