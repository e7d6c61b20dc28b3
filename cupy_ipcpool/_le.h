/*
 * Little-endian reads of the wire formats' fields, for cupy_ipcpool's
 * compiled code (cupy_ipcpool.channel._frameio):
 * every field of the message layouts is little-endian ("<" in
 * their struct formats), whatever the machine.
 */
#ifndef CUPY_IPCPOOL_LE_H
#define CUPY_IPCPOOL_LE_H

static inline unsigned long long
le64(const unsigned char *p)
{
    unsigned long long v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static inline unsigned int
le32(const unsigned char *p)
{
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
           ((unsigned int)p[3] << 24);
}

static inline unsigned int
le16(const unsigned char *p)
{
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8);
}

#endif /* CUPY_IPCPOOL_LE_H */
