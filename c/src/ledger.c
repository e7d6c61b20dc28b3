/* ledger.c -- the frame ledger: rule 1 of a subscriber's stream (the order of frames, one
 * frame held per slot, releases of frames held) and frames released ahead of their
 * message (no GPU) (cip_internal.h says what the modules share). */
#include "cip_internal.h"

cip_status
cipi_ledger_init(struct cipi_ledger *l, uint32_t num_slots, uint64_t first_seq)
{
    memset(l, 0, sizeof *l);
    l->num_slots = num_slots;
    l->first_seq = first_seq;
    size_t n = num_slots ? num_slots : 1;
    l->holds = (struct cipi_hold *)calloc(n, sizeof *l->holds);
    l->ahead = (uint64_t *)calloc(n, sizeof *l->ahead);
    if (l->holds == NULL || l->ahead == NULL) {
        cipi_ledger_free(l);
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory for a ledger of %u slots", num_slots);
    }
    return CIP_OK;
}

void
cipi_ledger_free(struct cipi_ledger *l)
{
    free(l->holds);
    free(l->ahead);
    memset(l, 0, sizeof *l);
}

/* Whether frame `seq` came by message already (it is at most the last one received). */
int
cipi_ledger_received(const struct cipi_ledger *l, uint64_t seq)
{
    return l->have_seq && seq >= l->first_seq && seq <= l->last_seq;
}

/* Rule 1, for FRAME `seq` in `slot`: the slot is one of the ring's; the seq is not below
 * the WELCOME's next_seq and comes after every seq received before; the slot holds no
 * frame this subscriber still holds (the publisher never overwrites a leased slot).
 * CIP_ERR_PROTOCOL says which failed; else the frame is the last one received. */
cip_status
cipi_ledger_receive(struct cipi_ledger *l, uint64_t seq, uint64_t slot)
{
    if (slot >= l->num_slots)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu names slot %llu of %u",
                         (unsigned long long)seq, (unsigned long long)slot, l->num_slots);
    if (seq < l->first_seq)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu arrived before the first, %llu",
                         (unsigned long long)seq, (unsigned long long)l->first_seq);
    if (l->have_seq && seq <= l->last_seq)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu arrived after frame %llu",
                         (unsigned long long)seq, (unsigned long long)l->last_seq);
    if (l->holds[slot].held)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "frame %llu is in slot %llu, where this subscriber still holds frame %llu",
                         (unsigned long long)seq, (unsigned long long)slot,
                         (unsigned long long)l->holds[slot].seq);
    l->have_seq = 1;
    l->last_seq = seq;
    return CIP_OK;
}

/* Frame `seq` in `slot` (received and judged) is held now, unless it was released ahead
 * of its message: 1 held, 0 released ahead (and forgotten here). */
int
cipi_ledger_hold(struct cipi_ledger *l, uint64_t seq, uint32_t slot)
{
    for (uint32_t i = 0; i < l->ahead_len; i++) {
        if (l->ahead[i] == seq) {
            l->ahead[i] = l->ahead[--l->ahead_len];
            return 0;
        }
    }
    l->holds[slot].held = 1;
    l->holds[slot].seq = seq;
    return 1;
}

/* Frame `seq` in `slot`, forgotten for a release whose read-flag write then failed, is
 * held again: CIP_ERR_PROTOCOL unless it was received and the slot holds nothing now. */
cip_status
cipi_ledger_hold_again(struct cipi_ledger *l, uint64_t seq, uint64_t slot)
{
    if (slot >= l->num_slots || !cipi_ledger_received(l, seq) || l->holds[slot].held)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu cannot be held again in slot %llu",
                         (unsigned long long)seq, (unsigned long long)slot);
    l->holds[slot].held = 1;
    l->holds[slot].seq = seq;
    return CIP_OK;
}

/* Whether frame `seq` is held in `slot`. */
int
cipi_ledger_holds(const struct cipi_ledger *l, uint64_t seq, uint64_t slot)
{
    return slot < l->num_slots && l->holds[slot].held && l->holds[slot].seq == seq;
}

/* A release of frame `seq` in `slot` is allowed only while it is held (CIP_ERR_NOT_HELD:
 * never received, released already, or another slot). */
cip_status
cipi_ledger_check_release(const struct cipi_ledger *l, uint64_t seq, uint64_t slot)
{
    if (!cipi_ledger_holds(l, seq, slot))
        return cipi_fail(CIP_ERR_NOT_HELD, "release of frame %llu in slot %llu, which is not held",
                         (unsigned long long)seq, (unsigned long long)slot);
    return CIP_OK;
}

/* The frame held in `slot` (a slot of the ring) is not any more. */
void
cipi_ledger_forget(struct cipi_ledger *l, uint32_t slot)
{
    l->holds[slot].held = 0;
}

/* A release of frame `seq` in `slot` before its message came (frames handed out ahead):
 * only for a frame not received yet nor released ahead already, in a slot of the ring,
 * and at most num_slots at once (no schedule explains more).  CIP_ERR_PROTOCOL else. */
cip_status
cipi_ledger_release_ahead(struct cipi_ledger *l, uint64_t seq, uint64_t slot)
{
    int again = 0;
    for (uint32_t i = 0; i < l->ahead_len; i++)
        again |= l->ahead[i] == seq;
    if (slot >= l->num_slots || seq < l->first_seq || cipi_ledger_received(l, seq) || again ||
        l->ahead_len >= l->num_slots)
        return cipi_fail(CIP_ERR_PROTOCOL, "frame %llu in slot %llu cannot be released ahead of "
                                           "its message",
                         (unsigned long long)seq, (unsigned long long)slot);
    l->ahead[l->ahead_len++] = seq;
    return CIP_OK;
}
