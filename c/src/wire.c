/* wire.c -- the wire: compile-time checks against the generated layouts, dtypes, pool
 * descriptors, array handles, frame payloads (cip_internal.h says what the modules
 * share). */
#include "cip_internal.h"

/* ---- compile-time checks: the public header and this file against the wire ---- */

#define CIP_LAST_FIELD(NAME, FIELD)                                                      \
    CIP_ASSERT(CIP_WIRE_##NAME##_##FIELD##_OFF + CIP_WIRE_##NAME##_##FIELD##_WIDTH ==     \
                   CIP_WIRE_##NAME##_SIZE,                                               \
               NAME##_ends_with_##FIELD)

CIP_ASSERT(CIP_MAX_NDIM == CIP_WIRE_MAX_NDIM, max_ndim);
CIP_ASSERT(CIP_MAX_ARRAYS == CIP_WIRE_MAX_ARRAYS, max_arrays);
CIP_ASSERT(CIP_MAX_METADATA == CIP_WIRE_MAX_METADATA, max_metadata);
CIP_ASSERT(CIP_COMPLEX128 + 1 == CIP_WIRE_DTYPE_COUNT, dtype_count);
CIP_ASSERT(CIP_MODE_BLOCK == CIP_WIRE_MODE_BLOCK && CIP_MODE_LATEST == CIP_WIRE_MODE_LATEST,
           modes);
CIP_ASSERT(CIP_WIRE_POOL_ID_NBYTES == 16 && CIP_WIRE_DEVICE_UUID_NBYTES == 16, id_sizes);
CIP_ASSERT(CIP_WIRE_DESC_POOL_ID_WIDTH == CIP_WIRE_POOL_ID_NBYTES, pool_id_field);
CIP_ASSERT(CIP_WIRE_DESC_DEVICE_UUID_WIDTH == CIP_WIRE_DEVICE_UUID_NBYTES, uuid_field);
CIP_ASSERT(CIP_WIRE_MAX_SOCKET_PATH < sizeof(((cip_descriptor *)0)->socket_path), path_field);
CIP_ASSERT(CIP_WIRE_MAX_SOCKET_PATH < sizeof(((struct sockaddr_un *)0)->sun_path), path_nul);
CIP_ASSERT(CIP_WIRE_DESC_MAGIC_WIDTH == 4 && sizeof(CIP_WIRE_DESC_MAGIC) == 5, desc_magic);
CIP_ASSERT(CIP_WIRE_MAX_CHANNEL_SLOTS + 1 <= CIP_WIRE_MAX_FDS, channel_fds);
CIP_ASSERT(CIP_WIRE_SYNC_FLAG_BYTES == 4, flag_words);
CIP_ASSERT(CIP_WIRE_POOL_ID_NBYTES <= CIP_WIRE_FDSERVER_MAX_TOKEN_LEN, token_fits);
CIP_ASSERT(CIP_WIRE_MAX_FRAME_SIZE == CIP_WIRE_FRAME_SIZE + CIP_WIRE_MAX_FRAME_PAYLOAD, frame_max);
CIP_LAST_FIELD(HEADER, TYPE);
CIP_LAST_FIELD(HELLO, LEN);
CIP_LAST_FIELD(WELCOME, LEN);
CIP_LAST_FIELD(REFUSE, LEN);
CIP_LAST_FIELD(FRAME, LEN);
CIP_LAST_FIELD(RELEASE, SLOT);
CIP_LAST_FIELD(WELCOME_HEAD, SYNC_NBYTES);
CIP_LAST_FIELD(FRAME_HEAD, METADATA_LEN);
CIP_LAST_FIELD(DESC, EXPORTER_PID_NAMESPACE);
CIP_LAST_FIELD(HANDLE, DTYPE);
/* every message starts with the header */
CIP_ASSERT(CIP_WIRE_FRAME_TYPE_OFF == CIP_WIRE_HEADER_TYPE_OFF &&
               CIP_WIRE_WELCOME_TYPE_OFF == CIP_WIRE_HEADER_TYPE_OFF,
           header_first);

static const size_t dtype_itemsizes[] = CIP_WIRE_DTYPE_ITEMSIZES;
static const char *const dtype_names[] = CIP_WIRE_DTYPE_NAMES;
CIP_ASSERT(sizeof dtype_itemsizes / sizeof dtype_itemsizes[0] == CIP_WIRE_DTYPE_COUNT, dtypes);

const char *
cip_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < (int)CIP_WIRE_DTYPE_COUNT ? dtype_names[dtype] : NULL;
}

