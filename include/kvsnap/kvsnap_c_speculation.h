/* kvsnap_c_speculation.h — the C API of speculative decoding's exact rollback
 * (kvsnap/speculation.h). Part of kvsnap_c.h, which includes it; its conventions hold (statuses,
 * kvsnap_last_error, destroy calls). */
#ifndef KVSNAP_KVSNAP_C_SPECULATION_H
#define KVSNAP_KVSNAP_C_SPECULATION_H

#include "kvsnap/kvsnap_c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Speculation ---------------------------------------------------------------------------
 * Exact rollback of a verified chunk, for every cache kind (speculation.h): begin(k) before the
 * verify forward of the last accepted token and k drafts, accept(a) after it; every layer then
 * stands at start + a + 1, attention layers rewound, whole-state layers restored from captures
 * the forward took. With a prefix cache session, append only the accepted tokens (or append the
 * drafts and kvsnap_session_retract_outputs the rejected ones). One thread drives a
 * speculation at a time (the caches it calls lock themselves). */

typedef struct kvsnap_speculation kvsnap_speculation;

typedef struct kvsnap_speculation_stats {
  int64_t rounds;   /* accepted rounds */
  int64_t drafted;  /* draft tokens verified */
  int64_t accepted; /* of them, confirmed */
  int64_t restores; /* layer restores from a capture */
  int64_t rewinds;  /* layer offset rewinds */
} kvsnap_speculation_stats;

/* Rounds over sequence `seq` (in [0, 2^20)) of `count` layers, borrowed: they must outlive it
 * (a NULL entry is a stateless layer; a cache listed twice is one state, rolled back once). */
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_create(kvsnap_cache* const* layers, size_t count,
                                                      int32_t seq, kvsnap_speculation** out);
/* Cancels an open round (its captures dropped, the layers left where they are), then frees. */
KVSNAP_EXPORT void kvsnap_speculation_destroy(kvsnap_speculation* speculation);
/* Opens a round of `drafts` drafts at the layers' common offset. Fails, changing nothing, for
 * drafts < 0 or > 2^20, a round ending past position 2^31 - 1, an open round, layers that
 * disagree on their offset, or a layer of any kind with captures already scheduled for the
 * sequence. */
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_begin(kvsnap_speculation* speculation,
                                                     int64_t drafts);
/* Closes the round: the first `accepted` drafts were confirmed. Fails (KVSNAP_ERROR), the round
 * left open and no layer moved, as Speculation::accept says (speculation.h): unless 0 <=
 * accepted <= drafts, every layer stands at the verify forward's end and every layer that must
 * move can. Out of memory (KVSNAP_OUT_OF_MEMORY) restoring a window may have moved some
 * whole-state layers: accept again with the same count (it moves the others only), or cancel
 * and reset the sequence. */
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_accept(kvsnap_speculation* speculation,
                                                      int64_t accepted);
/* Drops an open round's captures without moving any layer (nothing to do without a round); a
 * schedule that replaced the round's on a layer is someone else's and stays. */
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_cancel(kvsnap_speculation* speculation);
/* Whether a round is open, its start and drafts (the last round's once closed); NULL: skipped */
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_get_round(const kvsnap_speculation* speculation,
                                                         bool* open, int64_t* start,
                                                         int64_t* drafts);
KVSNAP_EXPORT kvsnap_status kvsnap_speculation_get_stats(const kvsnap_speculation* speculation,
                                                         kvsnap_speculation_stats* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSNAP_KVSNAP_C_SPECULATION_H */
