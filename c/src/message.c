/* message.c -- one channel message decoded and checked, of every kind and either direction,
 * and the messages the engine sends, written: the protocol's message rules, once (the Python
 * channel and this library's subscriber both decode with cipi_decode and send what these
 * writers write; cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* A message type's name, as the protocol writes it ("FRAME"); "?" for none. */
const char *
cipi_type_name(unsigned type)
{
    switch (type) {
    case CIP_WIRE_HELLO: return "HELLO";
    case CIP_WIRE_WELCOME: return "WELCOME";
    case CIP_WIRE_REFUSE: return "REFUSE";
    case CIP_WIRE_FRAME: return "FRAME";
    case CIP_WIRE_RELEASE: return "RELEASE";
    case CIP_WIRE_BYE: return "BYE";
    default: return "?";
    }
}

/* A message of `what` whose fixed part has `head` bytes and whose length field says `len`:
 * the payload is the rest, to the byte, and at most `limit` bytes. */
static cip_status
payload_of(const uint8_t *p, size_t n, size_t head, uint64_t len, uint64_t limit,
           const char *what, struct cipi_msg *out)
{
    if (len > limit)
        return cipi_fail(CIP_ERR_PROTOCOL, "%s length %llu exceeds the limit of %llu bytes", what,
                         (unsigned long long)len, (unsigned long long)limit);
    if (n != head + len)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "%s length field says %llu bytes but the message carries %zu", what,
                         (unsigned long long)len, n - head);
    out->payload = p + head;
    out->len = (uint32_t)len;
    return CIP_OK;
}

cip_status
cipi_decode(const void *data, size_t n, struct cipi_msg *out)
{
    const uint8_t *p = (const uint8_t *)data;
    memset(out, 0, sizeof *out);
    if (n < CIP_WIRE_HEADER_SIZE)
        return cipi_fail(CIP_ERR_PROTOCOL, "message of %zu bytes is shorter than the %d-byte header",
                         n, CIP_WIRE_HEADER_SIZE);
    if (RD(p, HEADER_MAGIC) != CIP_WIRE_MAGIC)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "bad magic 0x%04llx (expected 0x%04x): the peer does not speak the "
                         "cupy_ipcpool channel protocol",
                         (unsigned long long)RD(p, HEADER_MAGIC), CIP_WIRE_MAGIC);
    if (RD(p, HEADER_VERSION) != CIP_WIRE_VERSION)
        return cipi_fail(CIP_ERR_PROTOCOL, "unsupported protocol version %llu (this side speaks %u)",
                         (unsigned long long)RD(p, HEADER_VERSION), CIP_WIRE_VERSION);
    out->type = (unsigned)RD(p, HEADER_TYPE);
    switch (out->type) {
    case CIP_WIRE_FRAME:
        if (n < CIP_WIRE_FRAME_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated FRAME (%zu bytes)", n);
        out->seq = RD(p, FRAME_SEQ);
        out->slot = (uint32_t)RD(p, FRAME_SLOT);
        return payload_of(p, n, CIP_WIRE_FRAME_SIZE, RD(p, FRAME_LEN), CIP_WIRE_MAX_FRAME_PAYLOAD,
                          "FRAME", out);
    case CIP_WIRE_RELEASE:
        if (n != CIP_WIRE_RELEASE_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "RELEASE must be %d bytes, got %zu",
                             CIP_WIRE_RELEASE_SIZE, n);
        out->seq = RD(p, RELEASE_SEQ);
        out->slot = (uint32_t)RD(p, RELEASE_SLOT);
        return CIP_OK;
    case CIP_WIRE_BYE:
        if (n != CIP_WIRE_HEADER_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "BYE must be %d bytes, got %zu", CIP_WIRE_HEADER_SIZE,
                             n);
        return CIP_OK;
    case CIP_WIRE_HELLO: {
        if (n < CIP_WIRE_HELLO_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated HELLO (%zu bytes)", n);
        uint64_t mode = RD(p, HELLO_MODE), credit = RD(p, HELLO_CREDIT);
        if (mode != CIP_WIRE_MODE_BLOCK && mode != CIP_WIRE_MODE_LATEST &&
            mode != CIP_WIRE_MODE_AHEAD)
            return cipi_fail(CIP_ERR_PROTOCOL, "HELLO has unknown mode %llu",
                             (unsigned long long)mode);
        if (credit < 1)
            return cipi_fail(CIP_ERR_PROTOCOL, "HELLO credit must be at least 1");
        out->mode = (uint32_t)mode;
        out->credit = (uint32_t)credit;
        out->pid = (uint32_t)RD(p, HELLO_PID);
        return payload_of(p, n, CIP_WIRE_HELLO_SIZE, RD(p, HELLO_LEN), CIP_WIRE_MAX_HELLO_PAYLOAD,
                          "HELLO", out);
    }
    case CIP_WIRE_WELCOME: {
        if (n < CIP_WIRE_WELCOME_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated WELCOME (%zu bytes)", n);
        uint64_t num_slots = RD(p, WELCOME_NUM_SLOTS), credit = RD(p, WELCOME_CREDIT);
        if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS)
            return cipi_fail(CIP_ERR_PROTOCOL, "WELCOME num_slots %llu is outside 1..%u",
                             (unsigned long long)num_slots, CIP_WIRE_MAX_SLOTS);
        if (credit < 1)
            return cipi_fail(CIP_ERR_PROTOCOL, "WELCOME credit must be at least 1");
        out->sub_id = (uint32_t)RD(p, WELCOME_SUB_ID);
        out->num_slots = (uint32_t)num_slots;
        out->seq = RD(p, WELCOME_NEXT_SEQ);
        out->credit = (uint32_t)credit;
        out->lease_timeout_ms = (uint32_t)RD(p, WELCOME_LEASE_TIMEOUT_MS);
        return payload_of(p, n, CIP_WIRE_WELCOME_SIZE, RD(p, WELCOME_LEN),
                          CIP_WIRE_MAX_WELCOME_PAYLOAD, "WELCOME", out);
    }
    case CIP_WIRE_REFUSE: {
        if (n < CIP_WIRE_REFUSE_SIZE)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated REFUSE (%zu bytes)", n);
        cip_status st = payload_of(p, n, CIP_WIRE_REFUSE_SIZE, RD(p, REFUSE_LEN),
                                   CIP_WIRE_MAX_REFUSE_REASON, "REFUSE", out);
        if (st == CIP_OK && !cipi_valid_utf8(out->payload, out->len, 1))
            return cipi_fail(CIP_ERR_PROTOCOL, "REFUSE reason is not valid UTF-8");
        return st;
    }
    default:
        return cipi_fail(CIP_ERR_PROTOCOL, "unknown message type %u", out->type);
    }
}

/* ---- the writers: every message the engine sends, from the generated layouts ------------ */

/* A payload of `len` bytes for a message whose payloads hold at most `limit`: CIP_OK, or
 * CIP_ERR_INVALID_ARGUMENT in the words of the Python API ("hello payload is ..."). */
static cip_status
payload_within(const char *what, size_t len, unsigned limit)
{
    if (len > limit)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "%s payload is %zu bytes, more than the limit of %u", what, len, limit);
    return CIP_OK;
}