size_t
cip_dtype_itemsize(int dtype)
{
    return dtype >= 0 && dtype < (int)CIP_WIRE_DTYPE_COUNT ? dtype_itemsizes[dtype] : 0;
}

/* ---- descriptors and array handles ------------------------------------------------ */

/* Whether s[0..n) is valid UTF-8 (no overlong forms, no surrogates, nothing past
 * U+10FFFF), with a NUL byte allowed only if allow_nul. */
int
cipi_valid_utf8(const uint8_t *s, size_t n, int allow_nul)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t extra;
        uint32_t cp;
        if (c == 0 && !allow_nul)
            return 0;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            extra = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            extra = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            extra = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + extra >= n)
            return 0;
        for (size_t k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) ||
            (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += extra + 1;
    }
    return 1;
}

cip_status
cip_parse_descriptor(const void *bytes, size_t n, cip_descriptor *out)
{
    const uint8_t *p = (const uint8_t *)bytes;
    if (p == NULL || out == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_parse_descriptor: NULL argument");
    if (n < 4 || memcmp(p, CIP_WIRE_DESC_MAGIC, 4) != 0)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "not a cupy_ipcpool pool descriptor (bad magic%s)",
                    n < 4 ? ", input truncated" : "");
    if (n < CIP_WIRE_DESC_VERSION_OFF + CIP_WIRE_DESC_VERSION_WIDTH)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "pool descriptor truncated: %zu bytes", n);
    uint64_t version = RD(p, DESC_VERSION);
    if (version < CIP_WIRE_DESC_MIN_VERSION || version > CIP_WIRE_DESC_MAX_VERSION)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "unsupported pool descriptor format version %llu; this library supports "
                    "version %u: use a cupy_ipcpool of the same wire format in every process",
                    (unsigned long long)version, CIP_WIRE_DESC_VERSION);
    if (n < CIP_WIRE_DESC_SIZE)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "pool descriptor truncated: %zu bytes, the header alone is %d", n,
                    CIP_WIRE_DESC_SIZE);
    if (RD(p, DESC_KIND) != CIP_WIRE_DESC_KIND_POOL)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "wrong message kind %llu for a pool descriptor",
                    (unsigned long long)RD(p, DESC_KIND));
    if (RD(p, DESC_RESERVED) != 0)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "reserved header byte is %llu, must be 0",
                    (unsigned long long)RD(p, DESC_RESERVED));
    uint64_t num_slots = RD(p, DESC_NUM_SLOTS);
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "num_slots=%llu is out of range [1, %u]",
                    (unsigned long long)num_slots, CIP_WIRE_MAX_SLOTS);
    size_t end_fds = CIP_WIRE_DESC_SIZE + 4 * (size_t)num_slots;
    if (n < end_fds + 2)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "pool descriptor truncated: %zu bytes, %llu fds need %zu",
                    n, (unsigned long long)num_slots, end_fds + 2);
    size_t path_len = (size_t)rd(p + end_fds, 2);
    size_t pos = end_fds + 2;
    if (path_len > CIP_WIRE_MAX_SOCKET_PATH)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "socket path length %zu exceeds the limit of %u bytes",
                    path_len, CIP_WIRE_MAX_SOCKET_PATH);
    if (n < pos + path_len)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "pool descriptor truncated: %zu bytes, the socket path needs %zu", n,
                    pos + path_len);
    if (n > pos + path_len)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "pool descriptor has %zu trailing bytes after its end",
                    n - pos - path_len);
    if (path_len && !cipi_valid_utf8(p + pos, path_len, 0))
        return cipi_fail(CIP_ERR_DESCRIPTOR, "socket path is not valid UTF-8 (or holds a NUL)");
    cip_descriptor d;
    memset(&d, 0, sizeof d);
    memcpy(d.pool_id, p + CIP_WIRE_DESC_POOL_ID_OFF, 16);
    memcpy(d.device_uuid, p + CIP_WIRE_DESC_DEVICE_UUID_OFF, 16);
    uint64_t pid = RD(p, DESC_EXPORTER_PID), uid = RD(p, DESC_EXPORTER_UID);
    uint64_t ordinal = RD(p, DESC_DEVICE_ORDINAL);
    d.exporter_start_time = RD(p, DESC_EXPORTER_START_TIME);
    d.exporter_pid_namespace = RD(p, DESC_EXPORTER_PID_NAMESPACE);
    d.slot_nbytes = RD(p, DESC_SLOT_NBYTES);
    d.alloc_nbytes = RD(p, DESC_ALLOC_NBYTES);
    if (pid < 1 || pid > CIP_I32_MAX)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "exporter_pid=%llu is out of range",
                    (unsigned long long)pid);
    if (uid >= 0xFFFFFFFFull)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "exporter_uid=%llu is out of range",
                    (unsigned long long)uid);
    if (ordinal > CIP_I32_MAX)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "device_ordinal=%llu is out of range",
                    (unsigned long long)ordinal);
    if (d.slot_nbytes < 1 || d.slot_nbytes > CIP_WIRE_MAX_SLOT_NBYTES)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "slot_nbytes=%llu is out of range [1, %llu]",
                    (unsigned long long)d.slot_nbytes, (unsigned long long)CIP_WIRE_MAX_SLOT_NBYTES);
    if (d.alloc_nbytes < 1 || d.alloc_nbytes > CIP_WIRE_MAX_SLOT_NBYTES)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "alloc_nbytes=%llu is out of range",
                    (unsigned long long)d.alloc_nbytes);
    if (d.alloc_nbytes < d.slot_nbytes)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "alloc_nbytes=%llu is smaller than slot_nbytes=%llu",
                    (unsigned long long)d.alloc_nbytes, (unsigned long long)d.slot_nbytes);
    for (uint64_t i = 0; i < num_slots; i++) {
        if (rd(p + CIP_WIRE_DESC_SIZE + 4 * i, 4) > CIP_I32_MAX)
            return cipi_fail(CIP_ERR_DESCRIPTOR, "fds[%llu] is out of range", (unsigned long long)i);
    }
    d.exporter_pid = (uint32_t)pid;
    d.exporter_uid = (uint32_t)uid;
    d.device_ordinal = (uint32_t)ordinal;
    d.num_slots = (uint32_t)num_slots;
    memcpy(d.socket_path, p + pos, path_len);
    d.socket_path[path_len] = '\0';
    d.fds_le = p + CIP_WIRE_DESC_SIZE;
    *out = d;
    return CIP_OK;
}

