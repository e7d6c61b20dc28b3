/* raw.c -- what every session answers (info, welcome, fds, fileno, error) and the raw
 * session's receive and release (cip_internal.h says what the modules share). */
#include "cip_internal.h"

cip_status
cip_sub_get_info(const cip_sub *sub, cip_sub_info *info)
{
    if (sub == NULL || info == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_get_info: NULL argument");
    *info = sub->info;
    return CIP_OK;
}

cip_status
cip_sub_welcome_payload(const cip_sub *sub, const uint8_t **payload, size_t *len)
{
    if (sub == NULL || payload == NULL || len == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_welcome_payload: NULL argument");
    *payload = sub->welcome;
    *len = sub->welcome_len;
    return CIP_OK;
}

cip_status
cip_sub_take_fds(cip_sub *sub, int *fds, size_t cap, size_t *count)
{
    if (sub == NULL || count == NULL || (fds == NULL && cap))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_take_fds: NULL argument");
    if (sub->gpu)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "the fds of a GPU subscription are its own");
    *count = sub->nfds;
    size_t k = sub->nfds < cap ? sub->nfds : cap;
    memcpy(fds, sub->fds, k * sizeof(int));
    cipi_close_fds(sub->fds + k, sub->nfds - k);
    sub->nfds = 0;
    return CIP_OK;
}

int
cip_sub_device(const cip_sub *sub)
{
    return sub && sub->pool ? sub->pool->device : -1;
}

int
cip_sub_fileno(const cip_sub *sub)
{
    return sub ? sub->sock : -1;
}

const char *
cip_sub_error(const cip_sub *sub)
{
    return sub ? sub->error : "";
}

cip_status
cip_sub_recv_raw(cip_sub *sub, int timeout_ms, cip_raw_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_recv_raw: NULL argument");
    if (sub->gpu)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "a GPU subscription receives with cip_sub_recv");
    uint64_t seq;
    uint32_t slot, len;
    const uint8_t *payload;
    cip_status st = cipi_next_frame(sub, timeout_ms, &seq, &slot, &payload, &len);
    if (st != CIP_OK)
        return st;
    cipi_ledger_hold(&sub->ledger, seq, slot);
    frame->seq = seq;
    frame->slot = slot;
    frame->payload = payload;
    frame->payload_len = len;
    return CIP_OK;
}

cip_status
cip_sub_release_raw(cip_sub *sub, uint64_t seq, uint32_t slot)
{
    if (sub == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_release_raw: NULL argument");
    if (sub->gpu)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "a GPU subscription releases with cip_sub_release");
    cip_status usable = cipi_sub_usable(sub);
    if (usable != CIP_OK)
        return usable;
    cip_status st = cipi_ledger_check_release(&sub->ledger, seq, slot);
    if (st != CIP_OK)
        return st;
    return cipi_release_slot(sub, seq, slot, NULL, 0);
}