/* A HELLO asking for `mode` and `credit` from process `pid`, its payload of `len` bytes to
 * follow (CIP_WIRE_HELLO_SIZE bytes at p).  CIP_ERR_INVALID_ARGUMENT, nothing written, for a
 * field out of range, in the words of the Python API. */
cip_status
cipi_put_hello(uint8_t *p, unsigned mode, uint64_t credit, uint32_t pid, size_t len)
{
    if (mode > CIP_WIRE_MODE_AHEAD)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "mode must be 0 (block), 1 (latest) or 2 "
                                                   "(ahead), not %u", mode);
    if (credit < 1 || credit > CIP_WIRE_MAX_CREDIT)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "credit must be in 1..%u, not %llu",
                         CIP_WIRE_MAX_CREDIT, (unsigned long long)credit);
    if (payload_within("hello", len, CIP_WIRE_MAX_HELLO_PAYLOAD) != CIP_OK)
        return CIP_ERR_INVALID_ARGUMENT;
    memset(p, 0, CIP_WIRE_HELLO_SIZE);
    WR(p, HELLO_MAGIC, CIP_WIRE_MAGIC);
    WR(p, HELLO_VERSION, CIP_WIRE_VERSION);
    WR(p, HELLO_TYPE, CIP_WIRE_HELLO);
    WR(p, HELLO_MODE, mode);
    WR(p, HELLO_CREDIT, credit);
    WR(p, HELLO_PID, pid);
    WR(p, HELLO_LEN, len);
    return CIP_OK;
}

/* The head of a FRAME (CIP_WIRE_FRAME_SIZE bytes at p); its payload of `len` bytes follows. */
void
cipi_put_frame_head(uint8_t *p, uint64_t seq, uint32_t slot, size_t len)
{
    WR(p, FRAME_MAGIC, CIP_WIRE_MAGIC);
    WR(p, FRAME_VERSION, CIP_WIRE_VERSION);
    WR(p, FRAME_TYPE, CIP_WIRE_FRAME);
    WR(p, FRAME_SEQ, seq);
    WR(p, FRAME_SLOT, slot);
    WR(p, FRAME_LEN, len);
}