/* Decode one packed handle at p (avail bytes); *used = its size.  Ranges only. */
cip_status
cipi_parse_handle(const uint8_t *p, size_t avail, cip_array *a, size_t *used)
{
    if (avail < CIP_WIRE_HANDLE_SIZE)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "array handle truncated: %zu bytes", avail);
    uint64_t ndim = RD(p, HANDLE_NDIM), code = RD(p, HANDLE_DTYPE);
    if (ndim > CIP_WIRE_MAX_NDIM)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "array handle ndim=%llu exceeds the limit %u",
                    (unsigned long long)ndim, CIP_WIRE_MAX_NDIM);
    if (code >= CIP_WIRE_DTYPE_COUNT)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "unknown dtype code %llu in array handle",
                    (unsigned long long)code);
    size_t size = CIP_WIRE_HANDLE_SIZE + 16 * (size_t)ndim;
    if (avail < size)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "array handle truncated: %llu dimensions need %zu bytes, %zu remain",
                    (unsigned long long)ndim, 16 * (size_t)ndim, avail - CIP_WIRE_HANDLE_SIZE);
    memset(a, 0, sizeof *a);
    a->slot = (uint32_t)RD(p, HANDLE_SLOT);
    if (RD(p, HANDLE_SLOT) >= CIP_WIRE_MAX_SLOTS)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "array handle slot %llu is out of range",
                    (unsigned long long)RD(p, HANDLE_SLOT));
    a->generation = RD(p, HANDLE_GENERATION);
    a->offset = RD(p, HANDLE_OFFSET);
    a->ndim = (uint32_t)ndim;
    a->dtype = (int32_t)code;
    a->itemsize = (uint32_t)dtype_itemsizes[code];
    const uint8_t *dims = p + CIP_WIRE_HANDLE_SIZE;
    uint64_t elements = 1, bytes = a->itemsize;
    for (uint64_t i = 0; i < ndim; i++) {
        uint64_t n = rd(dims + 8 * i, 8);
        if (n > CIP_I64_MAX)
            return cipi_fail(CIP_ERR_DESCRIPTOR, "shape[%llu]=%llu is out of range",
                        (unsigned long long)i, (unsigned long long)n);
        a->shape[i] = n;
        a->strides[i] = (int64_t)rd(dims + 8 * (ndim + i), 8);
        if (n > 1) {
            if (bytes > CIP_I64_MAX / n)
                return cipi_fail(CIP_ERR_DESCRIPTOR, "array of %llu dimensions is too large",
                            (unsigned long long)ndim);
            bytes *= n;
        }
        elements = n == 0 ? 0 : (elements == 0 ? 0 : elements * n);
    }
    a->nbytes = elements * a->itemsize;
    *used = size;
    return CIP_OK;
}

