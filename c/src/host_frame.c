/* host_frame.c -- frames in host memory: the array specs (a NumPy typestr and a shape), their
 * encoding (the remote tier's FRAME and a host frame's payload share it), where each array
 * sits in a slot, and a host frame's payload (u16 count, u32 metadata length, the specs, the
 * metadata).  The Python package (remote/_wire.py, remote/_host.py) and C publishers and
 * subscribers call these; nobody else writes or reads the layout.  Layouts and limits:
 * cupy_ipcpool_wire.h (CIP_WIRE_SPEC_*, CIP_WIRE_HOST_*). */
#include "cip_internal.h"

CIP_ASSERT(CIP_SPEC_MAX_TYPESTR == CIP_WIRE_SPEC_MAX_TYPESTR, spec_max_typestr);
CIP_ASSERT(CIP_SPEC_MAX_NDIM == CIP_WIRE_SPEC_MAX_NDIM, spec_max_ndim);
CIP_ASSERT(CIP_MAX_ARRAYS == CIP_WIRE_HOST_MAX_ARRAYS, host_max_arrays);
CIP_ASSERT(CIP_MAX_METADATA == CIP_WIRE_HOST_MAX_METADATA, host_max_metadata);

cip_status
cip_array_spec_check(const cip_array_spec *spec)
{
    if (spec == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_spec_check: a NULL argument");
    const char *ts = spec->typestr;
    size_t len = strnlen(ts, sizeof spec->typestr);
    int ascii = 1;
    for (size_t i = 0; i < len; i++)
        ascii &= (unsigned char)ts[i] < 0x80;
    if (len < 3 || len > CIP_WIRE_SPEC_MAX_TYPESTR || !ascii)
        return cipi_fail(CIP_ERR_PROTOCOL, "bad dtype string '%.*s'", (int)len, ts);
    int digits = 1;
    for (size_t i = 2; i < len; i++)
        digits &= ts[i] >= '0' && ts[i] <= '9';
    if (strchr("<>|", ts[0]) == NULL || strchr(CIP_WIRE_SPEC_KINDS, ts[1]) == NULL || !digits)
        return cipi_fail(CIP_ERR_PROTOCOL, "dtype '%s' is not a plain numeric type", ts);
    if (ts[2] == '0' || len > 4 || atoi(ts + 2) > (int)CIP_WIRE_SPEC_MAX_ITEMSIZE)
        return cipi_fail(CIP_ERR_PROTOCOL, "dtype '%s' has an item size out of range", ts);
    if (spec->ndim > CIP_WIRE_SPEC_MAX_NDIM)
        return cipi_fail(CIP_ERR_PROTOCOL, "%u dimensions (at most %u)", spec->ndim,
                         CIP_WIRE_SPEC_MAX_NDIM);
    for (uint32_t d = 0; d < spec->ndim; d++)
        if (spec->shape[d] >= (1ull << 62))
            return cipi_fail(CIP_ERR_PROTOCOL, "dimension %u of the shape, %llu, is out of range",
                             d, (unsigned long long)spec->shape[d]);
    return CIP_OK;
}

uint64_t
cip_array_spec_nbytes(const cip_array_spec *spec)
{
    uint64_t n = (uint64_t)atoi(spec->typestr + 2);
    for (uint32_t d = 0; d < spec->ndim && d < CIP_WIRE_SPEC_MAX_NDIM; d++) {
        if (spec->shape[d] != 0 && n > UINT64_MAX / spec->shape[d])
            return UINT64_MAX;
        n *= spec->shape[d];
    }
    return n;
}

cip_status
cip_array_specs_encode(const cip_array_spec *specs, size_t n, void *out, size_t cap, size_t *len)
{
    if ((n && specs == NULL) || (cap && out == NULL) || len == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_specs_encode: a NULL argument");
    uint8_t *o = out;
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        cip_status st = cip_array_spec_check(&specs[i]);
        if (st != CIP_OK)
            return st;
        size_t tlen = strlen(specs[i].typestr), ndim = specs[i].ndim;
        size_t need = 2 + tlen + 8 * ndim;
        if (pos + need > cap)
            return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                             "the array specs do not fit in %zu bytes", cap);
        o[pos++] = (uint8_t)tlen;
        memcpy(o + pos, specs[i].typestr, tlen);
        pos += tlen;
        o[pos++] = (uint8_t)ndim;
        for (size_t d = 0; d < ndim; d++, pos += 8)
            wr(o + pos, 8, specs[i].shape[d]);
    }
    *len = pos;
    return CIP_OK;
}