/* A RELEASE of frame `seq` in `slot` (CIP_WIRE_RELEASE_SIZE bytes at p). */
void
cipi_put_release(uint8_t *p, uint64_t seq, uint32_t slot)
{
    WR(p, RELEASE_MAGIC, CIP_WIRE_MAGIC);
    WR(p, RELEASE_VERSION, CIP_WIRE_VERSION);
    WR(p, RELEASE_TYPE, CIP_WIRE_RELEASE);
    WR(p, RELEASE_SEQ, seq);
    WR(p, RELEASE_SLOT, slot);
}

/* A BYE (CIP_WIRE_HEADER_SIZE bytes at p). */
void
cipi_put_bye(uint8_t *p)
{
    WR(p, HEADER_MAGIC, CIP_WIRE_MAGIC);
    WR(p, HEADER_VERSION, CIP_WIRE_VERSION);
    WR(p, HEADER_TYPE, CIP_WIRE_BYE);
}

/* The head of a WELCOME (CIP_WIRE_WELCOME_SIZE bytes at p) to subscriber `sub_id`: the ring's
 * `num_slots`, the next frame's seq, the granted credit, the lease timeout; its payload of
 * `len` bytes to follow.  CIP_ERR_INVALID_ARGUMENT, nothing written, for a field out of range,
 * in the words of the Python API. */
cip_status
cipi_put_welcome(uint8_t *p, uint32_t sub_id, long long num_slots, uint64_t next_seq,
                 long long credit, long long lease_timeout_ms, size_t len)
{
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "num_slots must be in 1..%u, not %lld",
                         CIP_WIRE_MAX_SLOTS, num_slots);
    if (credit < 1 || credit > CIP_WIRE_MAX_CREDIT)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "credit must be in 1..%u, not %lld",
                         CIP_WIRE_MAX_CREDIT, credit);
    if (lease_timeout_ms < 0 || lease_timeout_ms > UINT32_MAX)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "lease_timeout_ms must be in 0..%u, not %lld",
                         UINT32_MAX, lease_timeout_ms);
    if (payload_within("welcome", len, CIP_WIRE_MAX_WELCOME_PAYLOAD) != CIP_OK)
        return CIP_ERR_INVALID_ARGUMENT;
    memset(p, 0, CIP_WIRE_WELCOME_SIZE);
    WR(p, WELCOME_MAGIC, CIP_WIRE_MAGIC);
    WR(p, WELCOME_VERSION, CIP_WIRE_VERSION);
    WR(p, WELCOME_TYPE, CIP_WIRE_WELCOME);
    WR(p, WELCOME_SUB_ID, sub_id);
    WR(p, WELCOME_NUM_SLOTS, num_slots);
    WR(p, WELCOME_NEXT_SEQ, next_seq);
    WR(p, WELCOME_CREDIT, credit);
    WR(p, WELCOME_LEASE_TIMEOUT_MS, lease_timeout_ms);
    WR(p, WELCOME_LEN, len);
    return CIP_OK;
}

/* How many of the `n` bytes of UTF-8 text `s` to keep for at most `max`: a longer text is cut
 * before the character the cut would split (a REFUSE's reason must stay UTF-8). */
size_t
cipi_utf8_cut(const char *s, size_t n, size_t max)
{
    if (n <= max)
        return n;
    n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
        n--; /* s[n], the first byte left out, continues a character: leave it all out */
    return n;
}

/* A REFUSE telling the UTF-8 `reason` of `len` bytes, cut before the character that would
 * pass CIP_WIRE_MAX_REFUSE_REASON (cipi_utf8_cut), at p (room for CIP_WIRE_REFUSE_SIZE +
 * CIP_WIRE_MAX_REFUSE_REASON); its size. */
size_t
cipi_put_refuse(uint8_t *p, const char *reason, size_t len)
{
    size_t n = cipi_utf8_cut(reason, len, CIP_WIRE_MAX_REFUSE_REASON);
    WR(p, REFUSE_MAGIC, CIP_WIRE_MAGIC);
    WR(p, REFUSE_VERSION, CIP_WIRE_VERSION);
    WR(p, REFUSE_TYPE, CIP_WIRE_REFUSE);
    WR(p, REFUSE_LEN, n);
    memcpy(p + CIP_WIRE_REFUSE_SIZE, reason, n);
    return CIP_WIRE_REFUSE_SIZE + n;
}
