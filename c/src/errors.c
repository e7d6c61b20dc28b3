/* errors.c -- errors: the thread's last message, status names and texts (cip_internal.h
 * says what the modules share). */
#include "cip_internal.h"

/* ---- errors ------------------------------------------------------------------------ */

__thread char cipi_tls_error[768];

cip_status
cipi_fail(cip_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cipi_tls_error, sizeof cipi_tls_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *
cip_last_error(void)
{
    return cipi_tls_error;
}

const char *
cip_status_name(cip_status status)
{
    switch (status) {
    case CIP_OK: return "CIP_OK";
    case CIP_ERR_INVALID_ARGUMENT: return "CIP_ERR_INVALID_ARGUMENT";
    case CIP_ERR_TIMEOUT: return "CIP_ERR_TIMEOUT";
    case CIP_ERR_END_OF_STREAM: return "CIP_ERR_END_OF_STREAM";
    case CIP_ERR_PUBLISHER_GONE: return "CIP_ERR_PUBLISHER_GONE";
    case CIP_ERR_EVICTED: return "CIP_ERR_EVICTED";
    case CIP_ERR_REFUSED: return "CIP_ERR_REFUSED";
    case CIP_ERR_PROTOCOL: return "CIP_ERR_PROTOCOL";
    case CIP_ERR_TRANSPORT: return "CIP_ERR_TRANSPORT";
    case CIP_ERR_DESCRIPTOR: return "CIP_ERR_DESCRIPTOR";
    case CIP_ERR_STALE: return "CIP_ERR_STALE";
    case CIP_ERR_NOT_HELD: return "CIP_ERR_NOT_HELD";
    case CIP_ERR_NO_DRIVER: return "CIP_ERR_NO_DRIVER";
    case CIP_ERR_CUDA: return "CIP_ERR_CUDA";
    case CIP_ERR_DEVICE: return "CIP_ERR_DEVICE";
    case CIP_ERR_NO_MEMORY: return "CIP_ERR_NO_MEMORY";
    case CIP_ERR_RAW_SESSION: return "CIP_ERR_RAW_SESSION";
    }
    return "CIP_ERR_UNKNOWN";
}

const char *
cip_strerror(cip_status status)
{
    switch (status) {
    case CIP_OK: return "success";
    case CIP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case CIP_ERR_TIMEOUT: return "timed out";
    case CIP_ERR_END_OF_STREAM: return "the publisher closed the stream";
    case CIP_ERR_PUBLISHER_GONE: return "the publisher is gone (it died or hung up without BYE)";
    case CIP_ERR_EVICTED: return "the publisher evicted this subscriber";
    case CIP_ERR_REFUSED: return "refused";
    case CIP_ERR_PROTOCOL: return "protocol error: malformed or unexpected message";
    case CIP_ERR_TRANSPORT: return "socket or file descriptor transport failed";
    case CIP_ERR_DESCRIPTOR: return "malformed pool descriptor or array handle";
    case CIP_ERR_STALE: return "array handle of a recycled slot";
    case CIP_ERR_NOT_HELD: return "frame not held";
    case CIP_ERR_NO_DRIVER: return "no CUDA driver or device";
    case CIP_ERR_CUDA: return "CUDA driver call failed";
    case CIP_ERR_DEVICE: return "unsupported device";
    case CIP_ERR_NO_MEMORY: return "out of memory";
    case CIP_ERR_RAW_SESSION: return "not available on a raw session";
    }
    return "unknown status";
}