/* Python's ArrayHandle.cipi_check_fits: every byte inside [0, slot_nbytes), aligned. */
cip_status
cipi_check_fits(const cip_array *a, uint64_t slot_nbytes)
{
    uint64_t itemsize = a->itemsize;
    if (a->offset % itemsize)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "offset %llu is not a multiple of the item size %llu of %s; offsets and "
                    "strides must be multiples of the item size",
                    (unsigned long long)a->offset, (unsigned long long)itemsize,
                    dtype_names[a->dtype]);
    /* the extent, in 128 bits; any term beyond 2**64 cannot fit a slot */
    __extension__ typedef __int128 i128;
    const i128 limit = (i128)1 << 64;
    i128 lo = (i128)a->offset, hi = (i128)a->offset;
    int empty = 0;
    for (uint32_t i = 0; i < a->ndim; i++) {
        if (a->shape[i] == 0) {
            empty = 1;
            break;
        }
    }
    if (!empty) {
        for (uint32_t i = 0; i < a->ndim; i++) {
            uint64_t n = a->shape[i];
            if (n <= 1)
                continue;
            int64_t s = a->strides[i];
            if ((uint64_t)(s < 0 ? -(i128)s : (i128)s) % itemsize)
                return cipi_fail(CIP_ERR_DESCRIPTOR,
                            "stride %lld of axis %u is not a multiple of the item size %llu of "
                            "%s; offsets and strides must be multiples of the item size",
                            (long long)s, i, (unsigned long long)itemsize, dtype_names[a->dtype]);
            i128 span = (i128)s * (i128)(n - 1);
            if (span < 0)
                lo += span;
            else
                hi += span;
            if (lo < -limit || hi > limit)
                break;
        }
        hi += itemsize;
    }
    if (lo < 0 || hi > (i128)slot_nbytes)
        return cipi_fail(CIP_ERR_DESCRIPTOR,
                    "array touches bytes [%lld, %lld) which do not fit in a slot of %llu bytes",
                    (long long)(lo < -limit ? -limit : lo), (long long)(hi > limit ? limit : hi),
                    (unsigned long long)slot_nbytes);
    return CIP_OK;
}

/* The head of FRAME seq's payload, received for slot: the one check of a FRAME head, for
 * every way a subscriber takes a frame (by message, or as the confirmation of a frame handed
 * out ahead).  The flag index is the slot, or slot | CIP_WIRE_FRAME_VOID for a void frame
 * (a frame of a Publisher(ahead=True) taken and not published: no arrays, never written);
 * at most CIP_WIRE_MAX_ARRAYS arrays and CIP_WIRE_MAX_METADATA metadata bytes. */
