/* book.c -- the frame book: awaited flags, the record of frames, forcing after a death, the
 * answers (no GPU) (cip_internal.h says what the modules share). */
#include "cip_internal.h"

int
cipi_book_init(struct frame_book *b, uint32_t num_slots, size_t cap)
{
    memset(b, 0, sizeof *b);
    b->num_slots = num_slots;
    b->rec_cap = cap ? cap : 1;
    b->awaited_set = (uint8_t *)calloc(num_slots, 1);
    b->awaited = (uint32_t *)calloc(num_slots, sizeof(uint32_t));
    return b->awaited_set && b->awaited ? 0 : -1;
}

void
cipi_book_free(struct frame_book *b)
{
    free(b->awaited_set);
    free(b->awaited);
    free(b->rec);
    memset(b, 0, sizeof *b);
}

/* Whether slot's flag holds the producer's own write of `generation` or later. */
static int
set_by_producer(volatile uint32_t *flags, uint32_t slot, uint32_t generation)
{
    return flag_load(flags, slot) - generation < CIP_WIRE_SYNC_SET_WINDOW;
}

/* Drop from the front of the record the frames the producer's stream has set.  A
 * forced flag is never taken for the producer's write: such frames stay. */
void
cipi_book_prune(struct frame_book *b, volatile uint32_t *flags)
{
    while (b->rec_len) {
        const struct seen_frame *f = &b->rec[b->rec_head];
        if (!set_by_producer(flags, f->slot, f->generation))
            return;
        b->rec_head = (b->rec_head + 1) % b->rec_alloc;
        b->rec_len--;
    }
}

/* A stream of ours may wait for slot's frame flag to reach `generation`. */
void
cipi_book_note(struct frame_book *b, uint32_t slot, uint32_t generation)
{
    b->awaited_set[slot] = 1;
    b->awaited[slot] = generation;
}

/* A frame was received: unless the host sees its flag set by the producer, note its
 * generation as awaited and record it (a full record drops its oldest frame, counted
 * in `untracked`); prune the record either way.  Returns 1 if recorded. */
int
cipi_book_received(struct frame_book *b, volatile uint32_t *flags, uint64_t seq, uint32_t slot,
              uint32_t generation)
{
    cipi_book_prune(b, flags);
    if (set_by_producer(flags, slot, generation))
        return 0;
    cipi_book_note(b, slot, generation);
    if (b->rec_len >= b->rec_cap) {
        b->rec_head = (b->rec_head + 1) % b->rec_alloc;
        b->rec_len--;
        b->untracked++;
    }
    if (b->rec_len == b->rec_alloc) {
        size_t alloc = b->rec_alloc ? 2 * b->rec_alloc : 64;
        if (alloc > b->rec_cap)
            alloc = b->rec_cap;
        struct seen_frame *r = (struct seen_frame *)cipi_ring_regrow(
            b->rec, sizeof *r, &b->rec_head, b->rec_len, &b->rec_alloc, alloc);
        if (r == NULL) {
            b->untracked++; /* no memory: not recorded, and counted as such */
            return 0;
        }
        b->rec = r;
    }
    struct seen_frame *f = &b->rec[(b->rec_head + b->rec_len) % b->rec_alloc];
    f->seq = seq;
    f->slot = slot;
    f->generation = generation;
    b->rec_len++;
    return 1;
}

/* Whether a stream of ours waits (or may wait) on slot's frame flag, which is not set. */
int
cipi_book_waits_on(const struct frame_book *b, volatile uint32_t *flags, uint32_t slot)
{
    return b->awaited_set[slot] && (int32_t)(flag_load(flags, slot) - b->awaited[slot]) < 0;
}

/* Whether a stream of ours waits (or may wait) on a frame flag that is not set. */
int
cipi_book_pending(const struct frame_book *b, volatile uint32_t *flags)
{
    for (uint32_t s = 0; s < b->num_slots; s++)
        if (cipi_book_waits_on(b, flags, s))
            return 1;
    return 0;
}

/* The producer is dead: force slot's frame flag if a stream of ours may wait on it
 * (cip_flag_force), so that every such wait ends.  Returns 1 if this call stored it. */
int
cipi_book_resolve_slot(struct frame_book *b, volatile uint32_t *flags, uint32_t slot)
{
    if (!b->awaited_set[slot] || cip_flag_force((uint32_t *)&flags[slot], b->awaited[slot]) != 1)
        return 0;
    b->forced++;
    return 1;
}

/* cipi_book_resolve_slot of every slot.  Returns how many were stored. */
uint32_t
cipi_book_resolve(struct frame_book *b, volatile uint32_t *flags)
{
    uint32_t forced = 0;
    for (uint32_t s = 0; s < b->num_slots; s++)
        forced += (uint32_t)cipi_book_resolve_slot(b, flags, s);
    return forced;
}

/* The recorded frames never written (cip_flag_state 0): up to `cap` seqs into `seqs`,
 * their number returned; `*pending`: those not known yet (-1), of which up to
 * `pending_cap` seqs go into `pending_seqs` (NULL: none). */
size_t
cipi_book_answers(const struct frame_book *b, volatile uint32_t *flags, uint64_t *seqs, size_t cap,
             size_t *pending, uint64_t *pending_seqs, size_t pending_cap)
{
    size_t n = 0, unknown = 0;
    for (size_t i = 0; i < b->rec_len; i++) {
        const struct seen_frame *f = &b->rec[(b->rec_head + i) % b->rec_alloc];
        int state = cip_flag_state(flag_load(flags, f->slot), f->generation);
        if (state < 0) {
            if (pending_seqs != NULL && unknown < pending_cap)
                pending_seqs[unknown] = f->seq;
            unknown++;
        } else if (state == 0) {
            if (n < cap)
                seqs[n] = f->seq;
            n++;
        }
    }
    if (pending != NULL)
        *pending = unknown;
    return n;
}