cip_status
cip_array_specs_decode(const void *data, size_t len, size_t count, cip_array_spec *specs,
                       size_t *used)
{
    if ((len && data == NULL) || (count && specs == NULL) || used == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_specs_decode: a NULL argument");
    const uint8_t *d = data;
    size_t pos = 0;
    for (size_t i = 0; i < count; i++) {
        if (pos >= len)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated array spec");
        size_t tlen = d[pos++];
        if (tlen > CIP_WIRE_SPEC_MAX_TYPESTR || pos + tlen + 1 > len)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated or oversized dtype string");
        cip_array_spec *s = &specs[i];
        memset(s, 0, sizeof *s);
        for (size_t k = 0; k < tlen; k++)
            if (d[pos + k] >= 0x80 || d[pos + k] == 0)
                return cipi_fail(CIP_ERR_PROTOCOL, "dtype string is not ASCII without NULs");
        memcpy(s->typestr, d + pos, tlen);
        pos += tlen;
        size_t ndim = d[pos++];
        if (ndim > CIP_WIRE_SPEC_MAX_NDIM || pos + 8 * ndim > len)
            return cipi_fail(CIP_ERR_PROTOCOL, "truncated shape or %zu dimensions (at most %u)",
                             ndim, CIP_WIRE_SPEC_MAX_NDIM);
        s->ndim = (uint32_t)ndim;
        for (size_t k = 0; k < ndim; k++, pos += 8)
            s->shape[k] = rd(d + pos, 8);
        cip_status st = cip_array_spec_check(s);
        if (st != CIP_OK)
            return st;
    }
    *used = pos;
    return CIP_OK;
}

cip_status
cip_array_layout(const cip_array_spec *specs, size_t n, uint64_t slot_nbytes, uint64_t *offsets)
{
    if (n && (specs == NULL || offsets == NULL))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_layout: a NULL argument");
    uint64_t pos = 0;
    const uint64_t align = CIP_WIRE_SPEC_ALIGN;
    for (size_t i = 0; i < n; i++) {
        cip_status st = cip_array_spec_check(&specs[i]);
        if (st != CIP_OK)
            return st;
        uint64_t nbytes = cip_array_spec_nbytes(&specs[i]);
        pos = (pos + align - 1) / align * align;
        offsets[i] = pos;
        if (nbytes > slot_nbytes || pos > slot_nbytes - nbytes) {
            /* the total, as far as it can be counted */
            uint64_t total = nbytes > UINT64_MAX - pos ? UINT64_MAX : pos + nbytes;
            for (size_t k = i + 1; k < n && total != UINT64_MAX; k++) {
                if (cip_array_spec_check(&specs[k]) != CIP_OK)
                    return CIP_ERR_PROTOCOL; /* (its message) */
                uint64_t more = cip_array_spec_nbytes(&specs[k]);
                total = (total + align - 1) / align * align;
                total = more > UINT64_MAX - total ? UINT64_MAX : total + more;
            }
            return cipi_fail(CIP_ERR_PROTOCOL,
                             "the frame's arrays need %llu bytes; a receive slot has %llu",
                             (unsigned long long)total, (unsigned long long)slot_nbytes);
        }
        pos += nbytes;
    }
    return CIP_OK;
}

cip_status
cip_host_frame_encode(const cip_array_spec *specs, size_t n, const void *metadata,
                      size_t meta_len, void *out, size_t cap, size_t *len)
{
    if ((meta_len && metadata == NULL) || (cap && out == NULL) || len == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_host_frame_encode: a NULL argument");
    if (n > CIP_WIRE_HOST_MAX_ARRAYS || meta_len > CIP_WIRE_HOST_MAX_METADATA)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "at most %u arrays and %u metadata bytes per frame, not %zu and %zu",
                         CIP_WIRE_HOST_MAX_ARRAYS, CIP_WIRE_HOST_MAX_METADATA, n, meta_len);
    if (cap < CIP_WIRE_HOST_HEAD_SIZE)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "a host frame does not fit in %zu bytes",
                         cap);
    uint8_t *o = out;
    size_t specs_len;
    cip_status st = cip_array_specs_encode(specs, n, o + CIP_WIRE_HOST_HEAD_SIZE,
                                           cap - CIP_WIRE_HOST_HEAD_SIZE, &specs_len);
    if (st != CIP_OK)
        return st;
    size_t pos = CIP_WIRE_HOST_HEAD_SIZE + specs_len;
    if (meta_len > cap - pos)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "a host frame does not fit in %zu bytes",
                         cap);
    WR(o, HOST_HEAD_COUNT, n);
    WR(o, HOST_HEAD_METADATA_LEN, meta_len);
    if (meta_len)
        memcpy(o + pos, metadata, meta_len);
    *len = pos + meta_len;
    return CIP_OK;
}

cip_status
cip_host_frame_decode(const void *payload, size_t len, uint64_t slot_nbytes,
                      cip_array_spec *specs, uint64_t *offsets, size_t cap, size_t *n,
                      const void **metadata, size_t *meta_len)
{
    if ((len && payload == NULL) || (cap && (specs == NULL || offsets == NULL)) || n == NULL ||
        metadata == NULL || meta_len == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_host_frame_decode: a NULL argument");
    const uint8_t *p = payload;
    if (len < CIP_WIRE_HOST_HEAD_SIZE)
        return cipi_fail(CIP_ERR_PROTOCOL, "host frame payload too short");
    size_t count = (size_t)RD(p, HOST_HEAD_COUNT);
    size_t mlen = (size_t)RD(p, HOST_HEAD_METADATA_LEN);
    if (count > CIP_WIRE_HOST_MAX_ARRAYS || mlen > CIP_WIRE_HOST_MAX_METADATA)
        return cipi_fail(CIP_ERR_PROTOCOL, "host frame with %zu arrays and %zu metadata bytes",
                         count, mlen);
    if (count > cap)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "a host frame of %zu arrays, room for %zu (CIP_MAX_ARRAYS always "
                         "suffice)",
                         count, cap);
    size_t used;
    cip_status st = cip_array_specs_decode(p + CIP_WIRE_HOST_HEAD_SIZE,
                                           len - CIP_WIRE_HOST_HEAD_SIZE, count, specs, &used);
    if (st != CIP_OK)
        return st;
    if (len - CIP_WIRE_HOST_HEAD_SIZE - used != mlen)
        return cipi_fail(CIP_ERR_PROTOCOL, "host frame metadata length does not match");
    if ((st = cip_array_layout(specs, count, slot_nbytes, offsets)) != CIP_OK)
        return st;
    *n = count;
    *metadata = p + CIP_WIRE_HOST_HEAD_SIZE + used;
    *meta_len = mlen;
    return CIP_OK;
}