cip_status
cipi_frame_head(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                struct cipi_frame_head *out)
{
    const uint8_t *p = (const uint8_t *)payload;
    unsigned long long s = (unsigned long long)seq;
    if (len < CIP_WIRE_FRAME_HEAD_SIZE)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu: payload too short (%zu bytes)", s, len);
    uint64_t flag = RD(p, FRAME_HEAD_FLAG), generation = RD(p, FRAME_HEAD_GENERATION);
    uint64_t count = RD(p, FRAME_HEAD_NUM_ARRAYS), meta_len = RD(p, FRAME_HEAD_METADATA_LEN);
    int void_frame = flag == ((uint64_t)slot | CIP_WIRE_FRAME_VOID);
    if (flag != slot && !void_frame)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu in slot %u names flag %llu", s, slot,
                    (unsigned long long)flag);
    if (count > CIP_WIRE_MAX_ARRAYS || meta_len > CIP_WIRE_MAX_METADATA)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu: %llu arrays, %llu metadata bytes", s,
                    (unsigned long long)count, (unsigned long long)meta_len);
    if (void_frame && count)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu: a void frame with %llu arrays", s,
                    (unsigned long long)count);
    out->generation = (uint32_t)generation;
    out->num_arrays = (uint32_t)count;
    out->metadata_len = (uint32_t)meta_len;
    out->is_void = void_frame;
    return CIP_OK;
}

/* cip_parse_frame_payload, and whether the frame is void. */
cip_status
cipi_parse_frame_payload(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                    uint64_t slot_nbytes, uint64_t slot_base, cip_array *arrays, size_t cap,
                    cip_frame *out, int *is_void)
{
    const uint8_t *p = (const uint8_t *)payload;
    if ((p == NULL && len) || out == NULL || (arrays == NULL && cap))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_parse_frame_payload: NULL argument");
    unsigned long long s = (unsigned long long)seq;
    struct cipi_frame_head head;
    cip_status st = cipi_frame_head(payload, len, seq, slot, &head);
    if (st != CIP_OK)
        return st;
    uint64_t generation = head.generation, count = head.num_arrays, meta_len = head.metadata_len;
    if (count > cap)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "frame %llu has %llu arrays, room for %zu", s,
                    (unsigned long long)count, cap);
    size_t pos = CIP_WIRE_FRAME_HEAD_SIZE;
    for (uint64_t i = 0; i < count; i++) {
        size_t used = 0;
        cip_array *a = &arrays[i];
        st = cipi_parse_handle(p + pos, len - pos, a, &used);
        if (st == CIP_OK && a->slot != slot)
            st = cipi_fail(CIP_ERR_DESCRIPTOR, "array %llu lies in slot %u, not in the frame's", 
                      (unsigned long long)i, a->slot);
        if (st == CIP_OK && (a->generation & 0xFFFFFFFFull) != generation)
            st = cipi_fail(CIP_ERR_DESCRIPTOR, "array %llu is of generation %llu, the frame of %llu",
                      (unsigned long long)i, (unsigned long long)a->generation,
                      (unsigned long long)generation);
        if (st == CIP_OK)
            st = cipi_check_fits(a, slot_nbytes);
        if (st != CIP_OK) {
            char why[sizeof cipi_tls_error];
            memcpy(why, cipi_tls_error, sizeof why);
            return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu: %s", s, why);
        }
        a->data = slot_base + a->offset;
        pos += used;
    }
    if (len - pos != meta_len)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu: metadata length does not match", s);
    out->seq = seq;
    out->slot = slot;
    out->generation = (uint32_t)generation;
    out->num_arrays = (uint32_t)count;
    out->metadata_len = (uint32_t)meta_len;
    out->arrays = arrays;
    out->metadata = p + pos;
    if (is_void)
        *is_void = head.is_void;
    return CIP_OK;
}

cip_status
cip_parse_frame_payload(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                        uint64_t slot_nbytes, uint64_t slot_base, cip_array *arrays, size_t cap,
                        cip_frame *out)
{
    return cipi_parse_frame_payload(payload, len, seq, slot, slot_nbytes, slot_base, arrays, cap, out,
                               NULL);
}
