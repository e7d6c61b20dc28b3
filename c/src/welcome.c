/* welcome.c -- a subscriber's check of what the WELCOME brought, before anything is mapped:
 * its payload (the head, the pool descriptor, the sync page's layout) and the sync page's
 * fd (a sealed memfd of the announced size).  No GPU (cip_internal.h says what the modules
 * share); the Python subscriber and this library's both run it. */
#include "cip_internal.h"

cip_status
cipi_check_welcome(const uint8_t *p, size_t len, uint32_t n, size_t nfds, struct cipi_welcome *out)
{
    if (len < CIP_WIRE_WELCOME_HEAD_SIZE)
        return cipi_fail(CIP_ERR_PROTOCOL, "WELCOME payload too short (%zu bytes)", len);
    uint64_t desc_len = RD(p, WELCOME_HEAD_DESC_LEN), n_slots = RD(p, WELCOME_HEAD_NUM_SLOTS);
    uint64_t max_subs = RD(p, WELCOME_HEAD_MAX_SUBSCRIBERS), row = RD(p, WELCOME_HEAD_ROW);
    uint64_t sync_nbytes = RD(p, WELCOME_HEAD_SYNC_NBYTES);
    if (n_slots != n || len != CIP_WIRE_WELCOME_HEAD_SIZE + desc_len || !(row < max_subs) ||
        max_subs > 65536 || nfds != (size_t)n + 1)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "WELCOME does not add up: %llu slots (session says %u), %zu payload "
                         "bytes for a %llu-byte descriptor, row %llu of %llu, %zu fds",
                         (unsigned long long)n_slots, n, len, (unsigned long long)desc_len,
                         (unsigned long long)row, (unsigned long long)max_subs, nfds);
    if (cip_parse_descriptor(p + CIP_WIRE_WELCOME_HEAD_SIZE, (size_t)desc_len, &out->desc) !=
        CIP_OK) {
        char why[sizeof cipi_tls_error];
        memcpy(why, cipi_tls_error, sizeof why);
        return cipi_fail(CIP_ERR_PROTOCOL, "bad pool descriptor in WELCOME: %s", why);
    }
    if (out->desc.num_slots != n)
        return cipi_fail(CIP_ERR_PROTOCOL, "WELCOME announces %u slots, the descriptor %u", n,
                         out->desc.num_slots);
    if (cip_sync_layout(n, (uint32_t)max_subs, &out->reads_offset, &out->sync_nbytes) != CIP_OK) {
        char why[sizeof cipi_tls_error];
        memcpy(why, cipi_tls_error, sizeof why);
        return cipi_fail(CIP_ERR_PROTOCOL, "WELCOME: %s", why);
    }
    if (sync_nbytes != out->sync_nbytes)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "the WELCOME announces a %llu-byte sync page; %u slots and %llu rows "
                         "take %zu",
                         (unsigned long long)sync_nbytes, n, (unsigned long long)max_subs,
                         out->sync_nbytes);
    out->row = (uint32_t)row;
    out->max_subscribers = (uint32_t)max_subs;
    out->desc_offset = CIP_WIRE_WELCOME_HEAD_SIZE;
    out->desc_len = (size_t)desc_len;
    return CIP_OK;
}

cip_status
cipi_check_sync_fd(int fd, size_t nbytes)
{
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || seals < 0)
        return cipi_fail(CIP_ERR_PROTOCOL, "the sync page fd is no sealed memfd (%s)",
                         strerror(errno));
    if (!S_ISREG(st.st_mode) || (seals & CIP_WIRE_SYNC_SEALS) != CIP_WIRE_SYNC_SEALS)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "the sync page fd is not sealed against shrinking and growing (seals "
                         "0x%x); refusing to map it",
                         seals);
    if ((uint64_t)st.st_size != nbytes)
        return cipi_fail(CIP_ERR_PROTOCOL, "the sync page is %lld bytes, the WELCOME says %zu",
                         (long long)st.st_size, nbytes);
    return CIP_OK;
}
